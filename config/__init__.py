"""The config tree: one pydantic model per section, loaded from YAML (the root is `ClusterConfig`).

A leaf of the import picture: nothing here imports the rest of the project, so every layer (router,
engine, deployments, the CLI) can import it without pulling in another. The modules:

- `cluster.py`: `ClusterConfig` (HTTP listener, gateway, embeddings, pools, router sections), loading;
- `pools.py`: `PoolConfig`, `ReplicasConfig`, `ReplicaRoutingConfig`;
- `engine.py`: `EngineConfig`, `SpeculativeConfig` (one engine);
- `observability.py`: `ObservabilityConfig`, `TracingConfig` (OpenTelemetry traces);
- `router.py`: routes, tiers and API keys (`router/` reads these and nothing else);
- `model_names.py`: the demo and packaged model names a pool's `model` may take;
- `base.py`, `errors.py`: the strict base model, `ConfigError`.

Where a named model's checkpoint is on a node is not config: `models/sources.py` finds it.
"""

from raylane.config.base import StrictModel
from raylane.config.cluster import (
    DEFAULT_CONFIG_PATH,
    GATEWAY_SECTIONS,
    RESERVED_MODEL_IDS,
    ClusterConfig,
    EmbeddingsConfig,
    GatewayConfig,
    HttpConfig,
    LogsConfig,
    default_config,
)
from raylane.config.engine import EngineConfig, SpeculativeConfig
from raylane.config.errors import ConfigError, field_path, format_errors
from raylane.config.model_names import (
    DEMO_MODELS,
    DEMO_PREFIX,
    PACKAGED_MODELS,
    SIM_PREFIX,
    SIM_PROFILES,
    PackagedModel,
)
from raylane.config.observability import ObservabilityConfig, TracingConfig
from raylane.config.pools import PoolConfig, ReplicaRoutingConfig, ReplicasConfig
from raylane.config.router import (
    AUTO_MODELS,
    BUILTIN_DATASET,
    FOLLOWUP_LABEL,
    AffinityConfig,
    ApiKeysConfig,
    CircuitBreakerConfig,
    ConversationWeights,
    RouteConfig,
    RouterConfig,
    TierConfig,
    Tiers,
    compile_route_regex,
    default_routes,
    default_tiers,
    open_tier,
)

__all__ = [
    "AUTO_MODELS",
    "AffinityConfig",
    "BUILTIN_DATASET",
    "DEFAULT_CONFIG_PATH",
    "DEMO_MODELS",
    "DEMO_PREFIX",
    "FOLLOWUP_LABEL",
    "PACKAGED_MODELS",
    "SIM_PREFIX",
    "SIM_PROFILES",
    "RESERVED_MODEL_IDS",
    "ApiKeysConfig",
    "CircuitBreakerConfig",
    "ClusterConfig",
    "GATEWAY_SECTIONS",
    "ConfigError",
    "compile_route_regex",
    "ConversationWeights",
    "EmbeddingsConfig",
    "EngineConfig",
    "GatewayConfig",
    "HttpConfig",
    "LogsConfig",
    "ObservabilityConfig",
    "PackagedModel",
    "PoolConfig",
    "ReplicaRoutingConfig",
    "ReplicasConfig",
    "RouteConfig",
    "RouterConfig",
    "SpeculativeConfig",
    "StrictModel",
    "TierConfig",
    "TracingConfig",
    "Tiers",
    "default_config",
    "default_routes",
    "default_tiers",
    "open_tier",
    "field_path",
    "format_errors",
]
