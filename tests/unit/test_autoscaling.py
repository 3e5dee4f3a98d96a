"""The pool's autoscaling policy (deployments/pool/autoscaling.py) as Serve's controller runs it: the
`AutoscalingConfig` a pool's options make, its policy resolved and wrapped by Serve
(`_apply_autoscaling_config`: scaling factors and delays), called with Serve's `AutoscalingContext`
carrying the engines' reported stats, the decision bounded as Serve bounds it."""

from ray.serve._private.autoscaling_state import _resolve_policy_callable
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from raylane.config import PoolConfig
from raylane.deployments.app import pool_deployment_options

DEPLOYMENT = DeploymentID(name="ModelPool:chat", app_name="raylane")


def serve_config(**replicas) -> AutoscalingConfig:
    pool = {"name": "chat", "model": "demo:raylane-llama-tiny", "engine": {}, "replicas": replicas}
    return AutoscalingConfig(**pool_deployment_options(PoolConfig.model_validate(pool))["autoscaling_config"])


def decide(config: AutoscalingConfig, replicas: int, in_flight: float, waiting=0.0, kv=0.0) -> int:
    """Serve's decision for one tick: each replica reported `waiting` requests and `kv` KV use."""
    ids = [ReplicaID(f"r{i}", DEPLOYMENT) for i in range(replicas)]
    ctx = AutoscalingContext(
        deployment_id=DEPLOYMENT,
        deployment_name=DEPLOYMENT.name,
        app_name=DEPLOYMENT.app_name,
        current_num_replicas=replicas,
        target_num_replicas=replicas,
        running_replicas=ids,
        total_num_requests=in_flight,
        total_queued_requests=0,
        aggregated_metrics={
            "num_requests_waiting": dict.fromkeys(ids, waiting),
            "kv_cache_usage": dict.fromkeys(ids, kv),
        },
        raw_metrics={},
        capacity_adjusted_min_replicas=config.min_replicas,
        capacity_adjusted_max_replicas=config.max_replicas,
        policy_state={},
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=0.0,
        config=config,
    )
    decision, _ = _apply_autoscaling_config(_resolve_policy_callable(config.policy))(ctx)
    return max(config.min_replicas, min(config.max_replicas, decision))  # Serve's `apply_bounds` after it


def test_waiting_requests_or_kv_use_scale_a_pool_that_queue_length_alone_would_not():
    config = serve_config(min_replicas=1, max_replicas=4, upscale_delay_s=0, downscale_delay_s=0)
    # Eight requests in flight on one replica: under target_ongoing_requests (16), Serve's default
    # policy keeps one replica.
    assert decide(config, 1, in_flight=8) == 1
    # Six of them wait in the engine's queue (target 2 per replica): three replicas.
    assert decide(config, 1, in_flight=8, waiting=6) == 3
    # Long contexts: the KV cache 96% full on both replicas (target 0.8): 2 x 0.96 / 0.8 -> 3.
    assert decide(config, 2, in_flight=4, kv=0.96) == 3
    # max_replicas bounds it.
    assert decide(config, 2, in_flight=4, waiting=40) == 4


def test_an_idle_pool_scales_back_to_min_replicas_and_a_signal_can_be_switched_off():
    config = serve_config(min_replicas=1, max_replicas=4, upscale_delay_s=0, downscale_delay_s=0)
    assert decide(config, 3, in_flight=0) == 1
    no_kv = serve_config(
        min_replicas=1, max_replicas=4, upscale_delay_s=0, downscale_delay_s=0, target_kv_cache_usage=None
    )
    assert decide(no_kv, 2, in_flight=4, kv=0.96) == 1
