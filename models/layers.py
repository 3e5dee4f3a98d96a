"""Small layers shared by every model: RMSNorm and rotary position embedding. Eager float32 steps on
CPU run them in raylane's fused kernels (parallel/csrc/layer_ops.cpp), everything else in torch ops."""

import torch
from torch import nn
from transformers import PreTrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from raylane.parallel.cpu_kernels import fuses_layer_ops


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 (as HF does), so bf16 models normalise like the reference."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused(x):
            return torch.ops.raylane_cpu.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, the norm of that): a residual add and the norm after it, in one pass when fused."""
        if self._fused(x) and self._fused(delta):
            return torch.ops.raylane_cpu.add_rms_norm(x, delta, self.weight, self.eps)
        x = x + delta
        return x, self(x)

    def _fused(self, x: torch.Tensor) -> bool:
        return fuses_layer_ops(x) and x.is_contiguous() and self.weight.dtype == x.dtype


# Scaling types whose frequencies depend on the current sequence length; HF recomputes
# them per forward, which a paged batch of mixed lengths cannot do.
_DYNAMIC_ROPE_TYPES = ("dynamic", "longrope")


def rope_inv_freq(config: PreTrainedConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim // 2] float32, attention_scaling) from an HF config's `rope_parameters`."""
    params = config.rope_parameters
    rope_type = params.get("rope_type", "default")
    if rope_type in _DYNAMIC_ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported (its frequencies change with length)")
    if rope_type != "default":
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config)
        return inv_freq.float(), float(scaling)
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dim = int(dim * params.get("partial_rotary_factor", 1.0))
    inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    return inv_freq, 1.0


class RotaryEmbedding(nn.Module):
    """Rotary embedding (rotate-half layout) at absolute token positions.

    cos/sin are computed per step from `positions` rather than from a cache sized by
    max_position_embeddings, so any position works and nothing is precomputed.
    """

    def __init__(self, config: PreTrainedConfig):
        super().__init__()
        inv_freq, self.attention_scaling = rope_inv_freq(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N] -> (cos, sin), each [N, rotary_dim] in float32."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling


def rotate_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, heads, head_dim] and k [N, kv_heads, head_dim] rotated (`apply_rotary`). The fused kernel
    rotates them in place: they are views of the step's own QKV output, read by nothing else."""
    whole_heads = all(t.stride(-1) == 1 and t.stride(1) == t.shape[2] == cos.shape[-1] for t in (q, k))
    if whole_heads and fuses_layer_ops(q) and fuses_layer_ops(k) and fuses_layer_ops(cos):
        torch.ops.raylane_cpu.rotary_(q, k, cos.contiguous(), sin.contiguous())
        return q, k
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, head_dim]; cos/sin [N, rotary_dim]. Rotates the first rotary_dim features."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    half = rot // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)
