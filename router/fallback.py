"""Circuit breakers per pool, and one request's walk down its route's fallback chain.

A breaker opens after `failure_threshold` consecutive failures and turns traffic away for
`cooldown_s`; then it lets exactly one probe request through (half-open). The probe's success
closes it, its failure opens it for another cool-down. A probe that never reports back (the
client left before dispatch) frees the probe after one more cool-down, so a pool cannot stay
half-open forever.
"""

import enum
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field


class CircuitState(enum.StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class FallbackReason(enum.StrEnum):
    UNHEALTHY = "unhealthy"  # no healthy replica
    ERROR = "error"  # the pool failed before the first token
    SATURATED = "saturated"  # busier than the tier may wait
    CIRCUIT_OPEN = "circuit_open"
    CONTEXT_LENGTH = "context_length"  # the prompt does not fit the pool's context window


class CircuitBreaker:
    def __init__(
        self,
        failure_threshold: int = 5,
        cooldown_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.failure_threshold, self.cooldown_s, self._clock = failure_threshold, cooldown_s, clock
        self.failures = 0  # consecutive
        self._opened_at: float | None = None
        self._probe_started: float | None = None

    @property
    def state(self) -> CircuitState:
        if self._opened_at is None:
            return CircuitState.CLOSED
        if self._clock() - self._opened_at < self.cooldown_s:
            return CircuitState.OPEN
        return CircuitState.HALF_OPEN

    def reopens_in(self) -> float:
        """Seconds until an open circuit lets a probe through (0 when not open)."""
        if self.state is not CircuitState.OPEN:
            return 0.0
        return self._opened_at + self.cooldown_s - self._clock()

    def allow(self) -> bool:
        """May a request go to this pool now? In half-open state, the one caller told yes is the probe."""
        state = self.state
        if state is CircuitState.CLOSED:
            return True
        if state is CircuitState.OPEN:
            return False
        now = self._clock()
        if self._probe_started is not None and now - self._probe_started < self.cooldown_s:
            return False  # a probe is out
        self._probe_started = now
        return True

    def release_probe(self) -> None:
        """The request allowed through was never sent (rejected elsewhere or abandoned)."""
        self._probe_started = None

    def record_success(self) -> None:
        self.failures = 0
        self._opened_at = self._probe_started = None

    def record_failure(self) -> None:
        self.failures += 1
        probing = self.state is CircuitState.HALF_OPEN
        if probing or (self._opened_at is None and self.failures >= self.failure_threshold):
            self._opened_at = self._clock()
            self._probe_started = None


@dataclass(frozen=True, slots=True)
class Fallback:
    from_pool: str
    reason: FallbackReason

    def header_value(self) -> str:
        return f"{self.from_pool};reason={self.reason}"


@dataclass(slots=True)
class FallbackChain:
    """One request's walk down its candidate pools, remembering each pool it left and why.

    `next_pool()` skips pools that cannot take the request now (unhealthy, circuit open, prompt
    too long) and returns the first that can; `leave(reason)` records why the current pool was
    given up (an error before the first token, saturation) before asking for the next.
    """

    pools: Sequence[str]
    breakers: Mapping[str, CircuitBreaker]
    is_healthy: Callable[[str], bool] = lambda pool: True
    fits: Callable[[str], bool] = lambda pool: True  # the prompt fits the pool's context window
    fallbacks: list[Fallback] = field(default_factory=list)
    current: str | None = None
    _index: int = 0

    def next_pool(self) -> str | None:
        self.current = None
        while self._index < len(self.pools):
            pool = self.pools[self._index]
            self._index += 1
            reason = self._skip_reason(pool)
            if reason is None:
                self.current = pool
                return pool
            self.fallbacks.append(Fallback(pool, reason))
        return None

    def leave(self, reason: FallbackReason) -> None:
        if self.current is not None:
            self.fallbacks.append(Fallback(self.current, reason))
            self.current = None

    def header_value(self) -> str | None:
        """`x-raylane-fallback`: `from_pool;reason=why`, comma-separated when several pools were left."""
        return ", ".join(f.header_value() for f in self.fallbacks) or None

    def _skip_reason(self, pool: str) -> FallbackReason | None:
        if not self.fits(pool):
            return FallbackReason.CONTEXT_LENGTH
        if not self.is_healthy(pool):
            return FallbackReason.UNHEALTHY
        if not self.breakers[pool].allow():  # last: allow() may hand out the half-open probe
            return FallbackReason.CIRCUIT_OPEN
        return None
