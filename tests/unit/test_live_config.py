"""A config applied to a running cluster (`raylane apply`): the plan it makes, and the router taking a
new config in place without forgetting what requests and keys already hold."""

import pickle

import pytest

from raylane.cluster.apply import plan_changes
from raylane.config import ApiKeysConfig, ClusterConfig, ConfigError, RouterConfig, TierConfig
from raylane.deployments.live_config import config_digest, pool_version
from raylane.router import PoolSpec
from raylane.router.errors import AuthenticationError, RateLimitError
from tests.unit.test_router_facade import FakeClock, bearer, make_router


def cluster(**changes) -> ClusterConfig:
    data = {
        "api_keys": {"keys": {"sk-a": "premium"}},
        "pools": [
            {"name": "chat", "model": "/models/a", "engine": {"max_num_seqs": 8}},
            {"name": "coding", "model": "/models/b"},
        ],
        "router": {"routes": [{"name": "chat", "pool": "chat"}, {"name": "coding", "pool": "coding"}]},
    }
    return ClusterConfig.from_dict(data | changes)


def test_the_plan_sorts_each_change_by_what_it_restarts():
    old = cluster()
    assert plan_changes(old, cluster()).empty

    keys = cluster(api_keys={"keys": {"sk-a": "premium", "sk-new": "standard"}})
    plan = plan_changes(old, keys)
    assert plan.in_place == ["api_keys.keys"] and not (plan.rolled or plan.added or plan.removed)
    assert "sk-new" not in " ".join(plan.lines())  # a key never reaches the output

    pools = [
        {"name": "chat", "model": "/models/a", "engine": {"max_num_seqs": 16}, "max_in_flight": 4},
        {"name": "coding", "model": "/models/b", "replicas": {"min_replicas": 2, "max_replicas": 2}},
        {"name": "new", "model": "/models/c"},
    ]
    plan = plan_changes(old, cluster(pools=pools))
    assert plan.rolled == {"chat": ["engine.max_num_seqs"]}
    assert plan.adjusted == {"coding": ["replicas.min_replicas", "replicas.max_replicas"]}
    assert plan.added == ["new"] and plan.removed == [] and plan.in_place == []

    fewer = cluster(pools=[old.pools[0]], router={"routes": [{"name": "chat", "pool": "chat"}]})
    plan = plan_changes(old, fewer)
    assert plan.removed == ["coding"] and plan.in_place == ["router.routes"]


def test_what_the_listener_fixed_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match="http.port"):
        plan_changes(cluster(), cluster(http={"port": 9000}))


def test_versions_follow_the_replica_settings_only():
    """Serve restarts a deployment when its version changes: a pool's follows what its replicas are
    built from, not its replica count or admission limits."""
    chat = cluster().pools[0]
    assert pool_version(chat) == pool_version(chat.model_copy(update={"max_in_flight": 3}))
    engine = chat.engine.model_copy(update={"max_num_seqs": 4})
    assert pool_version(chat) != pool_version(chat.model_copy(update={"engine": engine}))

    # Adapters are named to the replicas with each request: another one restarts nothing, once the
    # engine serves adapters at all (a pool's first turns on engine.enable_lora, and that does).
    def with_adapters(adapters: dict[str, str]):
        pools = [{"name": "chat", "model": "/models/a", "engine": {"max_num_seqs": 8}, "adapters": adapters}]
        return cluster(pools=pools + [{"name": "coding", "model": "/models/b"}]).pools[0]

    with_one, with_two = with_adapters({"a": "/a"}), with_adapters({"a": "/a", "b": "/b"})
    assert pool_version(with_one) == pool_version(with_two) != pool_version(chat)
    # Two configs that differ only in a key's value are two configs (the dump masks keys).
    other_key = cluster(api_keys={"keys": {"sk-b": "premium"}})
    assert config_digest(cluster()) != config_digest(other_key)


def test_router_update_keeps_slots_spending_and_breakers():
    clock = FakeClock()
    tiers = [
        TierConfig(name="premium", priority=0),
        TierConfig(name="free", priority=2, requests_per_minute=4),
    ]
    router = make_router(tiers=tiers, clock=clock)
    free = router.authenticate(bearer("sk-free"))
    for _ in range(3):
        router.check_rate(free)  # three of its four requests this minute
    held = router.admission.try_acquire("coding", free.tier, free.key_id)
    assert held is not None

    pools = [
        PoolSpec("coding", "coder-7b", max_context_len=4096, max_in_flight=2),
        PoolSpec("chat", "chatter-8b", max_context_len=8192, max_in_flight=1),
        PoolSpec("fresh", "fresh-1b", max_context_len=2048, max_in_flight=1),
    ]
    new_tiers = [tiers[0], tiers[1].model_copy(update={"requests_per_minute": 5})]
    keys = ApiKeysConfig(keys={"sk-free": "free", "sk-new": "premium"}, default_tier="free")
    routes = RouterConfig(
        routes=[{"name": "coding", "pool": "coding"}, {"name": "fresh", "pool": "fresh"}],
        default_route="coding",
    )
    router.update(routes, new_tiers, keys, pools)

    assert router.authenticate(bearer("sk-new")).tier.name == "premium"  # a new key works at once
    with pytest.raises(AuthenticationError):
        router.authenticate(bearer("sk-premium"))  # a removed one does not
    load = router.pool_load("coding")
    assert (load.in_flight, load.capacity) == (1, 2)  # the slot held before is still counted
    free = router.authenticate(bearer("sk-free"))
    router.check_rate(free)
    router.check_rate(free)  # 3 spent + 2 = the new limit of 5
    with pytest.raises(RateLimitError):
        router.check_rate(free)
    assert router.resolve("fresh-1b", []).pools[0] == "fresh"
    held.release()
    assert router.pool_load("coding").in_flight == 0


def test_router_update_refuses_a_route_to_no_pool_and_changes_nothing():
    router = make_router()
    bad = RouterConfig(routes=[{"name": "coding", "pool": "nowhere"}], default_route="coding")
    with pytest.raises(ValueError, match="nowhere"):
        router.update(bad, [TierConfig(name="premium", priority=0)], ApiKeysConfig(), [])
    assert router.authenticate(bearer("sk-premium")).tier.name == "premium"


def test_the_record_of_a_running_config_holds_key_digests_as_json_and_still_authenticates(monkeypatch):
    """Ray's GCS is readable by every job and dashboard user: the live-config record (and the
    gateway's init arguments) keep the inline keys as `sha256:` digests, in JSON, never pickled; the
    config read back is the same config (digest, plan) and its keys still let their holders in."""
    import json

    from raylane.deployments import live_config
    from raylane.router.tiers import ApiKeyAuthenticator

    kv: dict[bytes, bytes] = {}

    class FakeKV:  # Ray's internal KV, as a dict (no Ray started for a unit test)
        @staticmethod
        def _internal_kv_put(key, value, overwrite=True, namespace=None):
            kv[key] = value

        @staticmethod
        def _internal_kv_get(key, namespace=None):
            return kv.get(key)

    monkeypatch.setattr(live_config, "_kv", lambda: FakeKV)
    config = cluster(api_keys={"keys": {"sk-secret-a": "premium", "sk-secret-b": "standard"}})
    digest = live_config.store("app", config)
    [raw] = kv.values()
    assert b"sk-secret" not in raw and json.loads(raw)["api_keys"]["keys"]
    loaded = live_config.load("app", digest)
    assert live_config.config_digest(loaded) == digest and plan_changes(loaded, config).empty
    auth = ApiKeyAuthenticator(loaded.api_keys, loaded.tiers)
    assert auth.authenticate(bearer("sk-secret-a")).tier.name == "premium"
    with pytest.raises(AuthenticationError):  # presenting the digest is not presenting the key
        auth.authenticate(bearer(next(iter(loaded.api_keys.keys)).get_secret_value()))
    assert b"sk-secret" not in pickle.dumps(config.with_key_digests())  # what the gateway is given
