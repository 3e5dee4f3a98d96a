"""GGUF checkpoints (llama.cpp's single-file format), served without writing a second copy of the weights.

A `.gguf` file carries everything a Hugging Face directory does: hyper-parameters, tokenizer and chat
template in its metadata, the tensors (often block-quantized: Q4_1, Q8_0, ...) after them. Reading the
metadata is slow in Python (the `gguf` package parses the 49k-entry vocabulary and merges field by
field, seconds per process: `raylane bench gguf-open` times it) and converting the tokenizer to a fast
one is slower still, while the engine opens its checkpoint in several processes (driver, engine core,
every rank). So the first use of a file writes a small *sidecar* directory under
`$RAYLANE_CACHE_DIR/gguf/`: the `config.json`, tokenizer and `generation_config.json` that transformers
makes from the file, and `gguf_index.json`, where each tensor's bytes sit in the file. Every later open,
in any process, reads that directory as an ordinary checkpoint directory; the weights are read from the
GGUF itself, dequantized to the engine's dtype as each rank loads its shard (only the rows it needs).
The sidecar is a few MB; the weights are never copied.

llama.cpp's converter permutes the rows of Llama's q/k projections (it pairs rotary halves
differently); `_unpermute` restores Hugging Face's order, as transformers does when it loads a GGUF.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from raylane.parallel.lazy_weight import LazyWeight

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


def gguf_sidecar(path: str | os.PathLike) -> Path:
    """The sidecar directory of a GGUF file, written on first use (one writer at a time per machine)."""
    path = Path(path).resolve()
    stat = path.stat()
    target = cache_root() / f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}-v{SIDECAR_VERSION}"
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


def read_index(model_dir: str | os.PathLike) -> dict | None:
    file = Path(model_dir) / INDEX_FILE
    return json.loads(file.read_text()) if file.is_file() else None


def iter_gguf(index: dict) -> Iterator[tuple[str, LazyWeight]]:
    """(Hugging Face name, lazy tensor) for every tensor of the indexed GGUF file."""
    data = np.memmap(index["file"], dtype=np.uint8, mode="r")
    if data.size != index["size"]:
        raise GGUFError(f"{index['file']} changed since its sidecar was written; delete {cache_root()}")
    for name, entry in index["tensors"].items():
        yield name, LazyWeight(GGUFTensor(data, entry))


class GGUFTensor:
    """One tensor of a GGUF file as a sliceable source for `LazyWeight`: a slice reads (and dequantizes)
    only the rows it covers, so a rank that loads its shard touches only its shard's bytes."""

    def __init__(self, data: np.memmap, entry: dict):
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.qtype = GGMLQuantizationType(entry["type"])
        self.shape = tuple(entry["shape"])
        self.heads = entry["unpermute_heads"]
        block, block_bytes = GGML_QUANT_SIZES[self.qtype]
        row_bytes = self.shape[-1] // block * block_bytes
        rows = int(np.prod(self.shape[:-1], dtype=np.int64))
        self.raw = data[entry["offset"] : entry["offset"] + rows * row_bytes].reshape(rows, row_bytes)

    def get_shape(self) -> tuple[int, ...]:
        return self.shape

    def __getitem__(self, region: tuple[slice, ...]) -> torch.Tensor:
        if len(self.shape) == 1:
            return self._rows(0, 1).reshape(-1)[region[0]].contiguous()
        start, stop = region[0].start, region[0].stop
        if self.heads:  # rows are permuted within each head: read whole heads, then restore the order
            head = self.shape[0] // self.heads
            lo, hi = start // head * head, -(-stop // head) * head
            rows = _unpermute(self._rows(lo, hi), (hi - lo) // head)[start - lo : stop - lo]
        else:
            rows = self._rows(start, stop)
        return rows[:, region[1]].contiguous()

    def _rows(self, start: int, stop: int) -> torch.Tensor:
        from gguf import GGMLQuantizationType, dequantize

        raw = np.asarray(self.raw[start:stop])
        if self.qtype == GGMLQuantizationType.Q4_1:
            return _dequantize_q4_1(raw)
        if self.qtype == GGMLQuantizationType.Q8_0:
            return _dequantize_q8_0(raw)
        values = dequantize(raw, self.qtype)
        return torch.from_numpy(np.array(values, dtype=np.float32))  # a copy: the map is read-only


# The packaged model's two block types, dequantized by torch's vectorized (and threaded) ops: 3x
# faster than gguf-py's numpy for the whole file, which a replica's start waits for. Same values
# (tests/unit/test_quantization.py compares them with gguf-py's on the shipped file).
def _blocks(raw: np.ndarray, block_bytes: int) -> torch.Tensor:
    return torch.from_numpy(raw.copy()).reshape(raw.shape[0], -1, block_bytes)  # a copy: the map is read-only


def _dequantize_q4_1(raw: np.ndarray) -> torch.Tensor:
    """Q4_1: per 32 values a float16 scale d and minimum m, then 16 bytes whose low nibbles are
    values 0-15 and high nibbles 16-31; value = d * q + m."""
    blocks = _blocks(raw, 20)
    scale_min = blocks[..., :4].contiguous().view(torch.float16).float()
    packed = blocks[..., 4:]
    codes = torch.cat([packed & 0xF, packed >> 4], dim=-1).float()
    return (codes * scale_min[..., :1] + scale_min[..., 1:]).reshape(raw.shape[0], -1)


def _dequantize_q8_0(raw: np.ndarray) -> torch.Tensor:
    """Q8_0: per 32 values a float16 scale d, then 32 signed bytes q; value = d * q."""
    blocks = _blocks(raw, 34)
    scale = blocks[..., :2].contiguous().view(torch.float16).float()
    codes = blocks[..., 2:].contiguous().view(torch.int8).float()
    return (codes * scale).reshape(raw.shape[0], -1)


def _unpermute(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: within each head it interleaved the two rotary halves."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)
