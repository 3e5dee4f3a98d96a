"""LoRA adapters on the tensor-parallel linears: one batch, several adapters (punica's idea, in torch).

Each adapted linear holds `max_loras` slots of low-rank weights beside its base weight: per slot,
A stacked over the layer's sub-projections ([subs * max_rank, in]) and one B per sub-projection
([out_sub, max_rank], the adapter's scaling folded in). A slot left empty or an adapter's module
it does not target stays zero. A step's tokens are grouped in runs of consecutive requests with
the same adapter (`LoRABatch.segments`, set by the model runner before the forward), and each
run adds `(x @ A.T) @ B.T` to its rows of the base output: the base weight (float, int8 or int4)
is read once for the whole batch, each adapter's small matrices once per run, in float.

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
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

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


def check_adapter(path: str | Path, hf_config, max_rank: int) -> AdapterConfig:
    """`read_adapter_config`, and every tensor's name and shape checked against the model (the
    safetensors header only): what loading it into a slot would fail on, found up front."""
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
    with safe_open(str(Path(path) / "adapter_model.safetensors"), framework="pt") as tensors:
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


@dataclass(slots=True)
class LoRABatch:
    """This step's runs of tokens per adapter slot: (slot, first row, end row); base rows are absent."""

    segments: list[tuple[int, int, int]] = field(default_factory=list)

    def set(self, slots: list[int], query_lens: list[int]) -> None:
        """From each request's slot (-1: the base model) and its number of tokens in the step."""
        self.segments.clear()
        row = 0
        for slot, n in zip(slots, query_lens, strict=True):
            if slot >= 0:
                last = self.segments[-1] if self.segments else None
                if last is not None and last[0] == slot and last[2] == row:
                    self.segments[-1] = (slot, last[1], row + n)
                else:
                    self.segments.append((slot, row, row + n))
            row += n


class LoRALayer(nn.Module):
    """The slots of one adapted linear: `sub_sizes` are this rank's output sizes of its
    sub-projections (q, k, v / gate, up / one), `input_size` this rank's input features."""

    def __init__(
        self, batch: LoRABatch, input_size: int, sub_sizes: list[int], max_loras: int, max_rank: int
    ):
        super().__init__()
        self.batch, self.max_rank = batch, max_rank
        self.sub_sizes = list(sub_sizes)
        subs = len(sub_sizes)
        self.register_buffer("lora_a", torch.zeros(max_loras, subs * max_rank, input_size), persistent=False)
        self.lora_b = nn.ParameterList(  # per sub-projection: [slots, out_sub, max_rank]
            nn.Parameter(torch.zeros(max_loras, size, max_rank), requires_grad=False) for size in sub_sizes
        )

    def add_to(self, y: torch.Tensor, x: torch.Tensor) -> None:
        """y[rows] += the adapters' updates, for this step's runs of adapted rows."""
        r = self.max_rank
        for slot, start, end in self.batch.segments:
            low = x[start:end] @ self.lora_a[slot].T  # [rows, subs * r]
            offset = 0
            for i, size in enumerate(self.sub_sizes):
                y[start:end, offset : offset + size] += low[:, i * r : (i + 1) * r] @ self.lora_b[i][slot].T
                offset += size

    def clear(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        for b in self.lora_b:
            b.data[slot].zero_()


def attach_lora(
    model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device
) -> LoRABatch:
    """Give every q/k/v, o, gate/up and down projection of `model` its adapter slots (in `dtype`,
    float even where the base weight is int8 or int4); the returned batch is what the runner fills
    before each forward."""
    from raylane.parallel.layers import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear

    batch = LoRABatch()
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
        module.lora = LoRALayer(batch, module.input_size, subs, max_loras, max_rank).to(device, dtype)
    return batch


def load_adapter(model: nn.Module, slot: int, path: str | Path, max_rank: int) -> None:
    """Write the adapter at `path` into `slot` of every layer it adapts (this rank's shard of it);
    the slot's other layers are cleared."""
    from safetensors import safe_open

    config = read_adapter_config(path, max_rank)
    layers = model.model.layers
    for module in model.modules():
        if isinstance(module, LoRALayer):
            module.clear(slot)
    with safe_open(str(Path(path) / "adapter_model.safetensors"), framework="pt") as tensors:
        for key in tensors.keys():  # noqa: SIM118 - safe_open has no __iter__
            match = _TENSOR.search(key)  # `check_adapter` accepted the names and shapes
            index, block, proj, which = int(match[1]), match[2], match[3], match[4]
            module_name, sub = TARGETS[proj]
            module = getattr(getattr(layers[index], block), module_name)
            _copy_shard(module, slot, sub, which, tensors.get_tensor(key), config, path)


def _copy_shard(module, slot: int, sub: int, which: str, weight: torch.Tensor, config: AdapterConfig, path):
    from raylane.parallel.layers import QKVParallelLinear, RowParallelLinear

    lora: LoRALayer = module.lora
    slot_a, slot_b = lora.lora_a, lora.lora_b[sub]
    rank, r_max = config.rank, lora.max_rank
    if which == "A":  # [rank, in]
        if isinstance(module, RowParallelLinear):  # this rank's input columns
            weight = weight.narrow(1, module.tp_rank * module.input_size, module.input_size)
        expected = (rank, module.input_size)
        target = slot_a[slot, sub * r_max : sub * r_max + rank]
    else:  # [out, rank], scaled
        size = lora.sub_sizes[sub]
        if not isinstance(module, RowParallelLinear):  # this rank's output rows
            shard = module.tp_rank
            if isinstance(module, QKVParallelLinear) and sub > 0:
                shard //= module.num_kv_head_replicas
            weight = weight.narrow(0, shard * size, size)
        weight = weight * config.scaling
        expected = (size, rank)
        target = slot_b.data[slot, :, :rank]
    if tuple(weight.shape) != expected:
        raise LoRAError(f"lora_request: {path}: lora_{which} of shape {tuple(weight.shape)} does not fit")
    target.copy_(weight)
