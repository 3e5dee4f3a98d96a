"""Expert-parallel mixture-of-experts layer.

The experts of a layer are partitioned over the expert-parallel (EP) group: rank r
holds experts [r * E/P, (r + 1) * E/P). The router gate is replicated and runs before
this layer, so every rank knows each token's top-k experts.

Combining with an all-reduce. Here attention is tensor-parallel, so after the
attention block every rank of the EP group holds the same tokens. Each rank runs
its local experts on the tokens routed to them, weights the results by the routing
weights, and leaves zeros for tokens whose experts live elsewhere; summing over the
group (one all-reduce, like a row-parallel layer) gives every rank the full output.

Dispatch with all-to-all instead. When attention runs data-parallel, each rank holds
different tokens and a sum would mix them. Then the layer would (1) count how many of
its (token, expert) pairs go to each rank and exchange the counts (all_to_all_single
on a [P] tensor); (2) permute its token copies so pairs bound for the same rank are
contiguous and send them (all_to_all_single with those split sizes); (3) run the
local experts on what it received; (4) send the results back along the reverse
splits; (5) un-permute, multiply by the routing weights and sum the k copies per
token. Only routed tokens cross the network instead of a dense [N, H] sum per rank,
which is why large EP deployments use it; `forward`'s signature would not change.
"""

import torch
import torch.nn.functional as F
from torch import nn

from parallel.layers import copy_weight
from parallel.state import expert_parallel_all_reduce, get_ep_rank, get_ep_size


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
    """This EP rank's experts as two 3D weights.

    w13: [E_local, 2 * I, H], gate_proj rows then up_proj rows (HF's `gate_up_proj` layout).
    w2:  [E_local, H, I] (HF's `down_proj`).
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
    ):
        super().__init__()
        self.ep_rank = get_ep_rank() if ep_rank is None else ep_rank
        self.ep_size = get_ep_size() if ep_size is None else ep_size
        if num_experts % self.ep_size:
            raise ValueError(
                f"{num_experts} experts cannot be split evenly over expert-parallel size {self.ep_size}"
            )
        if hidden_act != "silu":
            raise ValueError(f"FusedMoE supports hidden_act 'silu', not {hidden_act!r}")
        self.num_experts, self.top_k = num_experts, top_k
        self.intermediate_size = intermediate_size
        self.num_local_experts = num_experts // self.ep_size
        self.expert_start = self.ep_rank * self.num_local_experts
        e = self.num_local_experts
        self.w13 = nn.Parameter(torch.empty(e, 2 * intermediate_size, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, hidden_size, intermediate_size), requires_grad=False)
        local = range(self.expert_start, self.expert_start + e)
        self.w13.shard_ids = tuple((i, s) for i in local for s in ("gate", "up"))
        self.w2.shard_ids = tuple((i, "down") for i in local)
        self.w13.weight_loader = self.w2.weight_loader = self.weight_loader

    def weight_loader(
        self,
        param: nn.Parameter,
        loaded_weight: torch.Tensor,
        shard_id: str | None = None,
        expert_id: int | None = None,
    ) -> None:
        """Load either a fused 3D tensor of all experts (expert_id None) or one expert's
        2D `gate`/`up`/`down` weight; experts of other ranks are skipped."""
        if expert_id is None:
            copy_weight(param.data, loaded_weight.narrow(0, self.expert_start, self.num_local_experts))
            return
        local = expert_id - self.expert_start
        if not 0 <= local < self.num_local_experts:
            return
        i = self.intermediate_size
        rows = {"gate": slice(0, i), "up": slice(i, 2 * i), "down": slice(None)}[shard_id]
        copy_weight(param.data[local, rows], loaded_weight)

    def forward(
        self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """hidden [N, H], topk_ids/topk_weights [N, k] -> [N, H] summed over the EP group."""
        out = torch.zeros_like(hidden)
        local_ids = topk_ids - self.expert_start
        is_local = (local_ids >= 0) & (local_ids < self.num_local_experts)
        for e in local_ids[is_local].unique().tolist():
            token_idx, slot = torch.where(local_ids == e)
            gate, up = F.linear(hidden[token_idx], self.w13[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.w2[e]) * topk_weights[token_idx, slot, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return expert_parallel_all_reduce(out)
