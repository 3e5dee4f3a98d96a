"""The decoder-only transformer shared by every supported family.

Llama, Qwen2 and Qwen3 differ only in attention biases and Qwen3's per-head q/k
RMSNorm, so one `DecoderForCausalLM` with class-level flags covers them; the MoE
families (models/moe.py) override `make_mlp`. Module names follow HF's so checkpoint
names map onto parameters with the few renames in `models/loader.py`.

Tokens of all requests in a step are flattened to N rows; `AttentionMetadata`
tells each attention layer where they sit in the paged KV cache.
"""

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedConfig

from raylane.models.attention import Attention, AttentionMetadata
from raylane.models.layers import RMSNorm, RotaryEmbedding, rotate_qk
from raylane.parallel.cpu_kernels import fuses_layer_ops
from raylane.parallel.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)


def head_dim_of(config: PreTrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def sliding_window_of(config: PreTrainedConfig) -> int | None:
    """The attention window of every layer, None for full attention.

    The engine builds one `AttentionMetadata` per step for all layers, so a model whose
    layers mix windowed and full attention (Qwen2/3 with `max_window_layers`) cannot run.
    """
    window = getattr(config, "sliding_window", None)
    kinds = set(getattr(config, "layer_types", None) or ["sliding_attention"])
    if window is None or kinds == {"full_attention"}:
        return None
    if kinds != {"sliding_attention"}:
        raise ValueError(
            f"layers mixing sliding-window and full attention are not supported: {sorted(kinds)}"
        )
    return window


class SelfAttention(nn.Module):
    """Tensor-parallel attention: this rank's heads only, o_proj all-reduces."""

    def __init__(self, config: PreTrainedConfig, qkv_bias: bool, o_bias: bool, qk_norm: bool):
        super().__init__()
        hidden, num_heads = config.hidden_size, config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, num_heads, num_kv_heads, bias=qkv_bias)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden, bias=o_bias)
        # Qwen3 normalises each head's q and k before rotary; the weight is per head_dim,
        # so every rank holds it whole.
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps) if qk_norm else None
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim, head_dim**-0.5)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata):
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotate_qk(q, k, cos, sin)
        return self.o_proj(self.attn(q, k, v, meta))


# The gated MLP's activation, by the name in the checkpoint's `hidden_act`. raylane's own table, not
# transformers' ACT2FN: `transformers.activations` imports torch.distributed.tensor and sympy, 0.75 s
# of every engine core process's start (a replica's restart).
ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_new": partial(F.gelu, approximate="tanh"),
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
}


class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)); gate/up column-parallel, down row-parallel."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool = False):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        if hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {hidden_act!r} is not supported (supported: {sorted(ACTIVATIONS)})")
        self.act_fn = ACTIVATIONS[hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if (
            self.act_fn is F.silu
            and gate_up.dim() == 2
            and fuses_layer_ops(gate_up)
            and gate_up.is_contiguous()
        ):
            return self.down_proj(torch.ops.raylane_cpu.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: PreTrainedConfig, self_attn: SelfAttention, mlp: nn.Module):
        super().__init__()
        self.self_attn, self.mlp = self_attn, mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata):
        x, h = self.post_attention_layernorm.add_and_norm(
            x, self.self_attn(self.input_layernorm(x), cos, sin, meta)
        )
        return x + self.mlp(h)


class DecoderModel(nn.Module):
    def __init__(self, config: PreTrainedConfig, layers: list[DecoderLayer]):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata):
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions)  # once per step, shared by all layers
        for layer in self.layers:
            x = layer(x, cos, sin, meta)
        return self.norm(x)


class DecoderForCausalLM(nn.Module):
    """A causal LM over flattened tokens; the interface the engine drives.

    Flags left None follow `config.attention_bias` (Llama's and Qwen3's switch).
    `sliding_window` (None: full attention) is what the engine passes to
    `build_attention_metadata`.
    """

    qkv_bias: bool | None = None
    o_bias: bool | None = None
    qk_norm: bool = False
    # (param name part, checkpoint name part, shard_id): checkpoint tensors fused into one param.
    stacked_params_mapping: tuple[tuple[str, str, str | int], ...] = (
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    )
    # MoE families: checkpoint names of one expert's gate/up/down weights.
    expert_weight_names: dict[str, str] = {}
    # (checkpoint name part, param name part) renames applied before anything else.
    checkpoint_renames: tuple[tuple[str, str], ...] = ()

    def __init__(self, config: PreTrainedConfig):
        super().__init__()
        self.config = config
        self.sliding_window = sliding_window_of(config)
        layers = [
            DecoderLayer(config, self.make_attention(config), self.make_mlp(config, i))
            for i in range(config.num_hidden_layers)
        ]
        self.model = DecoderModel(config, layers)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def make_attention(self, config: PreTrainedConfig) -> SelfAttention:
        bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = bias if self.qkv_bias is None else self.qkv_bias
        o_bias = bias if self.o_bias is None else self.o_bias
        return SelfAttention(config, qkv_bias, o_bias, self.qk_norm)

    def make_mlp(self, config: PreTrainedConfig, layer_idx: int) -> nn.Module:
        bias = bool(getattr(config, "mlp_bias", False))
        return MLP(config.hidden_size, config.intermediate_size, config.hidden_act, bias)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata):
        """input_ids, positions: [N] -> hidden states [N, hidden_size]."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [M, H] -> float32 logits [M, vocab_size] over the full vocabulary."""
        return self.lm_head(hidden).float()

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    def kv_cache_shape_per_block(self, block_size: int) -> tuple[int, int, int]:
        attn = self.model.layers[0].self_attn
        return (block_size, attn.num_kv_heads, attn.head_dim)


class LlamaForCausalLM(DecoderForCausalLM):
    pass


class MistralForCausalLM(DecoderForCausalLM):
    """Llama's layers; its config's `sliding_window` (every layer) is what sets it apart."""


class Qwen2ForCausalLM(DecoderForCausalLM):
    qkv_bias, o_bias = True, False


class Qwen3ForCausalLM(DecoderForCausalLM):
    qk_norm = True
