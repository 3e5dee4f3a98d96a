"""Weight-only int4 with group-wise scale and zero: GGUF's Q4_1 kept in 4 bits at run time on CPU.

Each group of 32 consecutive input features of one output row gets an asymmetric 4-bit code:
`w = q * scale + minimum` with q in 0..15, `minimum` the group's smallest value and
`scale = (max - min) / 15`. That is exactly llama.cpp's Q4_1 block, so re-quantizing a dequantized
Q4_1 weight recovers its q, d and m (tests/unit/test_quantization.py checks it on the shipped GGUF):
int4 of a Q4_1 file loses nothing the file had not already lost.

The codes are kept row-major, two per byte, in llama.cpp's order within a group (byte j of a group
holds code j in its low nibble and code j + 16 in its high one): `rows`. Three ways to multiply:
- raylane's kernel (parallel/csrc/quantized_gemv.cpp, on x86 CPUs with AVX2, FMA and F16C) reads `rows`
  as they are with float16 scale and minimum (Q4_1's own precision), the activations quantized to
  int8 per group of 32 and multiplied in int32 with VNNI, as llama.cpp's Q4_1 x Q8_1 product does:
  about 1.5x torch's kernel at one row (bench/README.md, "raylane's CPU kernels");
- elsewhere torch's CPU weight-only int4 kernel, `_weight_int4pack_mm_for_cpu` (gpt-fast's
  "tinygemm" layout), on a second copy packed by `_convert_weight_to_int4pack_for_cpu` with a
  (scale, zero) pair per group and output row, `w = (q - 8) * scale + zero`; on x86 only its
  bfloat16 instantiation is vectorized, so activations go through it in bfloat16;
- from `DENSE_MIN_TOKENS` tokens on (prefill chunks), dequantize into a transient dense tensor and
  run an ordinary matmul: both kernels re-read the weight for every 4 rows of activations, so their
  time grows linearly with the tokens of a call. `raylane bench linears --int4` measures the forms
  per shape (bench/README.md, int4).
The embedding gathers its rows from `rows` too.
"""

import torch
import torch.nn.functional as F
from torch import nn

from raylane.parallel import cpu_kernels, onednn

GROUP_SIZE = 32
# Tokens in a call from which dequantize-then-matmul beats the int4 kernel: between 64 and 256 for
# every SmolLM2 shape (`raylane bench linears --int4`, AVX-512 EPYC; bench/README.md, int4).
DENSE_MIN_TOKENS = 128
_PROBED: dict[str, bool] = {}


def quantize_int4(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, ...]:
    """[out, in] float weight -> (codes uint8 [out, in] in 0..15, scale and minimum float32
    [out, in / group_size]), with `weight ~= codes * scale + minimum` group by group (Q4_1's rule)."""
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise ValueError(
            f"int4: input width {in_features} is not a multiple of the group size {group_size}; "
            "this layer (or its tensor-parallel shard) cannot be quantized to int4"
        )
    w = weight.detach().float().reshape(out_features, in_features // group_size, group_size)
    minimum = w.amin(dim=-1)
    scale = (w.amax(dim=-1) - minimum) / 15
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    codes = torch.round((w - minimum[..., None]) * inverse[..., None]).clamp_(0, 15).to(torch.uint8)
    return codes.reshape(out_features, in_features), scale, minimum


def dequantize_int4(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """Inverse of `quantize_int4` (float32)."""
    groups = scale.shape[-1]
    w = codes.reshape(*codes.shape[:-1], groups, -1).float() * scale[..., None] + minimum[..., None]
    return w.reshape(codes.shape)


def pack_rows(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [out, in] -> two per byte [out, in / 2], row-major; within each group of 32, byte j
    holds code j (low nibble) and code j + 16 (high nibble), the order raylane's kernel unpacks."""
    c = codes.reshape(codes.shape[0], -1, 2, GROUP_SIZE // 2)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(codes.shape[0], -1)


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_rows`; works on any leading shape (the embedding gathers rows first)."""
    p = packed.reshape(*packed.shape[:-1], -1, GROUP_SIZE // 2)
    return torch.stack((p & 15, p >> 4), dim=-2).reshape(*packed.shape[:-1], -1)


class Int4Weight(nn.Module):
    """One rank's int4 weight: the row-major codes with float32 scale and minimum per group (the
    dense path and the embedding), and what the decode kernel reads: float16 copies of the scale and
    minimum for raylane's kernel (`kernel == "raylane"`), else torch's packed layout (`"torch"`).

    A module of frozen parameters, so `model.parameters()` counts its bytes and a weight tied between
    the embedding and the LM head stays one object. `scales_and_zeros` is [in / group, out, 2] in
    bfloat16, torch's kernel's dtype.
    """

    def __init__(self, weight: torch.Tensor, group_size: int = GROUP_SIZE):
        super().__init__()
        codes, scale, minimum = quantize_int4(weight, group_size)
        self.group_size = group_size
        self.dtype = weight.dtype  # the model's: what the embedding and the dense path return
        self.out_features, self.in_features = codes.shape
        self.rows = _frozen(pack_rows(codes))
        self.scale, self.minimum = _frozen(scale), _frozen(minimum)
        for name in ("scale_f16", "minimum_f16", "packed", "scales_and_zeros"):
            self.register_parameter(name, None)
        on_cpu = weight.device.type == "cpu"
        if on_cpu and group_size == GROUP_SIZE and cpu_kernels.quantized_gemv_supported():
            self.scale_f16, self.minimum_f16 = _frozen(scale.half()), _frozen(minimum.half())
        elif kernel_available() and self.out_features % 16 == 0:  # torch's kernel tiles output rows by 16
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
            self.packed = _frozen(packed)
            zero = minimum + 8 * scale
            self.scales_and_zeros = _frozen(torch.stack((scale.t(), zero.t()), dim=-1).to(torch.bfloat16))

    @property
    def kernel(self) -> str | None:
        """Whose kernel multiplies decode-sized calls: raylane's, torch's, or None (dense only)."""
        return "raylane" if self.scale_f16 is not None else "torch" if self.packed is not None else None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense [out, in] weight in `dtype`, computed in `dtype` in place (one allocation: at
        prefill sizes this runs once per linear per step; float32 gives `dequantize_int4` exactly)."""
        w = unpack_rows(self.rows).view(self.out_features, -1, self.group_size).to(dtype)
        w.mul_(self.scale[..., None].to(dtype)).add_(self.minimum[..., None].to(dtype))
        return w.view(self.out_features, self.in_features)


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.contiguous(), requires_grad=False)


def kernel_available() -> bool:
    """Whether torch has the CPU int4 kernel and it computes (q - 8) * scale + zero as expected
    (probed once; a torch whose layout or convention changed falls back to the dense path)."""
    if "cpu" not in _PROBED:
        try:
            g = torch.Generator().manual_seed(0)
            codes = torch.randint(0, 16, (16, 64), generator=g, dtype=torch.int32)
            scale, zero = torch.rand(2, 16, generator=g) + 0.5, torch.randn(2, 16, generator=g)
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
            sz = torch.stack((scale, zero), dim=-1).to(torch.bfloat16)
            x = torch.randn(3, 64, generator=g).to(torch.bfloat16)
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, sz)
            w = (codes.float() - 8) * sz[..., 0].float().t().repeat_interleave(32, 1)
            w = w + sz[..., 1].float().t().repeat_interleave(32, 1)
            _PROBED["cpu"] = torch.allclose(y.float(), x.float() @ w.t(), rtol=0.02, atol=0.5)
        except (AttributeError, RuntimeError, NotImplementedError):
            _PROBED["cpu"] = False
    return _PROBED["cpu"]


def dense_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the dense path's transient weight: bfloat16 where the CPU multiplies it natively
    (AVX512-BF16, and oneDNN's bf16 kernels not held back by `ONEDNN_MAX_CPU_ISA`; faster than float32
    at prefill sizes: `raylane bench linears --int4`), else the activations' dtype."""
    native = torch.cpu._is_avx512_bf16_supported() and onednn.available(torch.bfloat16)
    if dtype == torch.float32 and native:
        return torch.bfloat16
    return dtype


def int4_linear(x: torch.Tensor, weight: Int4Weight, dense_min_tokens: int | None = None) -> torch.Tensor:
    """x [..., in] @ W.T for an `Int4Weight` W, in x's dtype; the int4 kernel below
    `dense_min_tokens` rows (default `DENSE_MIN_TOKENS`), dequantize-then-matmul from there."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    threshold = DENSE_MIN_TOKENS if dense_min_tokens is None else dense_min_tokens
    small = x.device.type == "cpu" and x2.shape[0] < threshold
    if small and weight.scale_f16 is not None:
        y = torch.ops.raylane_cpu.int4_gemv(
            x2.float().contiguous(), weight.rows, weight.scale_f16, weight.minimum_f16
        ).to(x.dtype)
    elif small and weight.packed is not None:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x2.to(torch.bfloat16).contiguous(), weight.packed, weight.group_size, weight.scales_and_zeros
        ).to(x.dtype)
    else:
        dtype = dense_dtype(x.dtype)
        y = F.linear(x2.to(dtype), weight.dequantize(dtype)).to(x.dtype)
    return y.reshape(*shape[:-1], weight.out_features)


def int4_embedding(ids: torch.Tensor, weight: Int4Weight) -> torch.Tensor:
    """Rows `ids` of the dequantized weight in the model's dtype (only those rows are unpacked)."""
    codes = unpack_rows(F.embedding(ids, weight.rows))
    return dequantize_int4(codes, weight.scale[ids], weight.minimum[ids]).to(weight.dtype)
