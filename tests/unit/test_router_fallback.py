"""Circuit breakers (closed -> open -> half-open probe -> closed) and the per-request fallback chain."""

from raylane.router.fallback import CircuitBreaker, CircuitState, FallbackChain, FallbackReason


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_after_consecutive_failures_then_probes_once_and_closes():
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=3, cooldown_s=30, clock=clock)
    breaker.record_failure()
    breaker.record_failure()
    breaker.record_success()  # not consecutive: counting starts again
    for _ in range(3):
        assert breaker.allow()
        breaker.record_failure()
    assert breaker.state is CircuitState.OPEN and not breaker.allow()
    clock.now = 29.0
    assert not breaker.allow() and breaker.reopens_in() == 1.0
    clock.now = 30.0
    assert breaker.state is CircuitState.HALF_OPEN
    assert breaker.allow()  # the probe
    assert not breaker.allow()  # only one
    breaker.record_success()
    assert breaker.state is CircuitState.CLOSED and breaker.allow() and breaker.allow()


def test_failed_probe_reopens_for_another_cooldown():
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=1, cooldown_s=10, clock=clock)
    breaker.record_failure()
    clock.now = 10.0
    assert breaker.allow()
    breaker.record_failure()
    assert breaker.state is CircuitState.OPEN
    clock.now = 19.0
    assert not breaker.allow()
    clock.now = 20.0
    assert breaker.allow()


def test_unused_or_lost_probe_does_not_wedge_the_breaker():
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=1, cooldown_s=10, clock=clock)
    breaker.record_failure()
    clock.now = 10.0
    assert breaker.allow()
    breaker.release_probe()  # never sent
    assert breaker.allow()  # someone else may probe
    clock.now = 25.0  # that probe never reported back
    assert breaker.allow()


def test_chain_skips_open_circuits_and_says_why():
    clock = FakeClock()
    breakers = {p: CircuitBreaker(1, 30, clock) for p in ("coding", "reasoning", "chat")}
    breakers["coding"].record_failure()
    chain = FallbackChain(["coding", "reasoning", "chat"], breakers)
    assert chain.next_pool() == "reasoning"
    assert chain.header_value() == "coding;reason=circuit_open"
    chain.leave(FallbackReason.ERROR)
    assert chain.next_pool() == "chat"
    assert chain.header_value() == "coding;reason=circuit_open, reasoning;reason=error"
    assert chain.next_pool() is None


def test_chain_skips_unhealthy_pools_and_too_long_prompts():
    breakers = {p: CircuitBreaker() for p in ("a", "b", "c")}
    chain = FallbackChain(["a", "b", "c"], breakers, is_healthy=lambda p: p != "a", fits=lambda p: p != "b")
    assert chain.next_pool() == "c"
    assert [(f.from_pool, f.reason) for f in chain.fallbacks] == [
        ("a", FallbackReason.UNHEALTHY),
        ("b", FallbackReason.CONTEXT_LENGTH),
    ]
