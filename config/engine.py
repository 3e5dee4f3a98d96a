"""Engine settings (`EngineConfig`, vLLM's knobs): a pool's YAML config embeds it as is, and `LLM` /
`AsyncLLM` take the same fields as keyword arguments."""

import os
from typing import Literal

from pydantic import Field, field_validator, model_validator

from raylane.config.base import StrictModel
from raylane.config.model_names import SIM_PREFIX, SIM_PROFILES

KV_CACHE_DTYPE_ON_FLASH = (
    "kv_cache_dtype: bfloat16 with attention_backend flash_varlen needs dtype bfloat16 (FlashAttention "
    "reads the pages in the queries' dtype); use kv_cache_dtype 'auto'"
)


class SpeculativeConfig(StrictModel):
    """Speculative decoding, vLLM's keys: a proposer drafts tokens that one target forward verifies."""

    method: Literal["ngram", "draft_model"] = Field(
        description="ngram: prompt lookup (drafts copy what followed the latest earlier occurrence of the "
        "context's last n tokens); draft_model: a smaller checkpoint with the same tokenizer drafts."
    )
    num_speculative_tokens: int = Field(ge=1, le=16, description="Draft tokens verified per step.")
    prompt_lookup_max: int = Field(4, ge=1, description="ngram: longest suffix looked up.")
    prompt_lookup_min: int = Field(2, ge=1, description="ngram: shortest suffix looked up.")
    model: str | None = Field(None, description="draft_model: the draft checkpoint directory.")

    @model_validator(mode="after")
    def _method_settings(self) -> "SpeculativeConfig":
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config.model: the draft_model method needs a draft checkpoint")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("speculative_config.prompt_lookup_min: must be <= prompt_lookup_max")
        return self


class EngineConfig(StrictModel):
    """One engine (one pool replica): model, batch and KV cache, dtype, parallel layout."""

    model: str = Field(
        description="Local Hugging Face checkpoint directory (config.json + safetensors), or a .gguf file "
        "(llama, mistral, qwen2, qwen3; dequantized at load, see models/gguf.py)."
    )
    tokenizer: str | None = Field(
        None,
        description="Tokenizer directory (or .gguf file); defaults to `model`, and for the simulated backend "
        "to the tokenizer its profile names.",
    )
    backend: Literal["model", "simulated"] = Field(
        "model",
        description="model: run the checkpoint. simulated: no weights and no forward; the real scheduler, KV "
        "block manager, prefix cache, preemption, LoRA slots and output path, with each step taking the time "
        "`sim_profile`'s timing model gives it and tokens drawn deterministically from the prompt "
        "(engine/sim/). A `model` of `sim:<profile>` sets this and `sim_profile`.",
    )
    sim_profile: str | None = Field(
        None,
        description=f"simulated: the hardware profile, one shipped ({', '.join(SIM_PROFILES)}) or the path "
        "of a profile YAML file of the same shape.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights/activations dtype. auto: the checkpoint's dtype on GPU, float32 on CPU."
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: CUDA when available.")

    @field_validator("model", "tokenizer")
    @classmethod
    def _expand_home(cls, path: str | None) -> str | None:
        return os.path.expanduser(path) if path else path

    quantization: Literal["int8", "int4"] | None = Field(
        None,
        description="int8: weight-only int8 (per-output-channel scales) for the linears, the embedding and "
        "the LM head, quantized from the fp checkpoint at load time; norms and MoE experts stay in `dtype`. "
        "int4: weight-only 4-bit for the linears, a scale and zero per 32 inputs (GGUF's Q4_1 blocks, kept "
        "exactly), torch's CPU int4 kernel for decode-sized batches; embedding and LM head int8.",
    )
    cpu_weight_prepack: bool = Field(
        True,
        description="CPU: keep the fp weights of the linears, LM head and MoE experts in oneDNN's blocked "
        "layout and multiply with oneDNN (faster than torch's default CPU matmul: `raylane bench linears`); "
        "false: torch's F.linear. No effect on GPU, nor on the layers int8 quantization takes.",
    )
    cpu_batch_weight_copy: bool = Field(
        False,
        description="CPU with int8/int4: also keep every quantized linear's and the LM head's weight "
        "dequantized and packed for oneDNN (bfloat16 on CPUs with AVX512-BF16, else float32) for calls of "
        "5 rows or more (batched decode, prefill); smaller calls keep reading the 4 or 8 bits. torch's "
        "int4/int8 kernels pay again every 4 rows (int4) or every row (int8); this costs a dense model's "
        "memory more. bench/README.md, 'Compiled decode'.",
    )
    speculative_config: SpeculativeConfig | None = Field(
        None, description="Speculative decoding (ngram prompt lookup or a draft model); None: off."
    )
    block_size: int | None = Field(
        None,
        ge=1,
        le=256,
        description="Tokens per KV cache block. Unset: each rank picks it on its device, 256 where the "
        "flash_varlen attention backend runs (its paged kernel needs pages of a multiple of 256), else 16.",
    )
    attention_backend: Literal["auto", "torch", "cpu_paged", "flash_varlen"] = Field(
        "auto",
        description="torch: gather each request's context (padded) and SDPA with a mask, on any device; "
        "cpu_paged: decoding requests read their KV pages in place in a C++ kernel built on first use "
        "(CPU, float32/bf16, a C++ compiler); "
        "flash_varlen: FlashAttention-2 reading the KV pages in place, one call per step (CUDA, sm80+, "
        "fp16/bf16, block_size a multiple of 256, torch 2.13+). auto: flash_varlen where it can run, "
        "cpu_paged on CPU where it builds, else torch.",
    )
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
        2.0, gt=0, description="KV cache size on CPU, per rank, when num_kv_blocks is unset."
    )
    kv_cache_dtype: Literal["auto", "bfloat16"] = Field(
        "auto",
        description="How keys and values are stored. auto: in the model's dtype (float32 on CPU). "
        "bfloat16: half of float32's bytes, so twice the tokens fit in kv_cache_memory_gb and a decode "
        "step's attention reads half as much; each key and value is rounded to bfloat16 once, when it is "
        "written, and attention still computes in the model's dtype (scores and softmax in float32). With "
        "flash_varlen (CUDA) the model must run in bfloat16 as well.",
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="Fraction of GPU memory the weights and KV cache may use."
    )
    enforce_eager: bool = Field(
        False,
        description="vLLM's switch: true runs every step eagerly; false replays pure-decode steps from CUDA "
        "graphs captured at start-up for batches of 1, 2, 4, ... up to max_num_seqs (CUDA with the "
        "flash_varlen attention backend only; never on CPU).",
    )
    torch_compile: bool = Field(
        False,
        description="CPU: pure-decode steps run the model's forward compiled by torch.compile (inductor's "
        "fused C++ kernels instead of many small ops), compiled once at start-up (about a minute on two "
        "cores the first time, seconds once inductor's on-disk cache has it); prefill stays eager. One "
        "rank without adapters only; off with enforce_eager. bench/README.md, 'Compiled decode'.",
    )
    enable_prefix_caching: bool = Field(True, description="Reuse KV blocks of shared prompt prefixes.")
    enable_lora: bool = Field(
        False,
        description="Serve LoRA adapters (PEFT's format) on this engine's base weights, several in one batch "
        "(vLLM's --enable-lora). CUDA graphs are off with it.",
    )
    max_loras: int = Field(
        4, ge=1, description="Adapters held at once per replica (the least recently used is evicted)."
    )
    max_lora_rank: int = Field(
        16, ge=1, le=256, description="Largest adapter rank served; every adapter slot is this wide."
    )
    iteration_timeout_s: float = Field(
        60.0,
        gt=0,
        description="The engine counts as stuck (its health check fails, so Serve replaces the replica) when "
        "it has requests in flight and has produced no output for this long (vLLM's "
        "VLLM_ENGINE_ITERATION_TIMEOUT_S). Load only slows steps; a hung rank or core stops them.",
    )
    stream_interval: int = Field(
        1,
        ge=1,
        description="Streamed (delta) outputs carry at least this many new tokens, except the first and the "
        "last: fewer, bigger chunks cost serving less CPU per token (vLLM's --stream-interval).",
    )
    stream_batching_interval_ms: float = Field(
        50.0,
        ge=0,
        le=1000,
        description="Streamed outputs after the first go out at most once per this interval, each with every "
        "token made since the last (the last output goes out at once; the engine core hands them over at the "
        "end of the first step past the interval, so a token can wait up to one step longer): serving's CPU "
        "per stream is then bounded by the interval, not by the step rate (Ray Serve LLM's "
        "stream_batching_interval_ms; 0 sends every step's tokens as they come).",
    )
    seed: int = Field(0, description="Seed of the engine's generator for requests without their own seed.")
    engine_core: Literal["auto", "thread", "process"] = Field(
        "auto",
        description="Where AsyncLLM steps the engine: a thread of the serving process, or a process of its "
        "own (vLLM V1's multiprocessing), so streaming work never competes with the steps for the GIL. "
        "process needs the in-process executor (one rank). auto: process for one rank, thread otherwise.",
    )

    # -- parallelism (engine/executor/; the rank layout is in parallel/state.py) --------------
    tensor_parallel_size: int = Field(
        1, ge=1, description="Ranks that split every layer (attention heads, MLP and expert widths)."
    )
    expert_parallel_size: int = Field(
        1,
        ge=1,
        description="Ranks that split the experts of MoE layers. The group has tensor x expert ranks; "
        "each of the expert_parallel_size tensor-parallel groups runs attention on the same batch.",
    )
    distributed_executor_backend: Literal["auto", "uni", "ray"] = Field(
        "auto",
        description="auto: in-process for one rank, one Ray actor per rank otherwise; "
        "ray: Ray actors even for one rank (e.g. to run the model on a GPU bundle of a placement group).",
    )
    distributed_backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="torch.distributed backend of the ranks; auto: nccl on GPUs, gloo on CPUs."
    )
    placement_strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = Field(
        "STRICT_PACK",
        description="Ray placement group strategy of the ranks' bundles when the engine creates the group; "
        "STRICT_PACK keeps them on one node, the others allow spreading a group across nodes.",
    )
    cpus_per_rank: float = Field(
        1.0,
        gt=0,
        description="Ray CPUs each rank's actor reserves (fractional allowed); CPU ranks use "
        "that many torch threads (at least one).",
    )
    placement_timeout_s: float = Field(
        60.0, gt=0, description="How long to wait for the ranks' resources before failing start-up."
    )
    step_timeout_s: float = Field(
        300.0,
        gt=0,
        description="A step (or a collective) of the rank group taking longer than this fails the engine "
        "instead of hanging.",
    )

    @property
    def world_size(self) -> int:
        """Ranks of the worker group: tensor_parallel_size x expert_parallel_size."""
        return self.tensor_parallel_size * self.expert_parallel_size

    @property
    def uses_draft_model(self) -> bool:
        """Whether speculative decoding drafts with a model, which runs where the engine's driver runs."""
        return self.speculative_config is not None and self.speculative_config.method == "draft_model"

    @property
    def simulated(self) -> bool:
        return self.backend == "simulated"

    @property
    def uses_core_process(self) -> bool:
        """Whether AsyncLLM runs this engine in a process of its own (never a simulated one: it steps on a
        thread of the serving process, which its sleeps leave the GIL to)."""
        if self.simulated:
            return False
        one_rank_here = self.distributed_executor_backend != "ray" and self.world_size == 1
        return self.engine_core == "process" or (self.engine_core == "auto" and one_rank_here)

    @model_validator(mode="before")
    @classmethod
    def _sim_model_name(cls, data):
        """`model: sim:<profile>` is `backend: simulated` with that `sim_profile`."""
        if not isinstance(data, dict) or not str(data.get("model", "")).startswith(SIM_PREFIX):
            return data
        profile = data["model"][len(SIM_PREFIX) :]
        if data.get("sim_profile") not in (None, profile):
            raise ValueError(f"sim_profile: {data['sim_profile']!r} contradicts model {data['model']!r}")
        if data.get("backend", "simulated") != "simulated":
            raise ValueError(f"backend: model {data['model']!r} is a simulated engine's; drop `backend`")
        return {**data, "backend": "simulated", "sim_profile": profile}

    @model_validator(mode="after")
    def _simulated_settings(self) -> "EngineConfig":
        if not self.simulated:
            if self.sim_profile is not None:
                raise ValueError("sim_profile: only the simulated backend has a profile (backend: simulated)")
            return self
        if not self.sim_profile:
            raise ValueError(
                f"sim_profile: the simulated backend needs a hardware profile ({', '.join(SIM_PROFILES)}, "
                "or a profile YAML file)"
            )
        if self.sim_profile not in SIM_PROFILES and not self.sim_profile.endswith((".yaml", ".yml")):
            raise ValueError(
                f"sim_profile: unknown profile {self.sim_profile!r}; choose from {', '.join(SIM_PROFILES)} "
                "or give a profile YAML file"
            )
        if self.speculative_config is not None:
            raise ValueError("speculative_config: the simulated backend does not run speculative decoding")
        if self.engine_core == "process":
            raise ValueError(
                "engine_core: the simulated backend steps on a thread of the serving process; use 'auto'"
            )
        if self.world_size > 1 or self.distributed_executor_backend == "ray":
            raise ValueError(
                "tensor_parallel_size: the simulated backend runs no ranks; its profile's timing stands for "
                "the whole replica (leave tensor/expert parallel sizes at 1, distributed_executor_backend "
                "auto)"
            )
        return self

    @model_validator(mode="after")
    def _flash_varlen_pages(self) -> "EngineConfig":
        if self.attention_backend == "cpu_paged" and self.device == "cuda":
            raise ValueError(
                "attention_backend: cpu_paged is a CPU kernel; use 'flash_varlen' or 'auto' on CUDA"
            )
        if self.attention_backend != "flash_varlen":
            return self
        if self.device == "cpu":
            raise ValueError("attention_backend: flash_varlen is a CUDA kernel; use 'torch' or 'auto' on CPU")
        if self.block_size is not None and self.block_size % 256:
            raise ValueError(
                f"block_size: attention_backend flash_varlen reads KV pages of a multiple of 256 tokens "
                f"(FlashAttention-2's paged kernel), got {self.block_size}; use 256"
            )
        if self.dtype == "float32":
            raise ValueError("dtype: attention_backend flash_varlen runs in bfloat16 or float16, not float32")
        if self.kv_cache_dtype == "bfloat16" and self.dtype == "float16":
            raise ValueError(KV_CACHE_DTYPE_ON_FLASH)
        return self

    @model_validator(mode="after")
    def _one_rank_in_process(self) -> "EngineConfig":
        if self.distributed_executor_backend == "uni" and self.world_size > 1:
            raise ValueError(
                f"distributed_executor_backend: 'uni' runs one rank in-process, but tensor_parallel_size x "
                f"expert_parallel_size is {self.world_size}; use 'auto' or 'ray'"
            )
        ray_ranks = self.world_size > 1 or self.distributed_executor_backend == "ray"
        if self.engine_core == "process" and ray_ranks:
            raise ValueError(
                "engine_core: 'process' runs the model in the engine core process, which needs the "
                "in-process executor (one rank, distributed_executor_backend 'auto' or 'uni'); "
                "use 'thread' or 'auto'"
            )
        return self
