"""Weight-only int8 and int4 quantization of the parallel linear layers.

Each output channel (row of a rank's [out, in] weight shard) gets one scale, absmax / 127, so
`w ~= w_int8 * scale[:, None]`; activations stay in the model dtype. The weights are loaded in the
model dtype first and quantized right after loading (each layer's `process_weights_after_loading`
calls `quantize_linear_`), so any fp checkpoint works. The matmul is torch's `_weight_int8pack_mm`
(CPU and CUDA kernels that take the int8 weight and the scales directly) where it exists for the
device and dtype, else the weight is dequantized on the fly. Each rank quantizes its own shard with
its own scales, so tensor parallelism needs nothing more.

The Column/Row/QKV/Merged linears, the vocabulary embedding and the LM head (one per-row scale per
vocabulary entry, shared when the two are tied) are quantized; norms, the MoE router and the fused
MoE experts stay in the model dtype.

int4 (parallel/int4.py) is group-wise (32 input features per scale and zero, GGUF's Q4_1 block) for
the linears; a layer whose rank shard is not a whole number of groups wide (or whose output rows do
not fill the kernel's 16-row tiles) takes int8 instead, with a warning. The embedding and LM head
take `INT4_VOCAB_METHOD` (parallel/weight_processing.py). This module holds the kernels only; which
layer gets which form is the layers' business.
"""

import torch
import torch.nn.functional as F
from torch import nn

from raylane.parallel import cpu_kernels, onednn
from raylane.parallel.int4 import (
    DENSE_MIN_TOKENS,
    GROUP_SIZE,
    Int4Weight,
    dense_dtype,
    int4_embedding,
    int4_linear,
    kernel_available,
)

# Rows of a call from which a layer with a batch copy multiplies by the copy (`add_batch_copy`).
BATCH_COPY_MIN_ROWS = 5


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float weight -> (int8 weight [out, in], scales [out] in the weight's dtype)."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale.to(weight.dtype)


def _has_int8pack_mm(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch has the packed int8 kernel for this device and activation dtype (probed once)."""
    key = (device.type, dtype)
    if key not in _PROBED:
        try:
            x = torch.ones(1, 32, device=device, dtype=dtype)
            w = torch.ones(32, 32, device=device, dtype=torch.int8)
            torch._weight_int8pack_mm(x, w, torch.ones(32, device=device, dtype=dtype))
            _PROBED[key] = True
        except (AttributeError, RuntimeError, NotImplementedError):
            _PROBED[key] = False
    return _PROBED[key]


_PROBED: dict[tuple[str, torch.dtype], bool] = {}


# A custom op under torch.compile (engine/compiled_decode.py), as oneDNN's linear is: inductor's lowering
# of `_weight_int8pack_mm` fails on the CPU decode graph (`LoweringException: AssertionError: Pointwise`).
@torch.library.custom_op("raylane::int8pack_mm", mutates_args=())
def _int8pack_mm(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch._weight_int8pack_mm(x, qweight, scale)


@_int8pack_mm.register_fake
def _(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], qweight.shape[0])


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ (qweight * scale[:, None]).T without a bias.

    Calls of fewer than `DENSE_MIN_TOKENS` rows on a CPU that runs raylane's kernel
    (parallel/csrc/quantized_gemv.cpp) go through it: int8 activations per 32 inputs, VNNI products,
    the weight read once per 4 rows. Otherwise torch's kernel, float32 activations in bfloat16:
    torch's float32 int8 kernel is a scalar loop (several times slower than an fp32 matmul on CPU),
    its bf16 one is vectorized.
    """
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    kernel_dtype = torch.bfloat16 if x.dtype == torch.float32 else x.dtype
    small = x.device.type == "cpu" and x2.shape[0] < DENSE_MIN_TOKENS and shape[-1] % GROUP_SIZE == 0
    if small and cpu_kernels.quantized_gemv_supported():
        y = torch.ops.raylane_cpu.int8_gemv(x2.float().contiguous(), qweight, scale.float())
        y = y.to(x.dtype)
    # The CPU kernel crashes (bf16) on input widths that are not a multiple of its tile.
    elif shape[-1] % 32 == 0 and _has_int8pack_mm(x.device, kernel_dtype):
        args = (x2.to(kernel_dtype).contiguous(), qweight, scale.to(kernel_dtype))
        y = _int8pack_mm(*args) if torch.compiler.is_compiling() else torch._weight_int8pack_mm(*args)
        y = y.to(x.dtype)
    else:
        y = F.linear(x2, qweight.to(x.dtype) * scale[:, None].to(x.dtype))
    return y.reshape(*shape[:-1], qweight.shape[0])


def quantize_linear_(layer: nn.Module, shared: dict | None = None, method: str = "int8") -> None:
    """Swap a loaded layer's [out, in] `weight` for its quantized form, in place, freeing the fp weight:
    int8: `qweight` (int8) + `weight_scale` (per row); int4: `int4` (an `Int4Weight`). `shared` maps
    already quantized weights to their quantized form, so a weight tied between two layers (embedding
    and LM head) stays one tensor."""
    shared = {} if shared is None else shared
    weight = layer.weight
    if weight.device.type == "cpu":  # answered now, before any compiled graph asks
        cpu_kernels.quantized_gemv_supported()
        dense_dtype(weight.dtype)  # oneDNN's bf16 probe
    key = (id(weight), method)
    if key not in shared:
        if method == "int4":
            shared[key] = Int4Weight(weight.data)
        else:
            qweight, scale = quantize_int8(weight.data)
            shared[key] = (
                nn.Parameter(qweight, requires_grad=False),
                nn.Parameter(scale, requires_grad=False),
            )
    del layer.weight
    if method == "int4":
        layer.int4 = shared[key]
    else:
        layer.qweight, layer.weight_scale = shared[key]
    layer.quantization = method


def int4_fits(weight: torch.Tensor) -> bool:
    """Whether a rank's [out, in] weight shard can take the int4 kernel."""
    out_features, in_features = weight.shape
    return in_features % GROUP_SIZE == 0 and (out_features % 16 == 0 or not kernel_available())


def dequantized(layer: nn.Module) -> torch.Tensor:
    """The float32 [out, in] weight a quantized layer multiplies by."""
    if layer.quantization == "int4":
        return layer.int4.dequantize(torch.float32)
    return layer.qweight.float() * layer.weight_scale.float()[:, None]


def add_batch_copy(layer: nn.Module, shared: dict) -> None:
    """Keep beside a quantized layer's weight its dequantized values packed for oneDNN
    (`cpu_batch_weight_copy`), bfloat16 where the CPU multiplies it natively (AVX512-BF16), else float32.

    torch's int4 and int8 CPU kernels are made for one row: the int4 one dequantizes its weights again
    for every 4 rows and the int8 one for every row, so a batched decode step of 16 rows costs several
    times a single row's (bench/README.md, "Compiled decode"). oneDNN's packed product reads the copy once for
    all rows. Calls below `BATCH_COPY_MIN_ROWS` rows keep reading the 4 or 8 bits: the int4 kernel's
    4-row blocks cost less than reading the copy up to 4 rows (`raylane bench decode-profile`).
    `shared` keeps a tied weight's copy one."""
    source = layer.int4 if layer.quantization == "int4" else layer.qweight
    key = (id(source), "batch_copy")
    if key not in shared:
        native_bf16 = dense_dtype(torch.float32) == torch.bfloat16 and onednn.available(torch.bfloat16)
        dtype = torch.bfloat16 if native_bf16 else torch.float32
        shared[key] = onednn.pack(dequantized(layer).to(dtype))
    layer.batch_weight = shared[key]


def quantized_linear(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x @ W.T for a layer that `quantize_linear_` quantized."""
    copy = getattr(layer, "batch_weight", None)
    if copy is not None and x.numel() >= BATCH_COPY_MIN_ROWS * x.shape[-1]:
        return onednn.linear(x.to(copy.dtype), copy).to(x.dtype)
    if layer.quantization == "int4":
        return int4_linear(x, layer.int4)
    return int8_linear(x, layer.qweight, layer.weight_scale)


def quantized_embedding(layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a quantized embedding table, dequantized to the model's dtype."""
    if layer.quantization == "int4":
        return int4_embedding(ids, layer.int4)
    scale = layer.weight_scale[ids, None]
    return F.embedding(ids, layer.qweight).to(scale.dtype) * scale
