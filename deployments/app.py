"""Build the Serve application from a `ClusterConfig`: one `ModelPool` deployment per pool and the
`Gateway` ingress holding their handles (Ray Serve LLM's shape: one ingress, one deployment per model).

    serve.run(build_app(ClusterConfig.from_yaml("cluster.yaml")), name=APP_NAME, route_prefix="/")

A Serve config file can name it too: `import_path: raylane.deployments.app:build_app` with
`args: {config_path: cluster.yaml}` or the config itself under `args`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import ray
from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from raylane.config import ClusterConfig, PoolConfig
from raylane.deployments.gateway.ingress import Gateway
from raylane.deployments.gateway.pool_health import pool_deployment_name
from raylane.deployments.gateway.request_router import PrefixAwareRouter
from raylane.deployments.live_config import GATEWAY_VERSION, LiveState, gateway_user_config, pool_version
from raylane.deployments.pool.autoscaling import LLMAutoscalingPolicy
from raylane.deployments.pool.model_pool import ModelPool
from raylane.engine.executor.placement import DRIVER_GPU_SHARE
from raylane.models.sources import prepare_engine_config

APP_NAME = "raylane"
# At tensor-parallel size > 1 every rank is an actor; the replica itself only schedules and samples.
REPLICA_DRIVER_CPUS = 0.1
# Serve's `graceful_shutdown_timeout_s`: a replica being replaced (redeploy, downscale) stops taking
# requests and finishes the ones in flight, streams included, for up to this long before it is killed
# (Serve's default, 20 s, cuts long streams). Not `gateway.drain_timeout_s`, which is how long
# `raylane serve` lets requests finish when it stops the whole app.
GRACEFUL_SHUTDOWN_TIMEOUT_S = 120.0
# How often a stopping replica looks whether its last request is done. Serve sleeps this long before it
# first looks (default 2 s), so every replica stop (a delete, a rolling restart's step, a downscale)
# took 2 s even with nothing in flight; a count of in-flight requests is cheap to read.
SHUTDOWN_POLL_S = 0.2
# A pool whose replicas failed to start this many times in a row is failed (Serve's default grows with
# the replica count, 3 per replica): a rolling restart to a broken model is given up, and rolled back
# by `raylane apply`, after three tries rather than three per replica.
POOL_START_RETRIES = 3
# The gateway's Serve `max_surge_percent` (a pool's is `replicas.max_surge_percent`), rounded up to whole
# replicas: a rolling restart starts one new replica and waits until it runs before it stops an old
# one, so it never serves below its count, and a replacement that fails to start leaves the old ones.
ONE_REPLICA_SURGE = 1


def serve_logging(access_log: bool) -> dict[str, Any]:
    """Serve's own access log line per call (to a file and to stderr, which Ray's log monitor then tails and
    ships to the driver) repeats the gateway's request log (deployments/gateway/request_log.py), adds a line
    per internal health poll, and under a flood of 429s takes CPU from the requests being served: off unless
    `logs.serve_access_log`."""
    return {"enable_access_log": access_log}


def pool_deployment_options(
    pool: PoolConfig, access_log: bool = False, cluster_has_gpus: bool = False
) -> dict[str, Any]:
    """Serve options of a pool: one placement-group bundle per rank, replicas and autoscaling.

    `device: auto` reserves a GPU per rank when the cluster has GPUs: an actor that reserved none
    sees none (Ray hides them), so its engine would quietly run on the CPU."""
    gpus = 1 if pool.gpus_per_rank or (pool.engine.device == "auto" and cluster_has_gpus) else 0
    rank = {"CPU": pool.engine.cpus_per_rank} | ({"GPU": 1} if gpus else {})
    if pool.in_process:  # the engine runs inside the replica, on the one bundle
        bundles = [rank]
        actor = {"num_cpus": pool.engine.cpus_per_rank, "num_gpus": gpus}
    else:  # rank i's actor runs in bundle i (engine/executor/placement.py); the replica shares bundle 0
        bundles = [{**rank, "CPU": rank["CPU"] + REPLICA_DRIVER_CPUS}] + [rank] * (pool.world_size - 1)
        actor = {"num_cpus": REPLICA_DRIVER_CPUS}
        if gpus and pool.engine.uses_draft_model:  # the draft runs in the replica, on rank 0's GPU
            actor["num_gpus"] = DRIVER_GPU_SHARE
    replicas = pool.replicas
    options: dict[str, Any] = {
        "name": pool_deployment_name(pool.name),
        "ray_actor_options": actor,
        "placement_group_bundles": bundles,
        "placement_group_strategy": pool.engine.placement_strategy,
        "max_ongoing_requests": replicas.max_ongoing_requests,
        "health_check_period_s": pool.health_check_period_s,
        "health_check_timeout_s": pool.health_check_timeout_s,
        "graceful_shutdown_timeout_s": GRACEFUL_SHUTDOWN_TIMEOUT_S,
        "graceful_shutdown_wait_loop_s": SHUTDOWN_POLL_S,
        "max_surge_percent": replicas.max_surge_percent,
        "max_constructor_retry_count": POOL_START_RETRIES,
        "logging_config": serve_logging(access_log),
    }
    if pool.routing.policy == "prefix_aware":
        options["request_router_config"] = request_router_config(pool)
    if replicas.autoscaling:
        options["autoscaling_config"] = {
            "min_replicas": replicas.min_replicas,
            "max_replicas": replicas.max_replicas,
            "initial_replicas": replicas.initial_replicas,
            "target_ongoing_requests": replicas.target_ongoing_requests,
            "upscale_delay_s": replicas.upscale_delay_s,
            "downscale_delay_s": replicas.downscale_delay_s,
            "look_back_period_s": replicas.look_back_period_s,
            "policy": {
                "policy_function": LLMAutoscalingPolicy,
                "policy_kwargs": {
                    "target_ongoing_requests": replicas.target_ongoing_requests,
                    "target_waiting_requests": replicas.target_waiting_requests,
                    "target_kv_cache_usage": replicas.target_kv_cache_usage,
                },
            },
        }
    else:
        options["num_replicas"] = replicas.min_replicas
    return options


def request_router_config(pool: PoolConfig) -> RequestRouterConfig:
    """The pool's replica router (deployments/gateway/request_router.py), in every handle to the pool."""
    routing = pool.routing
    return RequestRouterConfig(
        request_router_class=PrefixAwareRouter,
        request_router_kwargs={
            "pool": pool.name,
            "prefix_weight": routing.prefix_weight,
            "queue_weight": routing.queue_weight,
            "kv_weight": routing.kv_weight,
            "max_imbalance": routing.max_imbalance,
            "block_chars": pool.block_chars,
            "max_indexed_blocks": routing.max_indexed_blocks,
            "max_blocks_per_request": routing.max_blocks_per_request,
            "adapter_weight": routing.adapter_weight,
            "adapter_max_imbalance": routing.adapter_max_imbalance,
        },
        request_routing_stats_period_s=routing.stats_period_s,
    )


def gateway_deployment_options(config: ClusterConfig) -> dict[str, Any]:
    return {
        "name": "Gateway",
        "num_replicas": config.gateway.num_replicas,
        "ray_actor_options": {"num_cpus": config.gateway.num_cpus},
        "max_ongoing_requests": config.gateway.max_ongoing_requests,
        "graceful_shutdown_timeout_s": GRACEFUL_SHUTDOWN_TIMEOUT_S,
        "graceful_shutdown_wait_loop_s": SHUTDOWN_POLL_S,
        "max_surge_percent": ONE_REPLICA_SURGE,
        "logging_config": serve_logging(config.logs.serve_access_log),
    }


def build_app(config: ClusterConfig | dict[str, Any] | str | os.PathLike | None = None) -> Application:
    """The Serve application of a cluster config (a `ClusterConfig`, its dict, a YAML path,
    `{"config_path": ...}` as Serve's `args`, or None for the embedded default). Serve calls it
    with one argument when a config file names it by `import_path`."""
    return build_live_app(_coerce(config))


def build_live_app(
    config: ClusterConfig, live: LiveState | None = None, keep_pools: Sequence[PoolConfig] = ()
) -> Application:
    """With `live` (deployments/live_config.py: what `raylane serve` and `raylane apply` deploy), every
    deployment carries a version from its config, so deploying again restarts only what changed, and
    the gateway reads its config from the recorded one that `live` names. `keep_pools`: pools of the
    running app that `config` leaves out, kept while the gateway stops sending them requests."""
    access_log = config.logs.serve_access_log
    tracing = config.observability.tracing
    has_gpus = ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0
    pools = {}
    for pool in [*config.pools, *keep_pools]:
        deployment = serve.deployment(ModelPool, **pool_deployment_options(pool, access_log, has_gpus))
        if live is not None:
            deployment = deployment.options(version=pool_version(pool, tracing), _internal=True)
        pools[pool.name] = deployment.bind(pool, prepare_engine_config, tracing)
    gateway = serve.deployment(Gateway, **gateway_deployment_options(config))
    if live is not None:
        gateway = gateway.options(
            version=GATEWAY_VERSION, user_config=gateway_user_config(live), _internal=True
        )
    # The config objects themselves travel (pickled, into Serve's records in the GCS): the API keys
    # as their digests, which is all the gateway authenticates with.
    return gateway.bind(config.with_key_digests(), pools)


def _coerce(config) -> ClusterConfig:
    from raylane.config import default_config

    if config is None:
        return default_config()
    if isinstance(config, ClusterConfig):
        return config
    if isinstance(config, dict) and set(config) == {"config_path"}:
        config = config["config_path"]
    if isinstance(config, str | os.PathLike):
        return ClusterConfig.from_yaml(config)
    return ClusterConfig.from_dict(config)


def delete_app(*names: str, timeout_s: float = 120.0) -> None:
    """Delete Serve apps `names`, all at once, and what each keeps outside its replicas on a cluster
    that stays up: its detached actors (response store, batch service, metrics aggregator: each would
    idle on, a Ray worker process apiece) and its live config and run-time LoRA adapters in the GCS.
    The batch records stay on disk, for the next app on the same store."""
    from raylane.deployments import live_config
    from raylane.deployments.batch.service import service_name
    from raylane.deployments.detached import end_detached
    from raylane.deployments.gateway.response_store import store_name
    from raylane.deployments.metrics.aggregator import aggregator_name

    if not names:
        return
    for name in names:
        serve.delete(name, _blocking=False)
    # Serve's own wait looks once a second; its replicas stop in a fraction of that.
    deadline = time.monotonic() + timeout_s
    while set(names) & set(serve.status().applications):
        if time.monotonic() > deadline:
            raise TimeoutError(f"apps {sorted(names)} were not deleted within {timeout_s:.0f} s")
        time.sleep(0.1)
    for name in names:
        for actor in (store_name(name), service_name(name), aggregator_name(name)):
            end_detached(actor)
        live_config.forget(name)
