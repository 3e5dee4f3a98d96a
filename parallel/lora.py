"""LoRA adapters on the tensor-parallel linears: one batch, several adapters (punica's idea, in torch).

Each adapted linear holds `max_loras` slots of low-rank weights beside its base weight (the
adapter's scaling folded into B); a slot left empty, or a module an adapter does not target, stays
zero. Before each forward the model runner sets which slot each row of the step runs with
(`LoRABatch`); every adapted layer then adds each row's `(x @ A.T) @ B.T` to the base output with a
few batched kernels (`LoRALayer`), in float whatever the base weight's form (float, int8, int4).

Tensor parallelism shards the adapter as the layer it adapts. Column-parallel layers (q/k/v,
gate/up) keep A whole and B's rows of this rank's output; row-parallel layers (o, down) keep A's
columns of this rank's input and B whole, and add their partial update before the layer's
all-reduce, which sums the ranks' parts into the full update.

Adapters come as PEFT writes them (`save_pretrained`): `adapter_config.json` and
`adapter_model.safetensors`, whose tensors are named
`...layers.{i}.{self_attn,mlp}.{q,k,v,o,gate,up,down}_proj.lora_{A,B}.weight`.
"""

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from raylane.parallel import onednn

# PEFT's module names -> (raylane's module, sub-projection index within it)
TARGETS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
_TENSOR = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)\.lora_([AB])\.weight$")


class LoRAError(ValueError):
    """An adapter raylane cannot serve; the message names what is wrong with it."""


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    rank: int
    scaling: float
    target_modules: frozenset[str]


def read_adapter_config(path: str | Path, max_rank: int) -> AdapterConfig:
    """The adapter's rank, scaling and targets, checked against what the engine can hold."""
    file = Path(path) / "adapter_config.json"
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise LoRAError(f"lora_request: cannot read {file}: {e}") from None
    if not (Path(path) / "adapter_model.safetensors").is_file():
        raise LoRAError(f"lora_request: {path} has no adapter_model.safetensors")
    if raw.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"lora_request: {path} is a {raw.get('peft_type')} adapter, not LORA")
    rank, alpha = int(raw.get("r", 0)), float(raw.get("lora_alpha", raw.get("r", 0)))
    if not 0 < rank <= max_rank:
        raise LoRAError(f"lora_request: {path} has rank {rank}; this engine serves ranks 1-{max_rank}")
    targets = raw.get("target_modules") or []
    targets = {targets} if isinstance(targets, str) else set(targets)
    unknown = sorted(t.rsplit(".", 1)[-1] for t in targets if t.rsplit(".", 1)[-1] not in TARGETS)
    if unknown or not targets:
        raise LoRAError(
            f"lora_request: {path} targets {unknown or 'no modules'}; supported: {', '.join(TARGETS)}"
        )
    if raw.get("modules_to_save") or raw.get("bias", "none") != "none":
        raise LoRAError(f"lora_request: {path} trains modules or biases besides LoRA weights")
    scaling = alpha / math.sqrt(rank) if raw.get("use_rslora") else alpha / rank
    return AdapterConfig(rank, scaling, frozenset(t.rsplit(".", 1)[-1] for t in targets))


# No trained LoRA weight comes near this; such values overflow half precision on ordinary
# activations, and one adapter's overflow must not reach a step's other rows.
MAX_WEIGHT_ABS = 1e3
HEADER_BYTES = 1 << 20  # allowance for the safetensors header beside the tensors


@dataclass(frozen=True, slots=True)
class AdapterWeights:
    """An adapter read once, checked, and held in memory (CPU): what a slot is loaded from. The step
    that loads a slot reads no file, so an adapter's files changing or vanishing under a running
    pool cannot fail a step (and with it every request in the batch)."""

    config: AdapterConfig
    tensors: dict[str, torch.Tensor]


def read_adapter(path: str | Path, hf_config, max_rank: int) -> AdapterWeights:
    """The adapter at `path`, checked against the model (`check_adapter`'s names and shapes, a size
    no larger than its tensors at `max_rank` allow) and every weight finite and within
    `MAX_WEIGHT_ABS`; LoRAError naming the problem."""
    from safetensors import safe_open

    config = check_adapter(path, hf_config, max_rank)
    file = Path(path) / "adapter_model.safetensors"
    with safe_open(str(file), framework="pt") as f:
        # Copies: safetensors maps the file, and a tensor still backed by it would read whatever the
        # file holds later (a bus error in a step, once it was truncated).
        tensors = {key: f.get_tensor(key).to(torch.float32, copy=True) for key in f.keys()}  # noqa: SIM118
    for key, weight in tensors.items():
        if not torch.isfinite(weight).all():
            raise LoRAError(f"lora_request: {path}: {key!r} holds NaN or infinite weights")
        if weight.numel() and weight.abs().max() > MAX_WEIGHT_ABS:
            raise LoRAError(f"lora_request: {path}: {key!r} holds weights beyond {MAX_WEIGHT_ABS:g} in size")
    return AdapterWeights(config, tensors)


def check_adapter(path: str | Path, hf_config, max_rank: int) -> AdapterConfig:
    """`read_adapter_config`, and every tensor's name and shape checked against the model (the
    safetensors header only) and the file's size against what those tensors need: what loading it
    into a slot would fail on, found before any weight is read."""
    from safetensors import safe_open

    config = read_adapter_config(path, max_rank)
    hidden, layers = hf_config.hidden_size, hf_config.num_hidden_layers
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    kv = (getattr(hf_config, "num_key_value_heads", None) or heads) * head_dim
    inter = getattr(hf_config, "intermediate_size", None)
    moe = any(getattr(hf_config, k, None) for k in ("num_experts", "num_local_experts"))
    features = {  # (in, out) of each adaptable projection
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    file = Path(path) / "adapter_model.safetensors"
    largest = HEADER_BYTES + 4 * layers * max_rank * sum(n_in + n_out for n_in, n_out in features.values())
    if file.stat().st_size > largest:
        raise LoRAError(f"lora_request: {file} is larger than any adapter of this model at rank {max_rank}")
    with safe_open(str(file), framework="pt") as tensors:
        for key in tensors.keys():  # noqa: SIM118 - safe_open has no __iter__
            match = _TENSOR.search(key)
            if match is None or int(match[1]) >= layers or match[3] not in TARGETS:
                raise LoRAError(f"lora_request: {path}: tensor {key!r} adapts no layer of this model")
            if moe and match[2] == "mlp":
                raise LoRAError(f"lora_request: {path}: the MLP of a mixture-of-experts model is not adapted")
            n_in, n_out = features[match[3]]
            shape = tuple(tensors.get_slice(key).get_shape())
            if shape != ((config.rank, n_in) if match[4] == "A" else (n_out, config.rank)):
                raise LoRAError(f"lora_request: {path}: {key!r} has shape {shape}, not this model's")
    return config


class LoRABatch:
    """This step's rows grouped by adapter slot: `segments` holds (slot, row indices) for each slot
    some row runs with; empty when no row has an adapter (the layers then add nothing). Rows of the
    base model are in no segment."""

    def __init__(self, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device):
        self.max_loras, self.max_rank = max_loras, max_rank
        self._device = device
        self.segments: list[tuple[int, torch.Tensor]] = []

    def set(self, slots: list[int], query_lens: list[int]) -> None:
        """From each request's slot (-1: the base model) and its number of tokens in the step."""
        rows: dict[int, list[int]] = {}
        start = 0
        for slot, n in zip(slots, query_lens, strict=True):
            if slot >= 0:
                rows.setdefault(slot, []).extend(range(start, start + n))
            start += n
        self.segments = [
            (slot, torch.tensor(index, dtype=torch.long, device=self._device)) for slot, index in rows.items()
        ]


class LoRALayer(nn.Module):
    """The slots of one adapted linear: `sub_sizes` are this rank's output sizes of its
    sub-projections (q, k, v / gate, up / one), `input_size` this rank's input features.

    With W = slots * max_rank: A of every sub-projection and slot is one [subs * W, in] matrix (sub i's
    slot s in rows i * W + s * max_rank onwards), B one [out, subs * W] matrix, block-diagonal by
    sub-projection. A load copies each slot's part out as its own pair (`slot_weights`: A_s
    [subs * max_rank, in], B_s [out, subs * max_rank]), and a step adds `(x_s @ A_s.T) @ B_s.T` to the
    rows x_s of each slot in use, gathered and added back by index: two kernels per adapter in the
    step, and a row of one slot never meets another slot's weights. (One dense product over every
    slot with a mask would be fewer kernels, but 0 x NaN is NaN: one adapter holding a non-finite
    weight, or overflowing on its own rows, would turn every row of the step into NaN, other
    tenants' base-model rows included.) On CPU each pair is also kept packed for oneDNN, as the
    base weights are."""

    def __init__(self, batch: LoRABatch, input_size: int, sub_sizes: list[int]):
        super().__init__()
        self.batch, self.sub_sizes = batch, list(sub_sizes)
        width = len(sub_sizes) * batch.max_loras * batch.max_rank
        self.register_buffer("lora_a", torch.zeros(width, input_size), persistent=False)
        self.register_buffer("lora_b", torch.zeros(sum(sub_sizes), width), persistent=False)
        self.slot_weights: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.packed = False  # slot_weights are oneDNN-packed (CPU)

    def add_to(self, y: torch.Tensor, x: torch.Tensor) -> None:
        """y += each row's adapter update (nothing for rows of the base model)."""
        for slot, index in self.batch.segments:
            weights = self.slot_weights.get(slot)
            if weights is None:  # the adapter adapts other modules only
                continue
            a, b = weights
            rows = x.index_select(0, index)
            update = onednn.linear(onednn.linear(rows, a), b) if self.packed else (rows @ a.T) @ b.T
            y.index_add_(0, index, update)

    def repack(self) -> None:
        """Each loaded slot's pair from the big matrices (after a load or a clear)."""
        self.slot_weights.clear()
        self.packed = packs = self.lora_a.device.type == "cpu" and onednn.available(self.lora_a.dtype)
        for slot in range(self.batch.max_loras):
            columns = torch.cat(
                [torch.arange(self.columns(sub, slot).start, self.columns(sub, slot).stop)
                 for sub in range(len(self.sub_sizes))]
            )  # fmt: skip
            a = self.lora_a.index_select(0, columns.to(self.lora_a.device))
            if not a.any():
                continue
            b = self.lora_b.index_select(1, columns.to(self.lora_b.device))
            self.slot_weights[slot] = (onednn.pack(a), onednn.pack(b)) if packs else (a, b)

    def columns(self, sub: int, slot: int) -> slice:
        r = self.batch.max_rank
        start = (sub * self.batch.max_loras + slot) * r
        return slice(start, start + r)

    def rows(self, sub: int) -> slice:
        start = sum(self.sub_sizes[:sub])
        return slice(start, start + self.sub_sizes[sub])

    def clear(self, slot: int) -> None:
        for sub in range(len(self.sub_sizes)):
            self.lora_a[self.columns(sub, slot)].zero_()
            self.lora_b[:, self.columns(sub, slot)].zero_()


def attach_lora(
    model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device
) -> LoRABatch:
    """Give every q/k/v, o, gate/up and down projection of `model` its adapter slots (in `dtype`,
    float even where the base weight is int8 or int4); the returned batch is what the runner fills
    before each forward."""
    from raylane.parallel.layers import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear

    batch = LoRABatch(max_loras, max_rank, dtype, device)
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}:
            continue
        if isinstance(module, QKVParallelLinear):
            subs = [module.q_size, module.kv_size, module.kv_size]
        elif isinstance(module, MergedColumnParallelLinear):
            subs = [size // module.tp_size for size in module.output_sizes]
        elif isinstance(module, RowParallelLinear):
            subs = [module.output_size]
        else:
            continue  # e.g. an MoE layer's experts: not adapted
        module.lora = LoRALayer(batch, module.input_size, subs).to(device, dtype)
    return batch


def load_adapter(model: nn.Module, slot: int, adapter: AdapterWeights) -> None:
    """Write `adapter` into `slot` of every layer it adapts (this rank's shard of it); the slot's
    other layers are cleared."""
    layers = model.model.layers
    adapted = [m for m in model.modules() if isinstance(m, LoRALayer)]
    for module in adapted:
        module.clear(slot)
    for key, weight in adapter.tensors.items():
        match = _TENSOR.search(key)  # `check_adapter` accepted the names and shapes
        index, block, proj, which = int(match[1]), match[2], match[3], match[4]
        module_name, sub = TARGETS[proj]
        module = getattr(getattr(layers[index], block), module_name)
        _copy_shard(module, slot, sub, which, weight, adapter.config, key)
    for module in adapted:
        module.repack()


def _copy_shard(module, slot: int, sub: int, which: str, weight: torch.Tensor, config: AdapterConfig, name):
    from raylane.parallel.layers import QKVParallelLinear, RowParallelLinear

    lora: LoRALayer = module.lora
    rank, columns = config.rank, lora.columns(sub, slot)
    if which == "A":  # [rank, in]
        if isinstance(module, RowParallelLinear):  # this rank's input columns
            weight = weight.narrow(1, module.tp_rank * module.input_size, module.input_size)
        expected = (rank, module.input_size)
        target = lora.lora_a[columns][:rank]
    else:  # [out, rank], scaled
        size = lora.sub_sizes[sub]
        if not isinstance(module, RowParallelLinear):  # this rank's output rows
            shard = module.tp_rank
            if isinstance(module, QKVParallelLinear) and sub > 0:
                shard //= module.num_kv_head_replicas
            weight = weight.narrow(0, shard * size, size)
        weight = weight * config.scaling
        expected = (size, rank)
        target = lora.lora_b[lora.rows(sub), columns][:, :rank]
    if tuple(weight.shape) != expected:
        raise LoRAError(f"lora_request: {name} of shape {tuple(weight.shape)} does not fit")
    target.copy_(weight)
