"""Tiny random-weight Hugging Face checkpoints for tests (no downloads).

`make_checkpoint(path, family)` builds a 2-layer, hidden-64 model of one supported
family with transformers, randomly initialised from `seed`, and saves it with
`save_pretrained` (float32 safetensors + config.json). Tests load it both with
`models.load_model` and with `load_hf_model` and compare logits.

Weights use `initializer_range=0.2` (HF's 0.02 makes near-uniform logits whose greedy
argmax flips on rounding noise), and biases and norm weights, which HF initialises to
0 and 1, get random values too, so a model that ignored them would not match.

MoE checkpoints are saved as transformers 5 saves them by default: the per-expert
layout of published checkpoints (`block_sparse_moe.experts.{e}.w1.weight` for
Mixtral, `mlp.experts.{e}.gate_proj.weight` for Qwen3-MoE). Pass
`save_original_format=False` to `save_pretrained` yourself for the fused layout.

This module is imported by other test suites (engine, cluster): keep it stable.
"""

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MixtralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

FAMILIES = ["llama", "llama-tied", "qwen2", "qwen3", "mixtral", "qwen3-moe"]

VOCAB_SIZE = 512
MAX_POSITIONS = 512

# The shape every tiny test checkpoint shares; tests build variants with dict(TINY_CONFIG, ...).
TINY_CONFIG = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=MAX_POSITIONS,
    rms_norm_eps=1e-6,
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

# Llama 3.1-style scaling; with head_dim 16 and an original context of 128 some
# frequencies fall in each of llama3's three bands (kept, smoothed, divided).
_LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=10000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=128,
)

_MOE = dict(num_experts_per_tok=2)


def family_config(family: str, **overrides) -> PretrainedConfig:
    """The transformers config `make_checkpoint` uses for `family`, with overrides applied."""
    if family in ("llama", "llama-tied"):
        kw = dict(TINY_CONFIG, rope_parameters=_LLAMA3_ROPE, tie_word_embeddings=family == "llama-tied")
        return LlamaConfig(**(kw | overrides))
    if family == "qwen2":
        return Qwen2Config(**(TINY_CONFIG | overrides))
    if family == "qwen3":
        return Qwen3Config(**(TINY_CONFIG | overrides))
    if family == "mixtral":
        kw = dict(TINY_CONFIG, **_MOE, num_local_experts=4, intermediate_size=64)
        return MixtralConfig(**(kw | overrides))
    if family == "qwen3-moe":
        kw = dict(TINY_CONFIG, **_MOE, num_experts=4, moe_intermediate_size=32, norm_topk_prob=True)
        return Qwen3MoeConfig(**(kw | overrides))
    raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")


def make_hf_model(family: str, seed: int = 0, **config_overrides) -> torch.nn.Module:
    """A random-init float32 HF model of `family`, deterministic in `seed`."""
    config = family_config(family, **config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:  # biases (HF: zeros) and norm weights (HF: ones)
                param.add_(torch.randn_like(param) * config.initializer_range)
    return model


def make_checkpoint(path: str | Path, family: str, seed: int = 0, **config_overrides) -> Path:
    """Save a tiny random `family` model to `path` (created if needed) and return `path`.

    `config_overrides` go to the transformers config class, e.g. `num_hidden_layers=3`
    or `norm_topk_prob=False`.
    """
    path = Path(path)
    make_hf_model(family, seed, **config_overrides).save_pretrained(path)
    return path


def load_hf_model(path: str | Path) -> torch.nn.Module:
    """The reference transformers model for a checkpoint, float32, eval mode."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
