"""The cluster's configuration: one pydantic tree, loaded from YAML.

`ClusterConfig` lists the model pools (each a Ray Serve deployment whose replicas own one
engine), the HTTP listener, the gateway, the embeddings model, and the router's sections
(`router`, `tiers`, `api_keys`, defined in `cluster/router_config.py`). Every field is
documented; a bad file fails with one `ConfigError` whose lines each name a field, such as
`pools[1] (reasoning).replicas.max_replicas`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from cluster.packaged_models import PACKAGED_MODELS, packaged_model_path
from cluster.router_config import ApiKeysConfig, RouterConfig, Tiers, default_tiers
from engine.config import EngineConfig

DEMO_PREFIX = "demo:"
DEFAULT_CONFIG_PATH = Path(__file__).with_name("default_config.yaml")
# Pool names and served ids a pool may not take: `auto` asks the router to choose a pool.
RESERVED_MODEL_IDS = frozenset({"auto"})


class ConfigError(ValueError):
    """A config file that does not load or validate; each line of the message names a field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ReplicasConfig(_Strict):
    """How many replicas a pool runs. min == max: a fixed count; otherwise Serve autoscales
    between them on ongoing requests per replica."""

    min_replicas: int = Field(1, ge=0, description="Fewest replicas (0 lets an idle pool scale to zero).")
    max_replicas: int = Field(1, ge=1, description="Most replicas.")
    initial_replicas: int | None = Field(
        None, ge=0, description="Replicas at deploy time when autoscaling; default min_replicas."
    )
    target_ongoing_requests: float = Field(
        16, gt=0, description="Autoscaling target: requests in flight per replica."
    )
    max_ongoing_requests: int = Field(
        64, ge=1, description="Most requests (streams included) one replica serves at once."
    )
    upscale_delay_s: float = Field(30.0, ge=0, description="Load must stay high this long to add replicas.")
    downscale_delay_s: float = Field(600.0, ge=0, description="Load must stay low this long to remove one.")

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


class PoolConfig(_Strict):
    """One model pool: a checkpoint served by replicas of one Serve deployment."""

    name: str = Field(
        pattern=r"^[a-z0-9][a-z0-9_-]{0,62}$",
        description="Pool name (coding, reasoning, chat, ...): routes name it; clients may send it as model.",
    )
    model: str = Field(
        description="Checkpoint directory (config.json + safetensors + tokenizer), a .gguf file, the name "
        f"of a model installed as a package ({', '.join(PACKAGED_MODELS)}), or `demo:<name>` for a "
        "random-weight demo checkpoint (raylane-llama-tiny, raylane-qwen3-moe-tiny), created on first start.",
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
    use_gpu: bool = Field(
        False, description="Reserve one GPU per rank (set on GPU nodes); implied by engine.device: cuda."
    )
    max_n: int = Field(16, ge=1, le=128, description="Largest `n` (choices per request) the pool accepts.")
    max_in_flight: int | None = Field(
        None,
        ge=1,
        description="Requests each gateway replica sends this pool at once; more wait in (priority, "
        "arrival) order. Default: router.default_max_in_flight.",
    )
    max_waiting: int | None = Field(
        None,
        ge=0,
        description="Requests (all tiers) that may wait for this pool in each gateway replica; "
        "default: router.default_max_waiting.",
    )
    health_check_period_s: float = Field(10.0, gt=0, description="Seconds between replica health checks.")
    health_check_timeout_s: float = Field(30.0, gt=0, description="A health check slower than this fails.")

    @model_validator(mode="before")
    @classmethod
    def _engine_model(cls, data: Any) -> Any:
        """The engine's `model` is the pool's; writing it twice (differently) is an error."""
        if not isinstance(data, dict) or not isinstance(data.get("model"), str):
            return data
        engine = data.get("engine") or {}
        if isinstance(engine, EngineConfig):
            return data
        if not isinstance(engine, dict):
            return data  # let field validation name the wrong type
        if engine.get("model", data["model"]) not in (data["model"], _absolute(data["model"])):
            raise ValueError("engine.model: set the pool's `model` instead")
        return {**data, "engine": {**engine, "model": _absolute(data["model"])}}

    @field_validator("model")
    @classmethod
    def _known_demo_or_absolute(cls, model: str) -> str:
        """Demo names must exist; a relative path is taken from where the config is loaded, since
        replicas run in other working directories."""
        from cluster.demo_models import DEMO_MODELS

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
    def packaged_model(self) -> str | None:
        return self.model if self.model in PACKAGED_MODELS else None

    def model_path(self) -> str:
        """The checkpoint on this node (demo models live in `default_demo_dir()`, packaged ones in their
        package)."""
        if self.demo_model is not None:
            from cluster.demo_models import default_demo_dir

            return str(default_demo_dir() / self.demo_model)
        if self.packaged_model is not None:
            return str(packaged_model_path(self.packaged_model))
        return os.path.expanduser(self.model)

    def engine_config(self) -> EngineConfig:
        """The engine's config with the checkpoint path resolved on this node."""
        path = self.model_path()
        tokenizer = os.path.expanduser(self.engine.tokenizer) if self.engine.tokenizer else path
        return self.engine.model_copy(update={"model": path, "tokenizer": tokenizer})

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
    if path.startswith(DEMO_PREFIX) or path in PACKAGED_MODELS:
        return path
    return os.path.abspath(os.path.expanduser(path))


class HttpConfig(_Strict):
    """Where the HTTP listener is, and what it is."""

    host: str = Field("127.0.0.1", description="Listen address; 0.0.0.0 to accept remote clients.")
    port: int = Field(8000, ge=1, le=65535, description="Listen port.")
    ingress: Literal["proxy", "haproxy"] = Field(
        "proxy",
        description="proxy: Serve's HTTP proxy actor passes each request and streamed chunk on to the "
        "gateway. haproxy: Serve's HAProxy direct ingress (Linux; the binary comes with ray[serve]) forwards "
        "connections to the gateway replicas, which serve HTTP themselves: one Python process less per "
        "request and chunk, but a client that leaves while waiting for a whole (non-streamed) response "
        "no longer stops its generation (HAProxy keeps the request going). `raylane serve` only, not "
        "the KubeRay manifests yet.",
    )
    request_timeout_s: float | None = Field(
        None, gt=0, description="End requests (streams included) running longer than this; none by default."
    )


class GatewayConfig(_Strict):
    """The OpenAI-compatible ingress deployment (FastAPI)."""

    num_replicas: int = Field(1, ge=1, description="Gateway replicas (each is cheap: it only forwards).")
    num_cpus: float = Field(0.1, ge=0, description="CPUs each gateway replica reserves.")
    max_ongoing_requests: int = Field(1000, ge=1, description="Requests one gateway replica holds at once.")
    max_request_body_bytes: int = Field(
        8 * 2**20,
        ge=1024,
        description="Largest request body the gateway reads (413 above it), checked before it is parsed, "
        "chunked uploads included.",
    )
    max_batch_prompts: int = Field(
        256, ge=1, description="Most prompts in one /v1/completions request (each is an engine request)."
    )
    pool_health_period_s: float = Field(
        5.0,
        gt=0,
        description="Seconds between the gateway's checks of each pool; a pool that does not "
        "answer is skipped (its route falls back) until it answers again.",
    )
    drain_timeout_s: float = Field(
        30.0,
        ge=0,
        description="On shutdown (`raylane serve` stopped), how long requests in flight may finish while "
        "new ones get 503 with Retry-After.",
    )


class EmbeddingsConfig(_Strict):
    """`POST /v1/embeddings`: sentence embeddings computed in the gateway."""

    enabled: bool = Field(True, description="Serve /v1/embeddings.")
    model_id: str = Field(
        "all-MiniLM-L6-v2", min_length=1, description="The id clients send as `model` for embeddings."
    )
    max_inputs: int = Field(2048, ge=1, description="Most texts in one request.")


class ClusterConfig(_Strict):
    """The whole cluster: what `raylane serve`, the Serve app and the KubeRay manifests are built from."""

    pools: list[PoolConfig] = Field(min_length=1, description="Model pools, each one Serve deployment.")
    http: HttpConfig = Field(default_factory=HttpConfig, description="HTTP listener.")
    gateway: GatewayConfig = Field(default_factory=GatewayConfig, description="The ingress deployment.")
    embeddings: EmbeddingsConfig = Field(default_factory=EmbeddingsConfig, description="/v1/embeddings.")
    router: RouterConfig = Field(
        default_factory=RouterConfig, description="Semantic routes, fallback chains and admission (router/)."
    )
    tiers: Tiers = Field(
        default_factory=default_tiers, description="Priority tiers: rate limits and shedding."
    )
    api_keys: ApiKeysConfig = Field(
        default_factory=ApiKeysConfig, description="API keys and their tiers; none = open development mode."
    )

    @model_validator(mode="after")
    def _unique_ids(self) -> ClusterConfig:
        owner: dict[str, str] = {}  # model id or pool name -> pool that answers to it
        for i, pool in enumerate(self.pools):
            for model_id in dict.fromkeys([pool.name, pool.model_id]):
                where = f"pools[{i}].{'name' if model_id == pool.name else 'served_model_name'}"
                if model_id in RESERVED_MODEL_IDS or model_id == self.embeddings.model_id:
                    raise ValueError(f"{where}: {model_id!r} is reserved")
                if model_id in owner:
                    raise ValueError(f"{where}: {model_id!r} is already used by pool {owner[model_id]!r}")
                owner[model_id] = pool.name
        self.api_keys.check_tiers([t.name for t in self.tiers])
        if (
            "router" in self.model_fields_set
        ):  # the default routes name the default pools; a written one must fit
            pools = [p.name for p in self.pools]
            for i, route in enumerate(self.router.routes):
                for field, name in [("pool", route.pool), *(("fallbacks", f) for f in route.fallbacks)]:
                    if name not in pools:
                        raise ValueError(
                            f"router.routes[{i}].{field}: {name!r} is not a pool (pools: {pools})"
                        )
        return self

    def pool(self, name: str) -> PoolConfig:
        return next(p for p in self.pools if p.name == name)

    @classmethod
    def from_dict(cls, data: Any, source: str = "config") -> ClusterConfig:
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise ConfigError(format_errors(e, data, source)) from None

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> ClusterConfig:
        path = Path(path).expanduser()
        try:
            data = yaml.safe_load(path.read_text())
        except OSError as e:
            raise ConfigError(f"{path}: cannot read: {e.strerror or e}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        return cls.from_dict(data if data is not None else {}, source=str(path))

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json", exclude_defaults=True), sort_keys=False)


def default_config() -> ClusterConfig:
    """The embedded default: the demo models as the `coding`, `reasoning` and `chat` pools."""
    return ClusterConfig.from_yaml(DEFAULT_CONFIG_PATH)


def format_errors(error: ValidationError, data: Any, source: str) -> str:
    lines = [f"{source}: {error.error_count()} invalid field(s)"]
    for err in error.errors(include_url=False):
        field = field_path(err["loc"], data)
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            message = "unknown field"
        lines.append(
            f"  {field}: {message}" if field else f"  {message}"
        )  # top-level checks name their field
    return "\n".join(lines)


def field_path(loc: tuple, data: Any = None) -> str:
    """('pools', 1, 'replicas') -> 'pools[1] (reasoning).replicas', naming list items by their `name`."""
    out, node = "", data
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
            node = node[part] if isinstance(node, list) and part < len(node) else None
            if isinstance(node, dict) and isinstance(node.get("name"), str):
                out += f" ({node['name']})"
        else:
            out += f".{part}" if out else str(part)
            node = node.get(part) if isinstance(node, dict) else None
    return out


__all__ = [
    "ClusterConfig",
    "ConfigError",
    "EmbeddingsConfig",
    "GatewayConfig",
    "HttpConfig",
    "PoolConfig",
    "ReplicasConfig",
    "default_config",
]
