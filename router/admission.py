"""Admission in front of each pool: bounded in-flight slots, and a bounded priority queue for the rest.

A pool takes up to `capacity` requests at once from the gateway. When it is full, requests wait
and get the next free slot in (priority, arrival) order: lower priority numbers first, FIFO
within one. Waiting is bounded three ways, each answered with OverloadedError (429, Retry-After):
- a tier may have at most `max_queue_depth` requests waiting for one pool;
- a request waits at most its tier's `max_queue_wait_s` (and is turned away at once when the
  queue ahead of it, at the recent service time, already needs longer);
- a pool holds at most `max_waiting` waiters in all; when that is full, an arrival takes the place
  of the newest waiter of a lower-priority sheddable tier, or is turned away.
So overload never grows memory: at most sum(max_waiting) requests wait anywhere.

A tier with `max_pool_share` < 1 holds at most that share of a pool's slots at once, so a flood of
its requests leaves the rest free for other tiers: premium traffic then gets a slot at once instead
of waiting for a sheddable request to finish. The share is counted in sequences (a request's n x
prompts, at most the whole share), not requests: a batch line with `n: 8` takes eight of the batch
tier's places, as it takes eight of the engine's `max_num_seqs`. A waiter held back by its share
lets the ones behind it pass.

Within a tier, slots are shared fairly between API keys, and the sharing is work-conserving (as in
llm-d's flow control and vLLM's scheduler, which never idle capacity that a request could use): a
key alone may use everything its tier may, but when a slot frees, the waiter whose key holds the
fewest slots of that pool goes first (then the key served least recently, then arrival). So a key
flooding a pool holds every slot only while nobody else wants one; a second key of its tier gets
the next slot that frees, and the two converge on half each (max-min fair). The gateway does not
preempt, so the second key waits for one release: bounded by the tier's wait budget. Queue places
are shared the same way: when a tier's queue (or the pool's) is full, an arrival takes the place of
the newest waiter of the key with the most waiting, if that key has more waiting than the arrival's
own key would. What is not work-conserving is the tier's hard `max_concurrent_per_key` (requests
of one key held or waiting in all pools of this gateway replica, like a provider's concurrency
limit): past it a request gets a 429 at once (`KeyConcurrencyError`), whatever is free; set it
when a key must never hold more, e.g. so a slow key cannot fill a pool before others arrive.

Retry-After is the estimated wait. For a tier that holds its whole share, that is rounds of its own
slots times how long its own requests hold one: a flood of long sheddable requests is told to come
back when a slot can be its own, rather than retrying in vain while premium traffic pays for each
rejection's trip through the proxy and gateway. Otherwise it is rounds of the pool's slots at the
pool's mean service time. The clients already told to come back, and not yet due, count as waiting
ahead (they will return first): forty clients shed from two slots are told to come back over the
time those slots need to serve them, not all within the next round to be turned away again. Each
such rejection still costs a trip through Serve's proxy and the gateway, CPU the served requests
need. Hints are capped at `MAX_RETRY_AFTER_S`, the longest wait OpenAI's SDKs honour.
"""

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from raylane.config import TierConfig
from raylane.router.errors import KeyConcurrencyError, OverloadedError

SERVICE_TIME_SMOOTHING = 0.2  # weight of the newest request in the pool's mean service time
MAX_RETRY_AFTER_S = 60.0  # OpenAI's SDKs honour a retry hint up to a minute, then back off on their own
MAX_RETURNING = 10_000  # shed clients remembered per tier and pool (each for at most a minute)


@dataclass(slots=True, order=True)
class _Waiter:
    priority: int
    seq: int
    tier: TierConfig = field(compare=False)
    future: asyncio.Future = field(compare=False)
    key: str = field(default="", compare=False)  # the API key's id: slots are shared fairly by key
    sequences: int = field(default=1, compare=False)  # counted against its tier's share


@dataclass(frozen=True, slots=True)
class PoolLoad:
    in_flight: int
    waiting: int
    capacity: int


@dataclass(slots=True)
class _Pool:
    capacity: int
    max_waiting: int
    in_flight: int = 0
    by_tier: dict[str, int] = field(default_factory=dict)  # slots held per tier name
    seqs_by_tier: dict[str, int] = field(default_factory=dict)  # sequences they hold (the share's unit)
    by_key: dict[str, int] = field(default_factory=dict)  # slots held per key id (none held: absent)
    # per key id with requests here: the grant count when it last got a slot (keys take turns)
    last_grant: dict[str, int] = field(default_factory=dict)
    grants: int = 0
    waiters: list[_Waiter] = field(default_factory=list)  # a heap
    service_s: float | None = None  # smoothed time a request holds a slot
    tier_service_s: dict[str, float] = field(default_factory=dict)  # the same, per tier name
    # per tier: (priority, heap of when each client it turned away was told to come back)
    returning: dict[str, tuple[int, list[float]]] = field(default_factory=dict)


class Ticket:
    """A held slot in a pool; `release()` frees it (idempotent)."""

    def __init__(
        self,
        controller: "AdmissionController",
        pool: str,
        tier: TierConfig,
        waited_s: float,
        key: str = "",
        sequences: int = 1,
    ):
        self.pool, self.tier, self.waited_s, self.key = pool, tier, waited_s, key
        self.sequences = sequences  # as counted when it was taken
        self._controller = controller
        self._granted_at = controller.clock()
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            held_s = self._controller.clock() - self._granted_at
            self._controller._release(self.pool, self.tier, held_s, key=self.key, sequences=self.sequences)


class AdmissionController:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._pools: dict[str, _Pool] = {}
        self._seq = itertools.count()
        self._by_key: dict[str, int] = {}  # requests per key id held or waiting, all pools (none: absent)

    def add_pool(self, pool: str, capacity: int, max_waiting: int) -> None:
        self._pools[pool] = _Pool(capacity=capacity, max_waiting=max_waiting)

    def set_capacity(self, pool: str, capacity: int) -> None:
        """Change how many requests the pool takes at once (e.g. when replicas scale); dispatches waiters."""
        self._pools[pool].capacity = capacity
        self._dispatch(self._pools[pool])

    def resize(self, pool: str, capacity: int, max_waiting: int) -> None:
        """A new config's limits for a pool, keeping its slots held and its queue."""
        self._pools[pool].max_waiting = max_waiting
        self.set_capacity(pool, capacity)

    def load(self, pool: str) -> PoolLoad:
        p = self._pools[pool]
        return PoolLoad(p.in_flight, len(p.waiters), p.capacity)

    def held(self, pool: str, tier: str) -> int:
        """Slots of `pool` that requests of the tier named `tier` hold now."""
        return self._pools[pool].by_tier.get(tier, 0)

    def key_requests(self, key: str) -> int:
        """Requests of `key` holding or waiting for a slot, in all pools."""
        return self._by_key.get(key, 0)

    def try_acquire(self, pool: str, tier: TierConfig, key: str = "", sequences: int = 1) -> Ticket | None:
        """A slot now if the tier may take one (and `sequences` more of its share), else None. (After
        every release the waiters that may take a slot have one, so a free slot here is not owed to
        anybody waiting.)"""
        self.check_key_cap(tier, key, pool)
        p = self._pools[pool]
        if self._may_take(p, tier, sequences):
            counted = self._take(p, tier, key, sequences)
            self._count_key(key, +1)
            return Ticket(self, pool, tier, 0.0, key, counted)
        return None

    async def acquire(
        self, pool: str, tier: TierConfig, timeout: float | None = None, key: str = "", sequences: int = 1
    ) -> Ticket:
        """A slot in `pool` for a request of API key `key`, waiting in (priority, fewest slots held by
        its key, arrival) order for at most the tier's wait budget (or `timeout`, if shorter). Raises
        OverloadedError with retry_after when it cannot, KeyConcurrencyError past the key's cap."""
        ticket = self.try_acquire(pool, tier, key, sequences)
        if ticket is not None:
            return ticket
        p = self._pools[pool]
        budget = tier.max_queue_wait_s if timeout is None else min(timeout, tier.max_queue_wait_s)
        self._check_can_wait(pool, p, tier, budget, key)
        waiter = _Waiter(
            tier.priority, next(self._seq), tier, asyncio.get_running_loop().create_future(), key, sequences
        )
        heapq.heappush(p.waiters, waiter)
        self._count_key(key, +1)
        start = self.clock()
        try:
            await asyncio.wait_for(waiter.future, timeout=budget)
        except TimeoutError:
            self._leave_queue(p, waiter)
            raise OverloadedError(
                f"pool {pool!r} had no free slot within {budget:g}s (tier {tier.name!r})",
                retry_after=self.retry_after(pool, tier, key),
                reason="wait_budget",
            ) from None
        except asyncio.CancelledError:
            if _granted(waiter.future):  # the slot came as the caller went away: give it back
                self._release(pool, tier, 0.0, learn=False, key=key, sequences=waiter.future.result())
            else:
                self._leave_queue(p, waiter)
            raise
        return Ticket(self, pool, tier, self.clock() - start, key, waiter.future.result())

    def estimated_wait(self, pool: str, tier: TierConfig, returning: int = 0, key: str = "") -> float:
        """Seconds a new request of `tier` (and key `key`) would wait for `pool`, from the queue ahead
        of it (and `returning` requests due back before it). Of the waiters of its own priority, another
        key's count only up to one more than its own key's: they take turns."""
        p = self._pools[pool]
        if self._may_take(p, tier):
            return 0.0
        same: dict[str, int] = {}
        ahead = returning
        for w in p.waiters:
            if w.priority < tier.priority:
                ahead += 1
            elif w.priority == tier.priority:
                same[w.key] = same.get(w.key, 0) + 1
        own = same.pop(key, 0)
        ahead += own + sum(min(n, own + 1) for n in same.values())
        slots, service = p.capacity, None  # the pool is full: any holder's slot will do
        if p.seqs_by_tier.get(tier.name, 0) >= _share(p, tier):  # only its own requests' slots will do
            slots, service = _share(p, tier), p.tier_service_s.get(tier.name)
        rounds = ahead // max(slots, 1) + 1  # slots free up `slots` at a time
        return rounds * (service or p.service_s or 1.0)

    def retry_after(self, pool: str, tier: TierConfig, key: str = "") -> float:
        """When a request of `tier` (and key `key`) turned away from `pool` should come back: the wait
        with the clients already told to come back (of this tier or one served before it) ahead of
        it. The answer is remembered as one more client coming back."""
        p, now = self._pools[pool], self.clock()
        returning = 0
        for priority, due in p.returning.values():
            while due and due[0] <= now:
                heapq.heappop(due)
            returning += len(due) if priority <= tier.priority else 0
        wait = min(self.estimated_wait(pool, tier, returning, key), MAX_RETRY_AFTER_S)
        due = p.returning.setdefault(tier.name, (tier.priority, []))[1]
        if len(due) < MAX_RETURNING:
            heapq.heappush(due, now + wait)
        return wait

    def check_key_cap(self, tier: TierConfig, key: str, pool: str | None = None) -> None:
        """KeyConcurrencyError (429) when `key` already holds or awaits as many requests as its tier's
        `max_concurrent_per_key`; its Retry-After is what a request of the tier holds `pool` (the
        gateway asks before it reads a body, when no pool is known yet: one second)."""
        cap = tier.max_concurrent_per_key
        if cap is not None and self._by_key.get(key, 0) >= cap:
            p = self._pools.get(pool) if pool is not None else None
            raise KeyConcurrencyError(
                f"this API key already has {cap} requests in flight, the most tier {tier.name!r} allows "
                "at once; retry when one has finished",
                retry_after=(p.tier_service_s.get(tier.name) or p.service_s if p else None) or 1.0,
            )

    def _count_key(self, key: str, delta: int) -> None:
        n = self._by_key.get(key, 0) + delta
        if n > 0:
            self._by_key[key] = n
        else:
            self._by_key.pop(key, None)  # bounded by the keys with requests here, not all keys seen

    def _check_can_wait(self, pool: str, p: _Pool, tier: TierConfig, budget: float, key: str = "") -> None:
        same_tier = sum(1 for w in p.waiters if w.tier.name == tier.name)
        if same_tier >= tier.max_queue_depth and not self._shed_hog(pool, p, tier, key):
            raise OverloadedError(
                f"pool {pool!r} is busy and tier {tier.name!r} already has {same_tier} requests waiting",
                retry_after=self.retry_after(pool, tier, key),
                reason="queue_depth",
            )
        if p.service_s is not None and self.estimated_wait(pool, tier, key=key) > budget:
            raise OverloadedError(
                f"pool {pool!r} is busy: the wait would exceed tier {tier.name!r}'s {budget:g}s",
                retry_after=self.retry_after(pool, tier, key),
                reason="wait_budget",
            )
        if len(p.waiters) >= p.max_waiting and not (
            self._shed_for(pool, p, tier) or self._shed_hog(pool, p, tier, key)
        ):
            raise OverloadedError(
                f"pool {pool!r} is busy and its queue is full",
                retry_after=self.retry_after(pool, tier, key),
                reason="queue_full",
            )

    def _shed_for(self, pool: str, p: _Pool, tier: TierConfig) -> bool:
        """Drop the newest waiter of the lowest-priority sheddable tier below `tier`; False if none."""
        victims = [w for w in p.waiters if w.tier.sheddable and w.priority > tier.priority]
        if not victims:
            return False
        victim = max(victims, key=lambda w: (w.priority, w.seq))
        self._shed(pool, p, victim, "request shed for higher-priority traffic")
        return True

    def _shed_hog(self, pool: str, p: _Pool, tier: TierConfig, key: str) -> bool:
        """Drop the newest waiter of the tier's key with the most waiting, if it has more waiting than
        `key` would with one more; False if none. One key cannot keep the tier's queue to itself."""
        counts: dict[str, int] = {}
        for w in p.waiters:
            if w.tier.name == tier.name:
                counts[w.key] = counts.get(w.key, 0) + 1
        if not counts:
            return False
        hog = max(counts, key=counts.__getitem__)
        if counts[hog] <= counts.get(key, 0) + 1:
            return False
        victim = max((w for w in p.waiters if w.tier.name == tier.name and w.key == hog), key=lambda w: w.seq)
        self._shed(pool, p, victim, "request shed: its API key holds more of the queue than its share")
        return True

    def _shed(self, pool: str, p: _Pool, victim: _Waiter, why: str) -> None:
        self._leave_queue(p, victim)
        victim.future.set_exception(
            OverloadedError(
                f"pool {pool!r} is busy: {why}",
                retry_after=self.retry_after(pool, victim.tier, victim.key),
                reason="shed",
            )
        )

    @staticmethod
    def _may_take(p: _Pool, tier: TierConfig, sequences: int = 1) -> bool:
        share = _share(p, tier)
        held = p.seqs_by_tier.get(tier.name, 0)
        return p.in_flight < p.capacity and held + min(sequences, share) <= share

    @staticmethod
    def _take(p: _Pool, tier: TierConfig, key: str, sequences: int = 1) -> int:
        """Take a slot; the sequences counted against the tier's share (release the same)."""
        counted = min(sequences, _share(p, tier))  # a request larger than the share runs alone in it
        p.in_flight += 1
        p.by_tier[tier.name] = p.by_tier.get(tier.name, 0) + 1
        p.seqs_by_tier[tier.name] = p.seqs_by_tier.get(tier.name, 0) + counted
        p.by_key[key] = p.by_key.get(key, 0) + 1
        return counted

    def _release(
        self,
        pool: str,
        tier: TierConfig,
        held_s: float,
        learn: bool = True,
        key: str = "",
        sequences: int = 1,
    ) -> None:
        p = self._pools[pool]
        p.in_flight -= 1
        p.by_tier[tier.name] -= 1
        p.seqs_by_tier[tier.name] -= sequences
        p.by_key[key] -= 1
        if not p.by_key[key]:
            del p.by_key[key]
        self._count_key(key, -1)
        if learn:
            p.service_s = _smoothed(p.service_s, held_s)
            p.tier_service_s[tier.name] = _smoothed(p.tier_service_s.get(tier.name), held_s)
        self._dispatch(p)

    def _dispatch(self, p: _Pool) -> None:
        """Grant free slots to waiters in (priority, slots its key holds here, when its key last got
        one, arrival) order, passing over those whose tier holds its whole share. Each grant changes
        its key's standing, so the next is chosen afresh: keys of one priority take turns."""
        if not p.waiters or p.in_flight >= p.capacity:
            return
        kept = list(p.waiters)  # a done one (timed out or cancelled) is removed by its own task
        while p.in_flight < p.capacity:
            eligible = [w for w in kept if not w.future.done() and self._may_take(p, w.tier, w.sequences)]
            if not eligible:
                break
            waiter = min(
                eligible,
                key=lambda w: (w.priority, p.by_key.get(w.key, 0), p.last_grant.get(w.key, -1), w.seq),
            )
            kept.remove(waiter)
            counted = self._take(p, waiter.tier, waiter.key, waiter.sequences)
            p.grants += 1
            p.last_grant[waiter.key] = p.grants
            waiter.future.set_result(counted)  # the sequences its ticket gives back
        kept.sort()
        p.waiters = kept  # sorted, hence a heap
        if len(p.last_grant) > len(p.by_key) + len(kept):  # keys gone quiet: a fresh start next time
            active = set(p.by_key) | {w.key for w in kept}
            p.last_grant = {k: n for k, n in p.last_grant.items() if k in active}

    def _leave_queue(self, p: _Pool, waiter: _Waiter) -> None:
        """A waiter leaves without a slot (timed out, cancelled, shed)."""
        if waiter in p.waiters:
            p.waiters.remove(waiter)
            heapq.heapify(p.waiters)
            self._count_key(waiter.key, -1)


def _share(p: _Pool, tier: TierConfig) -> int:
    """Slots of `p` that `tier` may hold at once."""
    return max(1, int(p.capacity * tier.max_pool_share))


def _smoothed(mean: float | None, sample: float) -> float:
    return sample if mean is None else mean + SERVICE_TIME_SMOOTHING * (sample - mean)


def _granted(future: asyncio.Future) -> bool:
    return future.done() and not future.cancelled() and future.exception() is None
