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

import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from raylane.models.gguf_sidecar import (  # noqa: F401 - the sidecar's names, where they always were
    GGUF_SUFFIX,
    INDEX_FILE,
    SIDECAR_VERSION,
    SUPPORTED_ARCHITECTURES,
    GGUFError,
    cache_root,
    checkpoint_dir,
    gguf_sidecar,
    hf_tensor_name,
    is_gguf,
    write_sidecar,
)
from raylane.parallel.lazy_weight import LazyWeight


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
