"""Linear weights prepacked for oneDNN, the CPU matmul path.

On CPU, torch's `F.linear` in float32 goes to a BLAS sgemm (MKL in the torch wheel), which is slow
on the AMD EPYC CPUs benchmarked. oneDNN's JIT kernels on a weight reordered once into oneDNN's
blocked layout do the same products faster at the token counts of decode and prefill steps, at
float32 precision (`raylane bench linears` measures both; bench/README.md, "Where the speedup comes
from"). It is the op torch's own inductor uses for CPU weight prepacking
(`torch.ops.mkldnn._linear_pointwise`), and the approach of vLLM's CPU backend.

Each layer packs its own weight once loaded (`process_weights_after_loading` in parallel/layers.py
and parallel/moe.py): its dense [out, in] weight is replaced by the packed form (so memory does not
double); a weight tied to the embedding stays dense for the embedding, with a packed copy for the LM
head. Each rank packs its own shard, so tensor and expert parallelism need nothing more. A probe
(`available`) checks that the op exists for the dtype and agrees with `F.linear` before anything is
packed; where it does not, the model keeps torch's matmul. This module holds the kernels only.
"""

import torch
import torch.nn.functional as F
from torch import nn

_PROBED: dict[torch.dtype, bool] = {}
# Rows from which a half-precision product that oneDNN cannot serve runs in float32 (see dense_linear).
UPCAST_MIN_TOKENS = 4


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] dense weight -> the same weight in oneDNN's layout (an opaque `torch._mkldnn` tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


# A custom op, so torch.compile (engine/compiled_decode.py) calls oneDNN's kernel as it is: inductor's
# own lowering of `_linear_pointwise` expects a weight it froze itself and fails on an opaque one.
@torch.library.custom_op("raylane::onednn_linear", mutates_args=())
def _linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@_linear.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], packed.shape[0])


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ weight.T (+ bias) with a weight from `pack`."""
    if torch.compiler.is_compiling():
        return _linear(x, packed, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")  # eager: no custom-op wrapper


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` for an unpacked weight, except half precision on a CPU where oneDNN has no kernel for
    it (no AVX512-BF16, e.g. AVX2-only CPUs): there torch's fallback bf16 gemm is several times slower
    than a float32 product once a call has more than a few rows, enough to make a bfloat16 engine
    slower than float32 at 16 streams (bench/README.md, "Why bfloat16 lost at 16 streams"). From
    `UPCAST_MIN_TOKENS` rows the product runs in float32 on a transient float32 copy of the weight;
    below, bf16's halved bytes win."""
    half = weight.dtype in (torch.bfloat16, torch.float16)
    if (
        half
        and x.device.type == "cpu"
        and x.numel() >= UPCAST_MIN_TOKENS * x.shape[-1]
        and not available(weight.dtype)
    ):
        y = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
        return y.to(x.dtype)
    return F.linear(x, weight, bias)


def available(dtype: torch.dtype) -> bool:
    """Whether this torch build has the packed linear for `dtype` on this CPU and it matches F.linear
    (probed once per dtype)."""
    if dtype not in _PROBED:
        try:
            generator = torch.Generator().manual_seed(0)
            w = torch.randn(48, 32, generator=generator).to(dtype)
            x = torch.randn(5, 32, generator=generator).to(dtype)
            _PROBED[dtype] = torch.allclose(linear(x, pack(w)).float(), F.linear(x, w).float(), atol=0.1)
        except (AttributeError, RuntimeError, NotImplementedError):
            _PROBED[dtype] = False
    return _PROBED[dtype]


def packed_bytes(model: nn.Module) -> int:
    """Bytes of the packed weights and batch copies (they are not parameters); a weight packed twice is
    counted twice."""
    total = 0
    for module in model.modules():
        tensors = [getattr(module, "packed_weight", None), getattr(module, "batch_weight", None)]
        for experts in getattr(module, "packed_experts", None) or ():
            tensors += experts
        total += sum(t.numel() * t.element_size() for t in tensors if t is not None)
    return total
