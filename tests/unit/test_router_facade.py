"""The `Router` the gateway calls: authenticate, resolve, admit, fall back, and the x-raylane-* headers."""

import asyncio

import pytest

from raylane.config import ApiKeysConfig, CircuitBreakerConfig, RouterConfig, TierConfig, default_tiers
from raylane.router import PoolSpec, Router
from raylane.router.classifier import RouteDecision
from raylane.router.errors import ContextLengthError, NoPoolAvailableError, OverloadedError, RateLimitError
from raylane.router.fallback import CircuitState

KEYS = ApiKeysConfig(keys={"sk-premium": "premium", "sk-free": "free"}, default_tier="free")


class StubClassifier:
    """Routes everything to `route`; the real classifier has its own tests."""

    def __init__(self, route: str = "coding"):
        self.route = route

    def classify(self, messages):
        return RouteDecision(self.route, self.route, 0.97, "semantic", {self.route: 0.97})


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_router(pools=None, tiers=None, clock=None, **router_fields) -> Router:
    pools = pools or [
        PoolSpec("coding", "coder-7b", max_context_len=4096, max_in_flight=1),
        PoolSpec("reasoning", "thinker-30b", max_context_len=32768, max_in_flight=1),
        PoolSpec("chat", "chatter-8b", max_context_len=8192, max_in_flight=1),
    ]
    config = RouterConfig(
        circuit_breaker=CircuitBreakerConfig(failure_threshold=2, cooldown_s=30), **router_fields
    )
    kwargs = {"clock": clock} if clock else {}
    return Router(config, tiers or default_tiers(), KEYS, pools, classifier=StubClassifier(), **kwargs)


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def test_auto_request_gets_a_slot_priority_and_headers():
    router = make_router()
    principal = router.authenticate(bearer("sk-premium"))
    resolution = await router.resolve_async("auto", [{"role": "user", "content": "fix my code"}])
    plan = router.plan(principal, resolution, prompt_tokens=100)
    slot = await plan.next_slot()
    assert slot.pool == "coding" and plan.priority == 0
    assert plan.headers() == {
        "x-raylane-route": "coding",
        "x-raylane-pool": "coding",
        "x-raylane-tier": "premium",
        "x-raylane-decision": "semantic",  # how `auto` chose: the classifier's method
    }
    slot.succeeded()
    assert router.pool_load("coding").in_flight == 0


async def test_error_before_first_token_falls_back_and_says_so():
    router = make_router()
    plan = router.plan(router.authenticate(bearer("sk-premium")), router.resolve("coder-7b", []))
    slot = await plan.next_slot()
    slot.failed()  # e.g. the replica raised before streaming anything
    slot = await plan.next_slot()
    assert slot.pool == "reasoning"
    assert plan.headers()["x-raylane-fallback"] == "coding;reason=error"
    assert plan.headers()["x-raylane-pool"] == "reasoning"
    slot.succeeded()


async def test_open_circuit_is_skipped_until_its_probe_succeeds():
    clock = FakeClock()
    router = make_router(clock=clock)
    principal = router.authenticate(bearer("sk-premium"))
    for _ in range(2):
        slot = await router.plan(principal, router.resolve("coding", [])).next_slot()
        slot.failed()
    assert router.circuit_state("coding") is CircuitState.OPEN
    plan = router.plan(principal, router.resolve("coding", []))
    slot = await plan.next_slot()
    assert slot.pool == "reasoning" and plan.headers()["x-raylane-fallback"] == "coding;reason=circuit_open"
    slot.succeeded()
    clock.now += 30
    probe = await router.plan(principal, router.resolve("coding", [])).next_slot()
    assert probe.pool == "coding"
    other = await router.plan(principal, router.resolve("coding", [])).next_slot()
    assert other.pool == "reasoning"  # one probe at a time
    probe.succeeded()
    other.succeeded()
    assert router.circuit_state("coding") is CircuitState.CLOSED


async def test_unhealthy_and_too_small_pools_are_skipped():
    router = make_router()
    principal = router.authenticate(bearer("sk-premium"))
    router.set_pool_healthy("coding", False)
    plan = router.plan(principal, router.resolve("coding", []))
    slot = await plan.next_slot()
    assert slot.pool == "reasoning"
    assert plan.headers()["x-raylane-fallback"] == "coding;reason=unhealthy"
    slot.succeeded()
    router.set_pool_healthy("coding", True)
    long_prompt = router.plan(principal, router.resolve("coding", []), prompt_tokens=10_000)
    assert (await long_prompt.next_slot()).pool == "reasoning"  # coding's window is 4,096 tokens
    assert long_prompt.headers()["x-raylane-fallback"] == "coding;reason=context_length"


async def test_prompt_longer_than_every_candidate_is_a_400():
    router = make_router()
    plan = router.plan(
        router.authenticate(bearer("sk-premium")), router.resolve("chat", []), prompt_tokens=10**6
    )
    with pytest.raises(ContextLengthError) as excinfo:
        await plan.next_slot()
    assert (
        excinfo.value.status == 400
        and excinfo.value.to_openai()["error"]["code"] == "context_length_exceeded"
    )


SHEDDING_TIERS = [
    TierConfig(name="premium", priority=0, max_queue_wait_s=5),
    TierConfig(name="free", priority=2, max_queue_depth=0, sheddable=True),
]


async def test_a_saturated_pool_is_a_429_and_its_peak_stays_out_of_the_fallback_pools():
    router = make_router(tiers=SHEDDING_TIERS)
    free = router.authenticate(bearer("sk-free"))
    held = await router.plan(free, router.resolve("coding", [])).next_slot()
    busy = router.plan(free, router.resolve("coding", []))
    with pytest.raises(OverloadedError) as excinfo:
        await busy.next_slot()
    assert excinfo.value.status == 429 and "retry-after" in excinfo.value.headers()
    assert "coding" in str(excinfo.value) and busy.chain.header_value() is None
    assert [router.pool_load(p).in_flight for p in ("coding", "reasoning", "chat")] == [1, 0, 0]
    held.succeeded()


async def test_with_overflow_a_saturated_pool_falls_back_then_429_with_retry_after():
    router = make_router(tiers=SHEDDING_TIERS, overflow=True)
    free = router.authenticate(bearer("sk-free"))
    held = [await router.plan(free, router.resolve("coding", [])).next_slot() for _ in range(3)]
    assert [s.pool for s in held] == ["coding", "reasoning", "chat"]
    busy = router.plan(free, router.resolve("coding", []))
    with pytest.raises(OverloadedError) as excinfo:
        await busy.next_slot()
    assert excinfo.value.status == 429 and "retry-after" in excinfo.value.headers()
    premium = router.authenticate(bearer("sk-premium"))
    waiting = asyncio.create_task(router.plan(premium, router.resolve("coding", [])).next_slot())
    await asyncio.sleep(0.01)
    held[0].succeeded()  # premium was queued on coding and gets the freed slot
    assert (await waiting).pool == "coding"


async def test_no_pool_at_all_is_a_503():
    router = make_router()
    for pool in ("coding", "reasoning", "chat"):
        router.set_pool_healthy(pool, False)
    with pytest.raises(NoPoolAvailableError) as excinfo:
        await router.plan(router.authenticate(bearer("sk-premium")), router.resolve("coding", [])).next_slot()
    assert excinfo.value.status == 503 and excinfo.value.retry_after


def test_rate_limit_is_checked_when_planning():
    router = make_router(
        tiers=[
            TierConfig(name="premium", priority=0),
            TierConfig(name="free", priority=2, requests_per_minute=1),
        ]
    )
    free = router.authenticate(bearer("sk-free"))
    router.plan(free, router.resolve("chat", []))
    with pytest.raises(RateLimitError):
        router.plan(free, router.resolve("chat", []))


def test_routes_must_name_existing_pools():
    with pytest.raises(ValueError, match=r"router\.routes\[0\]\.pool: no pool is named 'coding'"):
        make_router(pools=[PoolSpec("chat"), PoolSpec("reasoning")])


def test_model_names_list_auto_pools_and_ids():
    assert make_router().model_names() == [
        "auto",
        "raylane-auto",
        "coding",
        "coder-7b",
        "reasoning",
        "thinker-30b",
        "chat",
        "chatter-8b",
    ]


async def test_client_errors_and_poisoned_requests_are_not_counted_by_the_breaker():
    router = make_router()
    principal = router.authenticate(bearer("sk-premium"))
    for _ in range(5):  # the pool refused the client's request: nothing about its health
        (await router.plan(principal, router.resolve("coding", [])).next_slot()).client_error()
    for _ in range(5):  # failed the same way in two pools: the request's fault, forgiven in both
        plan = router.plan(principal, router.resolve("coding", []))
        first = await plan.next_slot()
        first.suspect()
        second = await plan.next_slot()
        assert second.pool != "coding" and router.pool_load("coding").in_flight == 0
        second.forgive()  # frees its slot too
        first.forgive()
        assert router.pool_load(second.pool).in_flight == 0
    assert router.circuit_state("coding") is CircuitState.CLOSED
    assert router.breakers["coding"].failures == 0
    for _ in range(2):  # a suspect the next pool served is blamed: the pool's failure after all
        plan = router.plan(principal, router.resolve("coding", []))
        first = await plan.next_slot()
        first.suspect()
        (await plan.next_slot()).succeeded()
        first.blame()
        first.blame()  # reported once
    assert router.circuit_state("coding") is CircuitState.OPEN


async def test_a_classifier_that_fails_on_a_text_routes_it_to_the_default_route():
    class Broken:
        def classify(self, messages):
            raise TypeError("TextEncodeInput must be Union[TextInputSequence, ...]")

    config = RouterConfig(circuit_breaker=CircuitBreakerConfig(failure_threshold=2, cooldown_s=30))
    pools = [PoolSpec("coding"), PoolSpec("reasoning"), PoolSpec("chat")]
    router = Router(config, default_tiers(), KEYS, pools, classifier=Broken())
    resolution = await router.resolve_async("auto", [{"role": "user", "content": "x"}])
    assert resolution.route == config.default_route and resolution.decision.method == "default"


def test_a_pool_of_many_replicas_gets_as_many_streams_at_once_as_they_take():
    """Without a `max_in_flight` of its own, a pool takes what its replicas take (max_replicas x
    max_ongoing_requests) when that passes the router's default: a 16-replica pool held to 64
    streams by the gateway ran at a quarter of its engines' throughput (`raylane bench scale`)."""
    from raylane.config import ClusterConfig
    from raylane.deployments.gateway.routing import pool_specs

    config = ClusterConfig.from_dict(
        {
            "pools": [
                {
                    "name": "coding",
                    "model": "sim:llama-3.1-8b-l4",
                    "replicas": {"min_replicas": 16, "max_replicas": 16},
                },
                {"name": "chat", "model": "sim:llama-3.1-8b-l4"},
                {
                    "name": "reasoning",
                    "model": "sim:llama-3.1-8b-l4",
                    "max_in_flight": 8,
                    "replicas": {"min_replicas": 4, "max_replicas": 4},
                },
            ]
        }
    )
    router = make_router(pools=pool_specs(config))
    assert router.pool_load("coding").capacity == 16 * 64
    assert router.pool_load("chat").capacity == 64  # the default, as before
    assert router.pool_load("reasoning").capacity == 8  # a pool's own setting wins
