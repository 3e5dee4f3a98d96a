"""One request's dispatch: which pool gets it, holding a slot there, and what the client is told.

`DispatchPlan.next_slot()` walks the fallback chain: it skips pools that cannot serve (unhealthy,
circuit open, prompt too long), takes a slot in the first that can (waiting in priority order if
it is full and the tier's budget allows); a pool saturated beyond the budget is a 429, or, with
`router.overflow`, falls through to the next pool. The caller reports how the request went on the
`Slot`; after a failure before the first token it may call `next_slot()` again to fall back. All
waits together stay within the tier's `max_queue_wait_s`.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

from raylane.router.admission import AdmissionController, Ticket
from raylane.router.errors import ContextLengthError, NoPoolAvailableError, OverloadedError
from raylane.router.fallback import CircuitBreaker, FallbackChain, FallbackReason
from raylane.router.rate_limit import RateCharge
from raylane.router.resolve import Resolution
from raylane.router.tiers import Principal

UNAVAILABLE_RETRY_AFTER_S = 5.0  # Retry-After of a 503 when no open circuit says better


@dataclass(slots=True)
class Slot:
    """A pool slot held for one attempt. Report exactly one outcome; later calls are ignored."""

    pool: str
    ticket: Ticket
    plan: "DispatchPlan"
    done: bool = False
    pending: bool = False  # a suspected failure the breaker has not been told of yet

    @property
    def waited_s(self) -> float:
        return self.ticket.waited_s

    def succeeded(self) -> None:
        """The pool answered (the stream finished, even if the client then left)."""
        self._finish(lambda breaker: breaker.record_success())

    def failed(self, reason: FallbackReason = FallbackReason.ERROR) -> None:
        """The pool failed (an error, or no replica). Before the first token the caller may fall back
        with `plan.next_slot()`; after it, the stream ends with an error event and nothing is retried."""
        self._finish(lambda breaker: breaker.record_failure())
        self.plan.chain.leave(reason)

    def abandoned(self) -> None:
        """Nothing was learnt about the pool (the client went away before it answered)."""
        self._finish(lambda breaker: breaker.release_probe())

    def client_error(self) -> None:
        """The pool refused the request as the client's mistake (a 4xx): that says nothing about the
        pool's health, so the breaker counts neither a failure nor a success (a stream of bad
        requests must not keep a failing pool's circuit closed either)."""
        self._finish(lambda breaker: breaker.release_probe())

    def suspect(self, reason: FallbackReason = FallbackReason.ERROR) -> None:
        """The pool failed before its first item in a way that may be the request's own doing (an
        error, not an outage). The slot is freed and the chain moves on now; the breaker hears of it
        only through `blame()` (another pool did otherwise) or not at all, `forgive()` (another pool
        failed the same way: a poisoned request, not a sick pool)."""
        if not self.done:
            self.done = self.pending = True
            self.ticket.release()
            self.plan.chain.leave(reason)

    def blame(self) -> None:
        """A suspected failure was the pool's after all: the breaker counts it."""
        if self.pending:
            self.pending = False
            self.plan.breakers[self.pool].record_failure()

    def forgive(self) -> None:
        """The failure was the request's: the slot (if still held) is freed and nothing is counted."""
        if self.pending:
            self.pending = False
            self.plan.breakers[self.pool].release_probe()
        else:
            self.client_error()

    def _finish(self, report: Callable[[CircuitBreaker], None]) -> None:
        if not self.done:
            self.done = True
            report(self.plan.breakers[self.pool])
            self.ticket.release()


@dataclass(slots=True)
class DispatchPlan:
    resolution: Resolution
    principal: Principal
    chain: FallbackChain
    admission: AdmissionController
    breakers: dict[str, CircuitBreaker]
    deadline: float  # admission clock time by which a slot must be held
    charge: RateCharge  # the rate limit's up-front charge: settle it with the tokens used
    overflow: bool = False  # a saturated pool hands the request to the next one (else 429)
    sequences: int = 1  # n x prompts: what counts against the tier's share of a pool
    pool: str | None = None  # the pool of the latest slot
    _overloads: list[OverloadedError] = field(default_factory=list)

    @property
    def priority(self) -> int:
        """Pass to the engine: lower is served first."""
        return self.principal.tier.priority

    async def next_slot(self) -> Slot:
        """A slot in the next pool that can serve, or OverloadedError (429) / NoPoolAvailableError (503)."""
        tier = self.principal.tier
        while (pool := self.chain.next_pool()) is not None:
            try:
                remaining = max(0.0, self.deadline - self.admission.clock())
                ticket = await self.admission.acquire(
                    pool, tier, timeout=remaining, key=self.principal.key_id, sequences=self.sequences
                )
            except OverloadedError as e:
                self.breakers[pool].release_probe()
                if not self.overflow:
                    raise  # busy is not broken: the client waits its Retry-After, other pools keep theirs
                self.chain.leave(FallbackReason.SATURATED)
                self._overloads.append(e)
                continue
            except BaseException:
                self.breakers[pool].release_probe()
                raise
            self.pool = pool
            return Slot(pool, ticket, self)
        raise self._exhausted()

    def headers(self) -> dict[str, str]:
        """`x-raylane-*` response headers: route, pool, tier and, where it happened, fallback, the
        `auto` decision and the LoRA adapter."""
        headers = {
            "x-raylane-route": self.resolution.route,
            "x-raylane-pool": self.pool or "",
            "x-raylane-tier": self.principal.tier.name,
        }
        fallback = self.chain.header_value()
        if fallback:
            headers["x-raylane-fallback"] = fallback
        if self.resolution.decision is not None:  # how `auto` chose: semantic, rule, default or sticky
            headers["x-raylane-decision"] = self.resolution.decision.method
        if self.resolution.adapter is not None:
            headers["x-raylane-adapter"] = self.resolution.adapter
        return headers

    def _exhausted(self) -> Exception:
        if self._overloads:
            soonest = min((e.retry_after or 1.0) for e in self._overloads)
            return OverloadedError(
                f"every pool for route {self.resolution.route!r} is busy; retry later",
                retry_after=soonest,
                reason=self._overloads[-1].reason,
            )
        reasons = {f.reason for f in self.chain.fallbacks}
        if reasons == {FallbackReason.CONTEXT_LENGTH}:
            return ContextLengthError(
                "the prompt is longer than the context window of every pool that could serve it",
                param="messages",
            )
        tried = ", ".join(f"{f.from_pool} ({f.reason})" for f in self.chain.fallbacks)
        cooldowns = [self.breakers[f.from_pool].reopens_in() for f in self.chain.fallbacks]
        return NoPoolAvailableError(
            f"no pool can serve route {self.resolution.route!r} now: {tried}",
            retry_after=min((c for c in cooldowns if c > 0), default=UNAVAILABLE_RETRY_AFTER_S),
        )
