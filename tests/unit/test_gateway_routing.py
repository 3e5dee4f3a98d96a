"""Which routes the gateway's router gets from a cluster config (deployments/gateway/routing.py)."""

import pytest

from raylane.config import ClusterConfig
from raylane.deployments.gateway.routing import effective_router_config, pool_specs

ENGINE = {"max_model_len": 128}


def config(pools: list[str], **extra) -> ClusterConfig:
    return ClusterConfig.from_dict(
        {"pools": [{"name": n, "model": "demo:raylane-llama-tiny", "engine": ENGINE} for n in pools], **extra}
    )


def test_default_routes_are_trimmed_to_the_pools():
    routes = effective_router_config(config(["chat", "reasoning"]))
    assert {r.name: [r.pool, *r.fallbacks] for r in routes.routes} == {
        "reasoning": ["reasoning", "chat"],
        "chat": ["chat", "reasoning"],
    }
    assert routes.default_route == "chat"


def test_default_route_moves_to_a_route_that_is_left():
    routes = effective_router_config(config(["coding"]))
    assert [r.name for r in routes.routes] == ["coding"] and routes.routes[0].fallbacks == []
    assert routes.default_route == "coding"


def test_no_route_left_disables_auto():
    assert effective_router_config(config(["llama"])) is None


def test_a_written_router_section_is_used_as_it_is():
    written = config(["a", "b"], router={"routes": [{"name": "chat", "pool": "a", "fallbacks": ["b"]}]})
    assert effective_router_config(written) is written.router


def test_pool_specs_carry_context_and_capacity():
    cfg = ClusterConfig.from_dict(
        {
            "pools": [
                {"name": "chat", "model": "demo:raylane-llama-tiny", "engine": ENGINE, "max_in_flight": 2}
            ]
        }
    )
    (spec,) = pool_specs(cfg)
    assert (spec.name, spec.max_context_len, spec.max_in_flight, spec.max_waiting) == ("chat", 128, 2, None)


def test_rate_limits_are_the_clusters_split_over_the_gateway_replicas():
    """A tier's limits hold for the cluster: with three gateway replicas each refuses a key past a
    third of them (rounded up), so the key gets its limit in all, not three times it."""
    import pytest

    from raylane.deployments.gateway.routing import build_router
    from raylane.router.errors import RateLimitError

    tiers = [
        {"name": "standard", "priority": 1, "requests_per_minute": 7, "max_concurrent_per_key": 3},
        {"name": "premium", "priority": 0},
    ]
    cfg = config(["llama"], gateway={"num_replicas": 3}, tiers=tiers, api_keys={"default_tier": "standard"})
    router = build_router(cfg)  # no route fits `llama`: no classifier to load
    principal = router.authenticate({}, "10.0.0.1")
    for _ in range(3):  # ceil(7 / 3)
        router.check_rate(principal)
    with pytest.raises(RateLimitError):
        router.check_rate(principal)
    standard = next(t for t in router.authenticator._tiers.values() if t.name == "standard")
    assert standard.max_concurrent_per_key == 1
    assert cfg.tiers[0].requests_per_minute == 7  # the config itself is unchanged


def test_adapters_loaded_at_run_time_join_the_configs_and_name_their_directory_per_pool():
    """What the gateway tells pools and the resolver about LoRA adapters (lora_adapters.py), without
    the GCS record: a config adapter wins over a loaded one of the same name, a loaded one into a
    pool the config no longer has is not served, and the pool a load means is found or asked for."""
    from raylane.deployments.gateway.lora_adapters import LoRAAdapters
    from raylane.deployments.protocol.errors import OpenAIError

    def pool(name: str, **extra) -> dict:
        return {"name": name, "model": "demo:raylane-llama-tiny", "engine": ENGINE, **extra}

    cfg = ClusterConfig.from_dict(
        {
            "pools": [
                pool("chat", adapters={"a": "/cfg/a"}),
                pool("coding", engine=ENGINE | {"enable_lora": True}),
            ]
        }
    )
    lora = LoRAAdapters("app", cfg, lambda: None)
    lora.loaded = {"chat": {"a": "/gcs/a", "b": "/gcs/b"}, "coding": {"b": "/gcs/b2"}, "gone": {"c": "/c"}}
    assert lora.by_pool() == {"chat": {"a": "/cfg/a", "b": "/gcs/b"}, "coding": {"b": "/gcs/b2"}}
    assert [spec.adapters for spec in pool_specs(cfg, lora.by_pool())] == [("a", "b"), ("b",)]
    ref = lora.ref("b", ("chat", "coding"))
    assert (ref.path("chat"), ref.path("coding")) == ("/gcs/b", "/gcs/b2")
    with pytest.raises(OpenAIError, match="model `c` does not exist"):
        lora.ref("c", ("chat",))  # unloaded between the request's resolution and its dispatch
    assert lora.target(None, "coding:x") == lora.target("coding", "x") == ("coding", "x")
    for pool_name, name, says in ((None, "x", "Name the pool"), ("llama", "x", "serves no LoRA")):
        with pytest.raises(OpenAIError, match=says) as raised:
            lora.target(pool_name, name)
        assert raised.value.param == "pool"


def test_with_one_route_auto_goes_there_without_loading_a_classifier():
    """`auto` has nothing to choose among one route: it goes there (`x-raylane-decision: only`), and
    the gateway loads no sentence encoder, nor torch (seconds of CPU at every gateway replica's start)."""
    import subprocess
    import sys

    probe = (
        "import sys; from raylane.config import ClusterConfig; "
        "from raylane.deployments.gateway.routing import build_router; "
        "pools = [{'name': 'coding', 'model': 'demo:raylane-llama-tiny', 'engine': {'max_model_len': 128}}]; "
        "router = build_router(ClusterConfig.from_dict({'pools': pools})); "
        "d = router.resolve('auto', [{'role': 'user', 'content': 'Write a Python function.'}]).decision; "
        "print(d.route, d.pool, d.method, 'torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["coding", "coding", "only", "False"]
