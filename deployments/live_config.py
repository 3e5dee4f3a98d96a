"""The config a running app serves, kept in Ray's GCS so that `raylane apply` can change it in place.

`raylane serve` and `raylane apply` write each config they deploy here, as JSON with its inline API
keys as their digests (all the gateway needs), under a digest of its dump, and a small JSON
state per app: the generation now served, its digest, the route prefix, how many applies ended how,
and the apply in progress. The gateway's Serve `user_config` names only the generation and digest
(`gateway_user_config`): Serve shows user configs in its status, so no key may be in one. A change
of user config is what makes Serve call `Gateway.reconfigure` on every gateway replica in place; the
replica reads the config from here.

Deployment versions come from the configs too (`pool_version`, `GATEWAY_VERSION`): Serve restarts
a deployment only when its version changes, so a pool whose replica-side settings are unchanged
keeps its replicas through an apply, and the gateway keeps its replicas unless raylane itself
changed.

This is Ray's internal KV (the GCS), which Serve itself keeps its checkpoints in: it lives as long
as the Ray cluster and needs no actor.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from raylane.config import ClusterConfig, PoolConfig, TracingConfig
from raylane.config.router import key_digest

NAMESPACE = "raylane"
# Pool settings the gateway or Serve apply without touching the replica (its router's admission,
# Serve's replica count, routing and health checks, the LoRA adapters the gateway names to it with
# each request): changing only these restarts nothing. (A pool's first adapter also turns on the
# engine's `enable_lora`: a replica setting.)
POOL_FIELDS_OUTSIDE_THE_REPLICA = frozenset(
    {
        "replicas",
        "routing",
        "max_in_flight",
        "max_waiting",
        "health_check_period_s",
        "health_check_timeout_s",
        "adapters",
    }
)


def _raylane_version() -> str:
    try:
        return metadata.version("raylane")
    except metadata.PackageNotFoundError:
        return "unknown"


# The gateway takes every setting of its config in `reconfigure`: only another installed raylane
# version restarts it (a pool version includes the raylane version too).
GATEWAY_VERSION = f"gateway-{_raylane_version()}"


def digest(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def config_digest(config: ClusterConfig) -> str:
    # The JSON dump masks inline keys: their own digest tells two configs apart that differ only there.
    return digest([config.model_dump(mode="json"), _secret_digest(config)])


def _secret_digest(config: ClusterConfig) -> str:
    # Keys as digests: a config and its record (which holds digests only) are the same config.
    keys = sorted((key_digest(k.get_secret_value()), tier) for k, tier in config.api_keys.keys.items())
    return hashlib.sha256(repr(keys).encode()).hexdigest()


def replica_settings(pool: PoolConfig) -> dict:
    """What a pool's replica is built from: a change here is a new replica (a rolling restart)."""
    return pool.model_dump(mode="json", exclude=set(POOL_FIELDS_OUTSIDE_THE_REPLICA))


def pool_version(pool: PoolConfig, tracing: TracingConfig | None = None) -> str:
    """A pool replica's version: its settings and, once set, the cluster's tracing (a replica and its
    engine core take it when they start: a change restarts them)."""
    settings = replica_settings(pool)
    if tracing is not None and tracing != TracingConfig():
        settings["tracing"] = tracing.model_dump(mode="json")
    return f"pool-{_raylane_version()}-{digest(settings)}"


@dataclass(frozen=True)
class LiveState:
    generation: int
    digest: str
    route_prefix: str | None
    applies: dict[str, int]  # result -> count (`raylane_config_applies_total`)
    apply: dict | None  # the apply in progress: started, generation, per pool its action and replicas

    def to_json(self) -> bytes:
        return json.dumps(self.__dict__).encode()


def _kv():
    from ray.experimental import internal_kv

    return internal_kv


def _state_key(app: str) -> bytes:
    return f"live_config:{app}:state".encode()


def _config_key(app: str, config_digest: str) -> bytes:
    return f"live_config:{app}:config:{config_digest}".encode()


def read_state(app: str) -> LiveState | None:
    raw = _kv()._internal_kv_get(_state_key(app), namespace=NAMESPACE)
    return None if raw is None else LiveState(**json.loads(raw))


def write_state(app: str, state: LiveState) -> None:
    _kv()._internal_kv_put(_state_key(app), state.to_json(), overwrite=True, namespace=NAMESPACE)


def load(app: str, config_digest: str) -> ClusterConfig:
    raw = _kv()._internal_kv_get(_config_key(app, config_digest), namespace=NAMESPACE)
    if raw is None:
        raise LookupError(f"app {app}: no config {config_digest} is recorded")
    return ClusterConfig.model_validate(json.loads(raw))


def running_config(app: str) -> tuple[LiveState, ClusterConfig] | None:
    state = read_state(app)
    return None if state is None else (state, load(app, state.digest))


def store(app: str, config: ClusterConfig) -> str:
    """Keep `config` under its digest, as JSON with its API keys as their digests (the GCS is readable
    by every Ray job and dashboard user); returns the digest."""
    key = config_digest(config)
    digested = config.with_key_digests()
    data = digested.model_dump(mode="json", exclude_unset=True)
    if digested.api_keys.keys:  # a JSON dump masks SecretStr: the digests are written as they are
        data["api_keys"]["keys"] = {k.get_secret_value(): t for k, t in digested.api_keys.keys.items()}
    raw = json.dumps(data).encode()
    _kv()._internal_kv_put(_config_key(app, key), raw, overwrite=True, namespace=NAMESPACE)
    return key


def publish(
    app: str, config: ClusterConfig, route_prefix: str | None, previous: LiveState | None
) -> LiveState:
    """Record `config` as the one `app` serves from now: the next generation (1 for a new app)."""
    key = store(app, config)
    generation = 1 if previous is None else previous.generation + (key != previous.digest)
    state = LiveState(
        generation=generation,
        digest=key,
        route_prefix=route_prefix,
        applies=dict(previous.applies) if previous else {},
        apply=None,
    )
    write_state(app, state)
    _forget_old(app, keep={key} | ({previous.digest} if previous else set()))
    return state


def _forget_old(app: str, keep: set[str]) -> None:
    """Keep the configs served now and just before (a gateway replica that restarts while an apply
    ends may still be told the previous one), drop the rest: a failed apply's among them."""
    for key in _kv()._internal_kv_list(f"live_config:{app}:config:".encode(), namespace=NAMESPACE):
        if key.decode().rsplit(":", 1)[1] not in keep:
            _kv()._internal_kv_del(key, namespace=NAMESPACE)


def _ack_key(app: str, replica: str) -> bytes:
    return f"live_config:{app}:ack:{replica}".encode()


def acknowledge(app: str, replica: str, generation: int) -> None:
    """A gateway replica serves `generation` now (what `raylane apply` waits for)."""
    _kv()._internal_kv_put(
        _ack_key(app, replica), str(generation).encode(), overwrite=True, namespace=NAMESPACE
    )


def acknowledged(app: str) -> dict[str, int]:
    """Gateway replica id -> the generation it last said it serves (replicas gone included)."""
    prefix = _ack_key(app, "")
    out = {}
    for key in _kv()._internal_kv_list(prefix, namespace=NAMESPACE):
        raw = _kv()._internal_kv_get(key, namespace=NAMESPACE)
        if raw is not None:
            out[key[len(prefix) :].decode()] = int(raw)
    return out


def gateway_user_config(state: LiveState) -> dict:
    """The gateway's Serve user config: names the config, holds no part of it."""
    return {"config_generation": state.generation, "config_digest": state.digest}


def forget(app: str) -> None:
    """The app is deleted: drop its configs and state, and the LoRA adapters loaded into it at run
    time (deployments/gateway/lora_adapters.py)."""
    for prefix in (f"live_config:{app}:", f"lora:{app}:"):
        _kv()._internal_kv_del(prefix.encode(), del_by_prefix=True, namespace=NAMESPACE)
