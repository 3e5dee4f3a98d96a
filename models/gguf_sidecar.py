"""A GGUF file's *sidecar* (models/gguf.py says why there is one): the directory of `config.json`,
tokenizer files, `generation_config.json` and tensor index that transformers and raylane make of the
file on its first use on a machine, and the lookups that find it.

Apart from `models/gguf.py` because this part needs no torch: a serving process that only loads a
tokenizer (a simulated engine's, a core process's serving side) finds the sidecar without importing it.
Writing one does go through transformers' GGUF reader, which may import torch.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
from pathlib import Path

GGUF_SUFFIX = ".gguf"
INDEX_FILE = "gguf_index.json"
SIDECAR_VERSION = 1  # bump when the sidecar's contents change
# GGUF architecture -> (transformers class, whether llama.cpp permuted q/k rows for Llama's rotary).
SUPPORTED_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", True),
    "mistral": ("MistralForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
}

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


class GGUFError(ValueError):
    """A GGUF file raylane cannot serve (an architecture or tensor type it does not know)."""


def is_gguf(path: str | os.PathLike) -> bool:
    return str(path).endswith(GGUF_SUFFIX) and os.path.isfile(path)


def checkpoint_dir(path: str | os.PathLike) -> str:
    """The directory to open a checkpoint from: `path` itself, or a GGUF file's sidecar."""
    return str(gguf_sidecar(path)) if is_gguf(path) else str(path)


def cache_root() -> Path:
    return Path(os.environ.get("RAYLANE_CACHE_DIR", "~/.cache/raylane")).expanduser() / "gguf"


def sidecar_path(path: str | os.PathLike) -> Path:
    """Where the sidecar of the GGUF file at `path` is (or will be) on this machine."""
    path = Path(path).resolve()
    stat = path.stat()
    return cache_root() / f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}-v{SIDECAR_VERSION}"


def has_sidecar(path: str | os.PathLike) -> bool:
    return (sidecar_path(path) / INDEX_FILE).is_file()


def gguf_sidecar(path: str | os.PathLike) -> Path:
    """The sidecar directory of a GGUF file, written on first use (one writer at a time per machine)."""
    path = Path(path).resolve()
    target = sidecar_path(path)
    if (target / INDEX_FILE).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent replicas: one converts, the others wait for it
        if not (target / INDEX_FILE).is_file():
            tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
            try:
                write_sidecar(path, tmp)
                os.replace(tmp, target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def write_sidecar(path: Path, out: Path) -> None:
    """config.json, tokenizer files, generation_config.json and the tensor index of `path`, into `out`."""
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    reader = GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(
            f"{path}: GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    model_class, permuted = SUPPORTED_ARCHITECTURES[arch]
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    config.architectures = [model_class]
    config.save_pretrained(out)
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(out)
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    ).save_pretrained(out)
    tensors = {}
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        heads = None
        if permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
        tensors[name] = {
            "gguf_name": t.name,
            "type": int(t.tensor_type),
            "shape": [int(n) for n in reversed(t.shape)],  # GGUF lists dimensions innermost first
            "offset": int(t.data_offset),
            "unpermute_heads": heads,
        }
    index = {"file": str(path), "size": path.stat().st_size, "architecture": arch, "tensors": tensors}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=1))


def hf_tensor_name(gguf_name: str) -> str:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight' (unknown names pass through)."""
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[parts[0]]}.{parts[1]}"
    return gguf_name
