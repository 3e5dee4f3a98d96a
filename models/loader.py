"""Build a model from a Hugging Face checkpoint directory (or a GGUF file) and load its weights.

Each checkpoint tensor goes to its parameter's `weight_loader` as a `LazyWeight` over safetensors'
`get_slice` (or over a GGUF file's bytes, opened through its sidecar directory: models/gguf.py):
the loader narrows it to this rank's shard and only that slice is read from the file, so a rank's
loading memory falls with the number of ranks.

Checkpoint names map onto parameters by three rules, tried in order after the model's renames:
  - one expert's weight (`experts.{e}.w1.weight`, `experts.{e}.gate_proj.weight`, ...)
    -> `experts.w13`/`experts.w2` with (shard_id, expert_id);
  - fused experts as transformers 5 saves them (`experts.gate_up_proj`, `experts.down_proj`)
    -> `experts.w13`/`experts.w2` whole;
  - q/k/v and gate/up projections -> the fused `qkv_proj`/`gate_up_proj` with a shard_id.
Every parameter must end up fully loaded, else `MissingWeightError` names the tensor.
"""

import json
import re
import sys
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm
from transformers import AutoConfig, PreTrainedConfig

from raylane.models.decoder import DecoderForCausalLM
from raylane.models.gguf import checkpoint_dir, iter_gguf, read_index
from raylane.models.registry import get_model_class
from raylane.parallel import onednn
from raylane.parallel.layers import default_weight_loader
from raylane.parallel.lazy_weight import LazyWeight
from raylane.parallel.weight_processing import WeightProcessing

_EXPERT_WEIGHT = re.compile(r"\.experts\.(\d+)\.(\w+)\.weight$")
_FUSED_EXPERTS = {".experts.gate_up_proj": ".experts.w13", ".experts.down_proj": ".experts.w2"}


class MissingWeightError(KeyError):
    """A model parameter has no tensor in the checkpoint."""

    def __str__(self) -> str:  # KeyError would print the message in quotes
        return str(self.args[0])


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    quantization: str | None = None,
    cpu_weight_prepack: bool = False,
    cpu_batch_weight_copy: bool = False,
) -> tuple[DecoderForCausalLM, PreTrainedConfig]:
    """Build the model for `model_dir/config.json` (or a `.gguf` file) on this rank and load its weights.

    `quantization` ("int8", "int4") quantizes the linear layers' weights once loaded and
    `cpu_weight_prepack` packs the others for oneDNN on CPU: `process_weights_after_loading`;
    `cpu_batch_weight_copy` keeps a oneDNN copy of the quantized ones for batched calls (CPU).
    Returns (model in eval mode without gradients, the transformers config).
    """
    model_dir = Path(checkpoint_dir(model_dir))
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"model config not found: {model_dir / 'config.json'}")
    config = AutoConfig.from_pretrained(model_dir)
    model_class = get_model_class(config)
    tensors = checkpoint_tensors(model_dir)
    with _default_dtype(dtype), torch.device(device):
        model = model_class(config)
    load_weights(model, tensors, model_dir)
    on_cpu = torch.device(device).type == "cpu"
    process_weights_after_loading(
        model, quantization, cpu_weight_prepack and on_cpu, cpu_batch_weight_copy and on_cpu
    )
    return model.eval().requires_grad_(False), config


def process_weights_after_loading(
    model: nn.Module,
    quantization: str | None = None,
    cpu_weight_prepack: bool = False,
    cpu_batch_weight_copy: bool = False,
) -> None:
    """Let every layer turn its loaded weight into the form it computes with (vLLM's hook):
    quantized under `quantization`, else packed for oneDNN under `cpu_weight_prepack` where oneDNN
    serves the model's dtype (a CPU model)."""
    dtype = next(model.parameters()).dtype
    prepack = cpu_weight_prepack and onednn.available(dtype)
    batch_copy = cpu_batch_weight_copy and quantization is not None
    processing = WeightProcessing.for_model(model, quantization, prepack, batch_copy)
    for module in list(model.modules()):
        if (hook := getattr(module, "process_weights_after_loading", None)) is not None:
            hook(processing)
    processing.report()


def weight_files(model_dir: Path) -> list[Path]:
    """`model.safetensors`, or the shards listed by `model.safetensors.index.json`."""
    single, index = model_dir / "model.safetensors", model_dir / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if not index.is_file():
        raise FileNotFoundError(f"model weights not found: neither {single} nor {index} exists")
    names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    files = [model_dir / name for name in names]
    for file in files:
        if not file.is_file():
            raise FileNotFoundError(f"weight shard listed in {index} not found: {file}")
    return files


@contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def checkpoint_tensors(model_dir: Path) -> Iterator[tuple[str, LazyWeight]]:
    """(name, lazy tensor) of every tensor of the checkpoint: safetensors, or a GGUF's sidecar index."""
    index = read_index(model_dir)
    return iter_gguf(index) if index is not None else iter_checkpoint(weight_files(model_dir))


def iter_checkpoint(files: list[Path]) -> Iterator[tuple[str, LazyWeight]]:
    """(name, lazy tensor) of every tensor; nothing is read until a weight loader copies a slice."""
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, LazyWeight(f.get_slice(name))


@torch.no_grad()
def load_weights(
    model: DecoderForCausalLM, checkpoint: Iterator[tuple[str, LazyWeight]], model_dir: Path
) -> None:
    params = dict(model.named_parameters())  # a tied lm_head appears once, as embed_tokens
    loaded: dict[str, set] = defaultdict(set)
    # A progress bar for people at a terminal; logs of servers and Ray workers stay clean.
    quiet = not sys.stderr.isatty()
    tensors = tqdm(checkpoint, desc="loading weights", unit=" tensors", disable=quiet)
    for name, tensor in tensors:
        target, kwargs = map_checkpoint_name(model, name)
        param = params.get(target)
        if param is None:  # e.g. rotary inv_freq buffers or a tied lm_head in old checkpoints
            continue
        getattr(param, "weight_loader", default_weight_loader)(param, tensor, **kwargs)
        shard = kwargs.get("shard_id")
        loaded[target].add((kwargs["expert_id"], shard) if "expert_id" in kwargs else shard)
    _check_complete(model, params, loaded, model_dir)


def map_checkpoint_name(model: DecoderForCausalLM, name: str) -> tuple[str, dict]:
    """Checkpoint tensor name -> (parameter name, extra weight_loader kwargs)."""
    for old, new in model.checkpoint_renames:
        name = name.replace(old, new)
    shards_by_name = {v: k for k, v in model.expert_weight_names.items()}
    if (m := _EXPERT_WEIGHT.search(name)) and m[2] in shards_by_name:
        shard = shards_by_name[m[2]]
        param = ".experts.w2" if shard == "down" else ".experts.w13"
        return name[: m.start()] + param, {"shard_id": shard, "expert_id": int(m[1])}
    for suffix, param in _FUSED_EXPERTS.items():
        if name.endswith(suffix):
            return name[: -len(suffix)] + param, {}
    parts = name.split(".")
    for param_part, ckpt_part, shard_id in model.stacked_params_mapping:
        if ckpt_part in parts:
            parts[parts.index(ckpt_part)] = param_part
            return ".".join(parts), {"shard_id": shard_id}
    return name, {}


def checkpoint_name(model: DecoderForCausalLM, param_name: str, shard) -> str:
    """The inverse of `map_checkpoint_name` for error messages (per-expert layout for experts)."""
    if isinstance(shard, tuple):
        expert_id, which = shard
        name = f"{param_name.rsplit('.', 1)[0]}.{expert_id}.{model.expert_weight_names[which]}.weight"
    else:
        name = param_name
        parts = param_name.split(".")
        for param_part, ckpt_part, shard_id in model.stacked_params_mapping:
            if shard is not None and shard_id == shard and param_part in parts:
                parts[parts.index(param_part)] = ckpt_part
                name = ".".join(parts)
                break
    for old, new in model.checkpoint_renames:
        name = name.replace(new, old)
    return name


def _check_complete(
    model: DecoderForCausalLM, params: dict[str, nn.Parameter], loaded: dict[str, set], model_dir: Path
) -> None:
    missing = []
    for name, param in params.items():
        got = loaded.get(name, set())
        if None in got:  # a whole (or fused) tensor was loaded
            continue
        missing += [
            checkpoint_name(model, name, s) for s in getattr(param, "shard_ids", (None,)) if s not in got
        ]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise MissingWeightError(f"checkpoint {model_dir} has no tensor {', '.join(missing[:5])}{more}")
