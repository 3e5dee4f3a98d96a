"""A model pool's config: its checkpoint, engine and replicas (one Ray Serve deployment)."""

from __future__ import annotations

import os
import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from raylane.config.base import StrictModel
from raylane.config.engine import EngineConfig
from raylane.config.model_names import DEMO_MODELS, DEMO_PREFIX, PACKAGED_MODELS, SIM_PREFIX, SIM_PROFILES


class ReplicasConfig(StrictModel):
    """How many replicas a pool runs. min == max: a fixed count; otherwise Serve autoscales between
    them on what the engines report (deployments/pool/autoscaling.py): the most replicas that requests in
    flight, requests waiting in the engines or KV-cache use call for against their targets."""

    min_replicas: int = Field(1, ge=0, description="Fewest replicas (0 lets an idle pool scale to zero).")
    max_replicas: int = Field(1, ge=1, description="Most replicas.")
    initial_replicas: int | None = Field(
        None, ge=0, description="Replicas at deploy time when autoscaling; default min_replicas."
    )
    target_ongoing_requests: float = Field(
        16, gt=0, description="Autoscaling target: requests in flight per replica."
    )
    target_waiting_requests: float | None = Field(
        2.0,
        gt=0,
        description="Autoscaling target: requests waiting in the engines' queues per replica (the "
        "batch is full); null: not a signal.",
    )
    target_kv_cache_usage: float | None = Field(
        0.8,
        gt=0,
        le=1,
        description="Autoscaling target: mean share of each replica's KV cache in use; null: not a signal.",
    )
    look_back_period_s: float = Field(
        30.0, gt=0, description="Autoscaling averages the replicas' load over this window."
    )
    max_ongoing_requests: int = Field(
        64, ge=1, description="Most requests (streams included) one replica serves at once."
    )
    upscale_delay_s: float = Field(30.0, ge=0, description="Load must stay high this long to add replicas.")
    downscale_delay_s: float = Field(600.0, ge=0, description="Load must stay low this long to remove one.")
    max_surge_percent: int = Field(
        1,
        ge=0,
        le=100,
        description="Serve's rolling-restart surge, as a share of the replicas rounded up to whole ones: "
        "the default starts one new replica and waits until it runs before an old one stops (the pool "
        "never serves below its count); 0 stops an old replica first, for a cluster with no room for one "
        "more replica (its GPUs).",
    )

    @model_validator(mode="after")
    def _bounds(self) -> ReplicasConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) exceeds max_replicas ({self.max_replicas})")
        if self.initial_replicas is not None and not (
            self.min_replicas <= self.initial_replicas <= self.max_replicas
        ):
            raise ValueError("initial_replicas must lie between min_replicas and max_replicas")
        return self

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas != self.max_replicas


class ReplicaRoutingConfig(StrictModel):
    """How the gateway picks one of a pool's replicas (deployments/gateway/request_router.py): the replica
    whose KV cache most likely holds the request's prefix, unless its load is past a threshold.

    Each replica scores `prefix_weight * match - queue_weight * ongoing - kv_weight * kv_usage`, where
    `match` (0-1) is the share of the request's leading blocks the gateway last sent to that replica,
    `ongoing` its requests in flight (Serve's queue-length probe) and `kv_usage` (0-1) its KV cache in
    use (the replica's routing stats). So `prefix_weight / queue_weight` is how many more requests in
    flight a whole-prefix match is worth."""

    policy: Literal["prefix_aware", "serve_default"] = Field(
        "prefix_aware",
        description="`prefix_aware`: raylane's router; `serve_default`: Serve's power-of-two-choices on "
        "queue length alone (blind to prefixes; for comparison).",
    )
    prefix_weight: float = Field(1.0, ge=0, description="Weight of the prefix match (0-1).")
    queue_weight: float = Field(0.15, ge=0, description="Weight of each request in flight on the replica.")
    kv_weight: float = Field(0.5, ge=0, description="Weight of the replica's KV-cache usage (0-1).")
    max_imbalance: int = Field(
        8,
        ge=0,
        description="A replica with this many more requests in flight than the least loaded one is not "
        "preferred for its prefix: the request goes to the best score without the prefix term.",
    )
    block_chars: int | None = Field(
        None,
        ge=8,
        description="Characters per hashed prompt block; default 4 x engine.block_size (about the "
        "characters of one KV block's tokens), 64 when the ranks pick the block size.",
    )
    max_indexed_blocks: int = Field(
        65536, ge=1, description="Prompt blocks remembered per replica (least recently routed forgotten)."
    )
    max_blocks_per_request: int = Field(
        1024,
        ge=1,
        description="Leading prompt blocks hashed and remembered per request: the work and the index room "
        "one request takes, whatever its length (1024 blocks of 64 characters: the first 64 KiB).",
    )
    stats_period_s: float = Field(
        2.0, gt=0, description="How often Serve asks each replica for its KV usage (routing stats)."
    )
    adapter_weight: float = Field(
        1.0,
        ge=0,
        description="For a request naming a LoRA adapter: the score a replica gains for holding it already "
        "(its routing stats, or this gateway sent it the adapter before).",
    )
    adapter_max_imbalance: int = Field(
        2,
        ge=0,
        description="A replica with this many more requests in flight than the least loaded one is not "
        "preferred for holding the adapter: a hot adapter spreads to another replica, which loads it (a "
        "load takes milliseconds; a longer queue costs every request in it), rather than pinning to one.",
    )


class PoolConfig(StrictModel):
    """One model pool: a checkpoint served by replicas of one Serve deployment."""

    name: str = Field(
        pattern=r"^[a-z0-9][a-z0-9_-]{0,62}$",
        description="Pool name (coding, reasoning, chat, ...): routes name it; clients may send it as model.",
    )
    model: str = Field(
        description="Checkpoint directory (config.json + safetensors + tokenizer), a .gguf file, the name "
        f"of a model installed as a package ({', '.join(PACKAGED_MODELS)}), or `demo:<name>` for a "
        f"random-weight demo checkpoint ({', '.join(DEMO_MODELS)}), created on first start, or "
        f"`sim:<profile>` for a simulated engine with that hardware profile ({', '.join(SIM_PROFILES)}): "
        "no weights, step times from the profile (engine/sim/).",
    )
    served_model_name: str | None = Field(
        None,
        min_length=1,
        description="The id clients send as `model` and /v1/models lists; default: `name`.",
    )
    engine: EngineConfig = Field(
        description="Engine knobs of each replica (batch, KV cache, dtype, tensor/expert parallel sizes, "
        "cpus_per_rank, placement_strategy). `model` is filled in from the pool's `model`.",
    )
    replicas: ReplicasConfig = Field(
        default_factory=ReplicasConfig, description="Replica count and autoscaling."
    )
    routing: ReplicaRoutingConfig = Field(
        default_factory=ReplicaRoutingConfig, description="Choosing a replica: prefix cache affinity."
    )
    use_gpu: bool = Field(
        False, description="Reserve one GPU per rank (set on GPU nodes); implied by engine.device: cuda."
    )
    max_n: int = Field(16, ge=1, le=128, description="Largest `n` (choices per request) the pool accepts.")
    grammar_compile_timeout_s: float = Field(
        5.0,
        gt=0,
        description="Longest a client's grammar (JSON schema, regex, EBNF, forced tool call) may compile in "
        "the pool's worker process; past it the worker is stopped and the request is a 400 "
        "`grammar_too_complex`.",
    )
    reasoning_parser: Literal["qwen3", "deepseek_r1"] | None = Field(
        None,
        description="The model's thinking markup (<think>...</think>), parsed out of the answer into "
        "`reasoning_content` (chat) and a `reasoning` item (Responses): `qwen3` (the output opens "
        "<think> itself) or `deepseek_r1` (the chat template opens it). Default: none, all text is answer.",
    )
    sanitize_control_tokens: bool = Field(
        True,
        description="Control tokens (special tokens such as <|im_start|>/<|im_end|>, and added tokens the "
        "chat template writes, such as <tool_call>) inside message text, tool definitions and template "
        "variables are tokenized as plain text, so a client's text cannot close its turn or forge a "
        "system or assistant turn. false: they become control tokens, as before (trusted callers only).",
    )
    max_in_flight: int | None = Field(
        None,
        ge=1,
        description="Requests each gateway replica sends this pool at once; more wait in (priority, "
        "arrival) order. Default: router.default_max_in_flight, or replicas.max_replicas x "
        "replicas.max_ongoing_requests when that is more (a 16-replica pool held to 64 streams ran at "
        "a quarter of its engines' throughput: bench/README.md, fleet scale).",
    )
    max_waiting: int | None = Field(
        None,
        ge=0,
        description="Requests (all tiers) that may wait for this pool in each gateway replica; "
        "default: router.default_max_waiting.",
    )
    health_check_period_s: float = Field(
        1.0,
        gt=0,
        description="Seconds between Serve's health checks of each replica. Serve learns that a replica "
        "died only at its next check, so this bounds how long a dead replica goes unreplaced (Serve's "
        "default, 10 s, was most of a replica's recovery); the check reads the engine's state, no step.",
    )
    health_check_timeout_s: float = Field(30.0, gt=0, description="A health check slower than this fails.")
    adapters: dict[str, str] = Field(
        default_factory=dict,
        description="LoRA adapters served on this pool's base weights: served name -> PEFT adapter directory "
        "(adapter_config.json + adapter_model.safetensors) on every node. Clients send the name, or "
        "`<pool>:<name>`, as `model`; requests for several adapters and the base model share batches. "
        "Sets engine.enable_lora; engine.max_loras adapters are held at once per replica.",
    )

    @field_validator("adapters")
    @classmethod
    def _adapter_names(cls, adapters: dict[str, str]) -> dict[str, str]:
        for name in adapters:
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", name):
                raise ValueError(f"adapter name {name!r}: letters, digits, '.', '_' and '-' (at most 64)")
        return {name: _absolute(path) for name, path in adapters.items()}

    @model_validator(mode="before")
    @classmethod
    def _engine_model(cls, data: Any) -> Any:
        """The engine's `model` is the pool's; writing it twice (differently) is an error. A pool
        with adapters runs an engine with `enable_lora`."""
        if not isinstance(data, dict) or not isinstance(data.get("model"), str):
            return data
        engine = data.get("engine") or {}
        if isinstance(engine, EngineConfig):
            return data
        if not isinstance(engine, dict):
            return data  # let field validation name the wrong type
        if engine.get("model", data["model"]) not in (data["model"], _absolute(data["model"])):
            raise ValueError("engine.model: set the pool's `model` instead")
        engine = {**engine, "model": _absolute(data["model"])}
        if data.get("adapters"):
            engine["enable_lora"] = True
        return {**data, "engine": engine}

    @field_validator("model")
    @classmethod
    def _known_demo_or_absolute(cls, model: str) -> str:
        """Demo names and simulated profiles must exist; a relative path is taken from where the config
        is loaded, since replicas run in other working directories."""
        if model.startswith(SIM_PREFIX):
            if model[len(SIM_PREFIX) :] not in SIM_PROFILES:
                choices = ", ".join(SIM_PROFILES)
                raise ValueError(f"unknown simulated profile {model!r}; choose from {choices}")
            return model
        if not model.startswith(DEMO_PREFIX):
            return _absolute(model)
        if model[len(DEMO_PREFIX) :] not in DEMO_MODELS:
            raise ValueError(f"unknown demo model {model!r}; choose from {', '.join(DEMO_MODELS)}")
        return model

    @property
    def model_id(self) -> str:
        return self.served_model_name or self.name

    @property
    def demo_model(self) -> str | None:
        return self.model[len(DEMO_PREFIX) :] if self.model.startswith(DEMO_PREFIX) else None

    @property
    def sim_profile(self) -> str | None:
        """The hardware profile of a simulated pool (`model: sim:<profile>`), else None."""
        return self.model[len(SIM_PREFIX) :] if self.model.startswith(SIM_PREFIX) else None

    @property
    def packaged_model(self) -> str | None:
        return self.model if self.model in PACKAGED_MODELS else None

    def engine_config(self, model_path: str | None = None) -> EngineConfig:
        """The engine's config for the checkpoint at `model_path` on this node; by default the pool's
        `model`, when that is a path (a demo or packaged model is found by `raylane.models.sources`).
        A simulated pool's engine has no checkpoint: its config as it is."""
        if self.sim_profile is not None:
            return self.engine
        if model_path is None:
            if self.demo_model is not None or self.packaged_model is not None:
                raise ValueError(
                    f"pool {self.name!r}: model {self.model!r} is not a path; "
                    "raylane.models.sources finds its checkpoint on this node"
                )
            model_path = os.path.expanduser(self.model)
        tokenizer = os.path.expanduser(self.engine.tokenizer) if self.engine.tokenizer else model_path
        return self.engine.model_copy(update={"model": model_path, "tokenizer": tokenizer})

    @property
    def block_chars(self) -> int:
        """Characters per prompt block the replica router hashes (see `ReplicaRoutingConfig`)."""
        return self.routing.block_chars or 4 * (self.engine.block_size or 16)

    @property
    def world_size(self) -> int:
        """Ranks per replica: tensor_parallel_size x expert_parallel_size (engine fields)."""
        return self.engine.world_size

    @property
    def in_process(self) -> bool:
        """Whether the engine runs inside the replica process (one rank, no Ray executor)."""
        return self.world_size == 1 and self.engine.distributed_executor_backend != "ray"

    @property
    def gpus_per_rank(self) -> int:
        return 1 if self.use_gpu or self.engine.device == "cuda" else 0


def _absolute(path: str) -> str:
    if path.startswith((DEMO_PREFIX, SIM_PREFIX)) or path in PACKAGED_MODELS:
        return path
    return os.path.abspath(os.path.expanduser(path))
