"""Engine settings: one pydantic model, so a pool's YAML config can embed it as is."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="Local Hugging Face checkpoint directory (config.json + safetensors).")
    tokenizer: str | None = Field(None, description="Tokenizer directory; defaults to `model`.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights/activations dtype. auto: the checkpoint's dtype on GPU, float32 on CPU."
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: CUDA when available.")
    block_size: int = Field(16, ge=1, le=256, description="Tokens per KV cache block.")
    max_num_seqs: int = Field(64, ge=1, description="Most requests in one batch.")
    max_num_batched_tokens: int = Field(
        2048, ge=1, description="Token budget of one step; longer prompts are prefilled in chunks."
    )
    max_model_len: int | None = Field(
        None, ge=1, description="Longest prompt + output; defaults to the model's max_position_embeddings."
    )
    num_kv_blocks: int | None = Field(
        None,
        ge=1,
        description="KV cache blocks; default: sized from kv_cache_memory_gb (CPU) or free GPU memory.",
    )
    kv_cache_memory_gb: float = Field(
        2.0, gt=0, description="KV cache size on CPU when num_kv_blocks is unset."
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="Fraction of GPU memory the weights and KV cache may use."
    )
    enable_prefix_caching: bool = Field(True, description="Reuse KV blocks of shared prompt prefixes.")
    seed: int = Field(0, description="Seed of the engine's generator for requests without their own seed.")
