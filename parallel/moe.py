"""Expert-parallel mixture-of-experts layer.

The experts of a layer are partitioned over the expert-parallel (EP) group: EP rank e
holds experts [e * X/E, (e + 1) * X/E). Inside the tensor-parallel (TP) group, each of
those experts is split like a dense MLP: TP rank t holds slice t of the intermediate
size (its rows of gate/up, its columns of down). So each of the T*E ranks holds a distinct
1/(T*E) of the layer (see `parallel/state.py` for the rank layout). The router gate is
replicated and runs before this layer, so every rank knows each token's top-k experts.

Combining with an all-reduce. Here attention is tensor-parallel and every TP group runs
the same batch, so every rank holds the same tokens when the MoE layer starts. Each rank
runs its local experts' slices on the tokens routed to them, weights the results by the
routing weights, and leaves zeros for tokens whose experts live elsewhere; summing over
all ranks (one all-reduce, like a row-parallel layer) gives every rank the full output.

Dispatch with all-to-all instead. When attention runs data-parallel, each TP group holds
different tokens and a sum would mix them. Then the layer would, within each EP group,
(1) count how many of its (token, expert) pairs go to each EP rank and exchange the counts
(all_to_all_single on a [E] tensor); (2) permute its token copies so pairs bound for the
same rank are contiguous and send them (all_to_all_single with those split sizes); (3) run
the local experts on what it received (all-reducing over the TP group as now); (4) send the
results back along the reverse splits; (5) un-permute, multiply by the routing weights and
sum the k copies per token. Only routed tokens cross the network instead of a dense [N, H]
sum per rank, which is why large EP deployments use it; `forward`'s signature would not change.
"""

import torch
import torch.nn.functional as F
from torch import nn

from raylane.parallel import onednn
from raylane.parallel.layers import copy_weight, divide
from raylane.parallel.state import get_ep_rank, get_ep_size, get_tp_rank, get_tp_size, moe_all_reduce
from raylane.parallel.weight_processing import WeightProcessing


def topk_softmax(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Route each token to its top-k experts. Returns (float32 weights [N, k], ids [N, k]).

    Softmax over all experts in float32 (as HF does), then optionally rescale the k
    chosen probabilities to sum to one.
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class FusedMoE(nn.Module):
    """This rank's experts, and its TP slice of each, as two 3D weights.

    w13: [X_local, 2 * I_local, H], gate rows then up rows (HF's `gate_up_proj` layout).
    w2:  [X_local, H, I_local] (HF's `down_proj`). I_local = intermediate_size / tp_size.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str = "silu",
        ep_rank: int | None = None,
        ep_size: int | None = None,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ):
        super().__init__()
        self.ep_rank = get_ep_rank() if ep_rank is None else ep_rank
        self.ep_size = get_ep_size() if ep_size is None else ep_size
        self.tp_rank = get_tp_rank() if tp_rank is None else tp_rank
        self.tp_size = get_tp_size() if tp_size is None else tp_size
        if num_experts % self.ep_size:
            raise ValueError(
                f"{num_experts} experts cannot be split evenly over expert-parallel size {self.ep_size}"
            )
        if hidden_act != "silu":
            raise ValueError(f"FusedMoE supports hidden_act 'silu', not {hidden_act!r}")
        self.num_experts, self.top_k = num_experts, top_k
        self.intermediate_size = divide(intermediate_size, self.tp_size)  # this rank's slice
        self.num_local_experts = num_experts // self.ep_size
        self.expert_start = self.ep_rank * self.num_local_experts
        e, i = self.num_local_experts, self.intermediate_size
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, hidden_size, i), requires_grad=False)
        local = range(self.expert_start, self.expert_start + e)
        self.w13.shard_ids = tuple((x, s) for x in local for s in ("gate", "up"))
        self.w2.shard_ids = tuple((x, "down") for x in local)
        self.w13.weight_loader = self.w2.weight_loader = self.weight_loader

    def weight_loader(
        self,
        param: nn.Parameter,
        loaded_weight: torch.Tensor,
        shard_id: str | None = None,
        expert_id: int | None = None,
    ) -> None:
        """Load either a fused 3D tensor of all experts (expert_id None) or one expert's
        2D `gate`/`up`/`down` weight; experts of other EP ranks are skipped, and only this
        TP rank's slice of the intermediate size is read."""
        i = self.intermediate_size
        start = self.tp_rank * i
        if expert_id is None:
            mine = loaded_weight.narrow(0, self.expert_start, self.num_local_experts)
            if param is self.w2:
                copy_weight(param.data, mine.narrow(2, start, i))
                return
            full = i * self.tp_size
            copy_weight(param.data[:, :i], mine.narrow(1, start, i))
            copy_weight(param.data[:, i:], mine.narrow(1, full + start, i))
            return
        local = expert_id - self.expert_start
        if not 0 <= local < self.num_local_experts:
            return
        if shard_id == "down":
            copy_weight(param.data[local], loaded_weight.narrow(1, start, i))
            return
        rows = slice(0, i) if shard_id == "gate" else slice(i, 2 * i)
        copy_weight(param.data[local, rows], loaded_weight.narrow(0, start, i))

    # (w13 per expert, w2 per expert) once `process_weights_after_loading` replaced the 3D weights.
    packed_experts: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None

    def process_weights_after_loading(self, processing: WeightProcessing) -> None:
        """Experts stay in the model dtype under `quantization`; on CPU they are packed for oneDNN."""
        if processing.prepack:
            self.packed_experts = ([onednn.pack(w) for w in self.w13], [onednn.pack(w) for w in self.w2])
            del self.w13, self.w2

    def _expert_linear(self, x: torch.Tensor, which: int, expert: int) -> torch.Tensor:
        """x @ w13[expert].T (which=0) or x @ w2[expert].T (which=1)."""
        if self.packed_experts is not None:
            return onednn.linear(x, self.packed_experts[which][expert])
        return F.linear(x, (self.w13, self.w2)[which][expert])

    def forward(
        self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """hidden [N, H], topk_ids/topk_weights [N, k] -> [N, H] summed over all ranks."""
        if hidden.is_cuda and self.packed_experts is None and grouped_mm_fits(hidden, self.w13, self.w2):
            out = self._forward_grouped(hidden, topk_ids, topk_weights)
        else:
            out = self._forward_per_expert(hidden, topk_ids, topk_weights)
        return moe_all_reduce(out)

    def _forward_grouped(
        self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """All local experts in two grouped GEMMs, with no host synchronization: the (token, slot)
        pairs are sorted by expert on the device and the group offsets stay a device tensor, so a
        CUDA step never waits for the host to learn how many tokens each expert got. Pairs routed to
        other EP ranks sort last, past the final offset, where grouped_mm leaves rows unwritten;
        they are dropped by the mask before the scatter back."""
        n, k = topk_ids.shape
        local = topk_ids.reshape(-1) - self.expert_start
        is_local = (local >= 0) & (local < self.num_local_experts)
        key = torch.where(is_local, local, self.num_local_experts)  # remote pairs after every group
        order = torch.argsort(key, stable=True)
        # scatter_add, not bincount: bincount on CUDA reads the largest key back to size its output.
        counts = torch.zeros(self.num_local_experts + 1, dtype=torch.long, device=key.device)
        counts.scatter_add_(0, key, torch.ones_like(key))
        offs = torch.cumsum(counts[: self.num_local_experts], 0).to(torch.int32)
        token = order // k
        x = hidden[token]
        gate_up = F.grouped_mm(x, self.w13.transpose(1, 2), offs=offs)
        gate, up = gate_up.chunk(2, dim=-1)
        y = F.grouped_mm(F.silu(gate) * up, self.w2.transpose(1, 2), offs=offs)
        weight = topk_weights.reshape(-1)[order].to(y.dtype)
        y = torch.where(is_local[order, None], y * weight[:, None], 0)
        return torch.zeros_like(hidden).index_add_(0, token, y.to(hidden.dtype))

    def _forward_per_expert(
        self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """One GEMM pair per expert that got tokens: the CPU path (oneDNN-packed experts, and
        grouped_mm on CPU is a reference loop), where reading the expert ids back costs nothing."""
        out = torch.zeros_like(hidden)
        local_ids = topk_ids - self.expert_start
        is_local = (local_ids >= 0) & (local_ids < self.num_local_experts)
        for e in local_ids[is_local].unique().tolist():
            token_idx, slot = torch.where(local_ids == e)
            gate, up = self._expert_linear(hidden[token_idx], 0, e).chunk(2, dim=-1)
            y = self._expert_linear(F.silu(gate) * up, 1, e) * topk_weights[token_idx, slot, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out


def grouped_mm_fits(hidden: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether `F.grouped_mm` takes these operands: its kernels want 16-byte aligned strides (real
    checkpoints' sizes are; a tiny test model's may not be) and, on CUDA, bfloat16. torch < 2.10 has
    no public `F.grouped_mm`: the per-expert loop then."""
    if not hasattr(F, "grouped_mm") or (hidden.is_cuda and hidden.dtype != torch.bfloat16):
        return False
    return all(d * t.element_size() % 16 == 0 for t in (hidden, *weights) for d in t.shape[-2:])
