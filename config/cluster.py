"""`ClusterConfig`, the root of the config tree, loaded from YAML.

It lists the model pools (config/pools.py: each a Ray Serve deployment whose replicas own one
engine), the HTTP listener, the gateway, the embeddings model, and the router's sections (`router`,
`tiers`, `api_keys`: config/router.py). Every field is documented; a bad file fails with one
`ConfigError` whose lines each name a field, such as `pools[1] (reasoning).replicas.max_replicas`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from raylane.config.base import StrictModel
from raylane.config.batch import BATCH_TIER, BatchConfig
from raylane.config.errors import ConfigError, format_errors
from raylane.config.observability import ObservabilityConfig
from raylane.config.pools import PoolConfig
from raylane.config.router import ApiKeysConfig, RouterConfig, Tiers, default_tiers

DEFAULT_CONFIG_PATH = Path(__file__).parent / "default_config.yaml"
# Pool names and served ids a pool may not take: `auto` asks the router to choose a pool.
RESERVED_MODEL_IDS = frozenset({"auto"})


class HttpConfig(StrictModel):
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


class GatewayConfig(StrictModel):
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
    grammar_check_timeout_s: float = Field(
        5.0,
        gt=0,
        description="CPU seconds the gateway's worker may spend checking one request's grammar (schema, "
        "regex, EBNF, tools) before it is refused as too complex (400). A pool's compile has its own "
        "bound, `pools[].grammar_compile_timeout_s`.",
    )
    pool_health_period_s: float = Field(
        5.0,
        gt=0,
        description="Seconds between the gateway's checks of each pool. A pool is down (skipped; its "
        "route falls back) only when Ray and Serve have no live replica of it: one too busy to answer "
        "in time is `busy` and keeps its traffic.",
    )
    allow_runtime_lora_updating: bool = Field(
        False,
        description="In open mode (no API keys), let any caller load and unload LoRA adapters at run time "
        "(POST /v1/load_lora_adapter; vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING). With keys, only keys "
        "of a tier with `admin: true` may, whatever this says.",
    )
    prefix_cache_sharing: Literal["key", "tier", "global"] = Field(
        "key",
        description="Who shares a pool's cached prompt blocks (vLLM's cache_salt): `key`, each API key "
        "only its own (a hit, and `cached_tokens`, would tell another key what was sent: OpenAI shares "
        "no cache between organisations); `tier`, the keys of one tier (name a tier per team to share "
        "its system prompts); `global`, everyone (the most hits; only for keys that trust each "
        "other). Open mode (no keys) shares globally: one user",
    )
    lora_adapter_roots: list[str] = Field(
        default_factory=list,
        description="Directories an adapter loaded at run time must lie in, on the pool's nodes (its "
        "path resolved there, symlinks included); empty: run-time loads are refused. The config's "
        "own `pools[].adapters` are the operator's and not limited.",
    )
    metrics_require_key: bool = Field(
        True,
        description="/metrics asks for an API key, as the API does (with keys configured: the pools, "
        "tiers and traffic it shows are the operator's); false: open to any scraper that reaches the "
        "port. Prometheus scrapes Ray's own metrics port on each pod, which needs no key.",
    )
    drain_timeout_s: float = Field(
        30.0,
        ge=0,
        description="On shutdown (`raylane serve` stopped), how long requests in flight may finish while "
        "new ones get 503 with Retry-After.",
    )
    stream_write_timeout_s: float = Field(
        60.0,
        gt=0,
        description="Longest one write of a stream to the client may wait for the client to read; past "
        "it the request is aborted and its pool slot released (where the server applies backpressure; "
        "see deployments/gateway/relay.py).",
    )
    responses_max_stored: int = Field(
        10_000,
        ge=1,
        description="Most responses `/v1/responses` keeps (`store: true`, the default) for "
        "`previous_response_id`, GET and DELETE; the oldest are dropped first.",
    )
    responses_max_stored_per_key: int = Field(
        1_000,
        ge=1,
        description="Most stored responses of one API key (open mode: one client address); past it the "
        "key's own oldest go, so one key cannot push out another's.",
    )
    responses_max_bytes_per_key: int = Field(
        64 * 2**20,
        ge=1,
        description="Most bytes of stored responses (each with its conversation) one API key keeps; past "
        "it the key's own oldest go (a record larger than this is not stored).",
    )
    responses_max_bytes: int = Field(
        1024 * 2**20,
        ge=1,
        description="Most bytes of stored responses in all; past it the oldest of the key holding the most "
        "bytes go.",
    )
    responses_ttl_s: float = Field(
        3600.0, gt=0, description="How long a stored response is kept, in seconds."
    )
    max_resumptions: int = Field(
        2,
        ge=0,
        description="How many times one request may be resumed after its pool replica failed (died, "
        "engine dead): a stream continues on a live replica of the same pool (or a fallback pool serving "
        "the same checkpoint) after the tokens already sent; a whole response is asked for again. "
        "0 turns resumption off.",
    )


class LogsConfig(StrictModel):
    """What Ray Serve itself logs, besides raylane's request log (`RAYLANE_REQUEST_LOG`)."""

    serve_access_log: bool = Field(
        False,
        description="Serve's access line for every call to the gateway and the pools, internal ones "
        "included (the gateway's pool health checks and `stats` calls, every few seconds per pool); off "
        "because the request log already has one line per request. `raylane serve --access-log` turns "
        "it on.",
    )
    serve_log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "WARNING",
        description="Level of the Serve controller's and proxies' own logs in `raylane serve`'s output; "
        "INFO shows each deployment step. Errors (a replica that fails to start) show at any level.",
    )


class EmbeddingsConfig(StrictModel):
    """`POST /v1/embeddings`: sentence embeddings computed in the gateway."""

    enabled: bool = Field(True, description="Serve /v1/embeddings.")
    model_id: str = Field(
        "all-MiniLM-L6-v2", min_length=1, description="The id clients send as `model` for embeddings."
    )
    max_inputs: int = Field(2048, ge=1, description="Most texts in one request.")


# Sections that only the gateway reads, and takes in place. A KubeRay manifest carries them in the
# Gateway deployment's Serve `user_config`, not in the app's `args` (cluster/k8s.py): Serve versions
# every deployment of a declarative app by its `args`, so an edit there restarts every pool replica,
# while a new user config reconfigures the gateway's replicas in place. (`gateway` stays in `args`:
# its replica count and CPUs shape the deployment itself.)
GATEWAY_SECTIONS = ("router", "embeddings")


class ClusterConfig(StrictModel):
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
    logs: LogsConfig = Field(default_factory=LogsConfig, description="What Ray Serve itself logs.")
    batch: BatchConfig = Field(
        default_factory=BatchConfig, description="The Batch API (/v1/files, /v1/batches) on spare capacity."
    )
    observability: ObservabilityConfig = Field(
        default_factory=ObservabilityConfig, description="OpenTelemetry traces of requests (off by default)."
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
        if BATCH_TIER in (t.name for t in self.tiers):
            raise ValueError(f"tiers: {BATCH_TIER!r} is the Batch API's own tier; name yours otherwise")
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

    def with_key_digests(self) -> ClusterConfig:
        """This config with its inline API keys as their digests: what Ray's GCS may keep of it (the
        gateway's init arguments, the live-config record); the gateway authenticates with digests."""
        return self.model_copy(update={"api_keys": self.api_keys.with_digests()})

    def pool(self, name: str) -> PoolConfig:
        return next(p for p in self.pools if p.name == name)

    def with_sections(self, sections: dict[str, Any], source: str = "config") -> ClusterConfig:
        """This config with `sections` (top-level sections, as a config file writes them) in place of
        its own, validated as a whole; ConfigError naming the field."""
        written = {name: getattr(self, name) for name in self.model_fields_set}  # defaults stay defaults
        return ClusterConfig.from_dict(written | sections, source)

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
