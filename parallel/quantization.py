"""Weight-only int8 quantization of the parallel linear layers.

Each output channel (row of a rank's [out, in] weight shard) gets one scale, absmax / 127, so
`w ~= w_int8 * scale[:, None]`; activations stay in the model dtype. The weights are loaded in the
model dtype first and quantized right after loading (`quantize_model`), so any fp checkpoint
works. The matmul is torch's `_weight_int8pack_mm` (CPU and CUDA kernels that take the int8 weight
and the scales directly) where it exists for the device and dtype, else the weight is dequantized
on the fly. Each rank quantizes its own shard with its own scales, so tensor parallelism needs
nothing more.

The Column/Row/QKV/Merged linears, the vocabulary embedding and the LM head (one per-row scale per
vocabulary entry, shared when the two are tied) are quantized; norms, the MoE router and the fused
MoE experts stay in the model dtype.
"""

import torch
import torch.nn.functional as F
from torch import nn

QUANTIZATION_METHODS = ("int8",)


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


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ (qweight * scale[:, None]).T without a bias.

    float32 activations go through the kernel in bfloat16: torch's float32 int8 kernel is a scalar
    loop (5-10x slower than an fp32 matmul on CPU), its bf16 one is vectorized.
    """
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    kernel_dtype = torch.bfloat16 if x.dtype == torch.float32 else x.dtype
    # The CPU kernel crashes (bf16) on input widths that are not a multiple of its tile.
    if shape[-1] % 32 == 0 and _has_int8pack_mm(x.device, kernel_dtype):
        y = torch._weight_int8pack_mm(x2.to(kernel_dtype).contiguous(), qweight, scale.to(kernel_dtype))
        y = y.to(x.dtype)
    else:
        y = F.linear(x2, qweight.to(x.dtype) * scale[:, None].to(x.dtype))
    return y.reshape(*shape[:-1], qweight.shape[0])


def quantize_linear_(layer: nn.Module, shared: dict | None = None) -> None:
    """Swap a loaded layer's [out, in] `weight` for `qweight` (int8) + `weight_scale` (per row), in
    place, freeing the fp weight. `shared` maps already quantized weights to their int8 form, so a
    weight tied between two layers (embedding and LM head) stays one tensor."""
    shared = {} if shared is None else shared
    weight = layer.weight
    if id(weight) not in shared:
        qweight, scale = quantize_int8(weight.data)
        shared[id(weight)] = (
            nn.Parameter(qweight, requires_grad=False),
            nn.Parameter(scale, requires_grad=False),
        )
    del layer.weight
    layer.qweight, layer.weight_scale = shared[id(weight)]
    layer.quantization = "int8"


def quantize_model(model: nn.Module, method: str) -> int:
    """Quantize every tensor-parallel linear, the embedding and the LM head of a loaded model;
    returns how many layers."""
    from parallel.layers import LinearBase, ReplicatedLinear, VocabParallelEmbedding

    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization: {method!r} is not supported; supported: {QUANTIZATION_METHODS}")
    kinds = (LinearBase, VocabParallelEmbedding)
    layers = [m for m in model.modules() if isinstance(m, kinds) and not isinstance(m, ReplicatedLinear)]
    shared: dict = {}
    for layer in layers:
        quantize_linear_(layer, shared)
    return len(layers)
