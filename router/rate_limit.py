"""Requests/min and tokens/min per API key, as token buckets that say when to retry.

Each principal has a bucket per limit its tier sets, holding up to one minute's allowance and
refilling continuously. A request is charged up front, before any costly work is done for it: one
request token and an estimate of its tokens (the gateway's: the body's bytes / 4 for the prompt,
then `max_tokens` x `n` once the body is parsed). The `RateCharge` it gets is settled when the
request ends with the tokens it really used: the difference is refunded, or charged, which may push
the bucket below zero, so the key's next request waits for it. A request that ends without an
answer (a 4xx, a 429 from a busy pool) is settled with nothing used: only its request token stays.
Buckets of keys not seen lately are dropped beyond `max_principals`, so open mode with many client
addresses stays bounded in memory.
"""

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from raylane.config import TierConfig
from raylane.router.errors import RateLimitError


@dataclass(slots=True)
class TokenBucket:
    capacity: float
    per_second: float
    level: float
    updated: float

    @classmethod
    def per_minute(cls, limit: int, now: float) -> "TokenBucket":
        return cls(capacity=float(limit), per_second=limit / 60.0, level=float(limit), updated=now)

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated) * self.per_second)
        self.updated = now

    def wait_for(self, amount: float) -> float:
        """Seconds until `amount` (capped at capacity, so any request can pass eventually) is available."""
        missing = min(amount, self.capacity) - self.level
        return max(0.0, missing / self.per_second)

    def take(self, amount: float) -> float:
        """Take `amount` (capped at capacity); what was taken."""
        taken = min(amount, self.capacity)
        self.level -= taken
        return taken


@dataclass(slots=True)
class RateCharge:
    """Tokens charged up front to one key's tokens/min bucket, to be settled with the real usage."""

    bucket: TokenBucket | None  # None: the tier has no tokens/min limit
    tokens: float = 0.0  # charged so far
    read: float = 0.0  # of which for the request's prompt as read (its bytes), before parsing
    settled: bool = field(default=False)

    def settle(self, used_tokens: int) -> None:
        """The request is over and used `used_tokens`: refund what was charged beyond that, or charge
        the rest (debt the key's next requests wait for). Only the first call counts."""
        if self.settled:
            return
        self.settled = True
        if self.bucket is not None:
            self.bucket.level = min(self.bucket.capacity, self.bucket.level + self.tokens - used_tokens)

    def settle_error(self, status: int) -> None:
        """The request was answered with an error of HTTP `status`. The client's own (a 4xx other
        than 429) keeps the charge for its prompt, which the gateway read and a pool may have
        tokenized, and gets back what it might have generated: otherwise a prompt too long for every
        pool, sent again and again, would cost the pools its tokenization each time and its key
        nothing but a request. Any other error (429, 5xx) gives the whole charge back."""
        self.settle(int(self.read) if 400 <= status < 500 and status != 429 else 0)


class RateLimiter:
    def __init__(self, clock: Callable[[], float] = time.monotonic, max_principals: int = 100_000):
        self._clock = clock
        self._max = max_principals
        self._buckets: OrderedDict[tuple[str, str], dict[str, TokenBucket]] = OrderedDict()

    def check(self, key_id: str, tier: TierConfig, tokens: int = 0) -> RateCharge:
        """Take one request and `tokens` (the request's estimate), or raise RateLimitError with
        retry_after, taking nothing. The charge is to be settled when the request ends."""
        buckets = self._buckets_of(key_id, tier)
        waits = {}
        if "requests" in buckets:
            waits["requests"] = buckets["requests"].wait_for(1)
        if "tokens" in buckets:
            waits["tokens"] = buckets["tokens"].wait_for(tokens)
        self._raise_if_limited(tier, waits)
        if "requests" in buckets:
            buckets["requests"].take(1)
        charge = RateCharge(buckets.get("tokens"))
        if charge.bucket is not None:
            charge.tokens = charge.read = charge.bucket.take(tokens)
        return charge

    def precheck(self, key_id: str, tier: TierConfig) -> None:
        """RateLimitError when the key could not send even the smallest request now (no request left
        this minute, or its tokens/min in debt), taking nothing: a key over its limits is turned away
        before its body is read, so a flood of them costs a look-up each."""
        buckets = self._buckets_of(key_id, tier)
        waits = {name: buckets[name].wait_for(1) for name in ("requests", "tokens") if name in buckets}
        self._raise_if_limited(tier, waits)

    def charge_more(self, charge: RateCharge, key_id: str, tier: TierConfig, tokens: int) -> None:
        """Add `tokens` to an up-front charge (what the request may generate, once known), or raise
        RateLimitError taking nothing more."""
        if charge.bucket is None or charge.settled:
            return
        self._buckets_of(key_id, tier)  # refilled to now
        # One request's whole charge is capped at the bucket's capacity, as in `check`, so that any
        # request can pass once the bucket is full.
        more = min(float(tokens), max(0.0, charge.bucket.capacity - charge.tokens))
        self._raise_if_limited(tier, {"tokens": charge.bucket.wait_for(more) if more else 0.0})
        charge.tokens += charge.bucket.take(more)

    def retier(self, tiers: Sequence[TierConfig]) -> None:
        """New limits for the tiers (a live config change): each key keeps what it has spent this
        minute, measured against the new allowance; a limit removed drops its bucket, one added
        starts full (the next request creates it)."""
        by_name = {t.name: t for t in tiers}
        now = self._clock()
        for (key_id, tier), buckets in list(self._buckets.items()):
            if tier not in by_name:  # the tier is gone: its keys now belong to another
                del self._buckets[(key_id, tier)]
                continue
            _set_limits(buckets, _limits(by_name[tier]), now)

    @staticmethod
    def _raise_if_limited(tier: TierConfig, waits: dict[str, float]) -> None:
        limited = {name: w for name, w in waits.items() if w > 0}
        if limited:
            which = " and ".join(f"{name}/min" for name in limited)
            raise RateLimitError(
                f"rate limit of tier {tier.name!r} reached ({which}); retry later",
                retry_after=max(limited.values()),
            )

    def _buckets_of(self, key_id: str, tier: TierConfig) -> dict[str, TokenBucket]:
        now = self._clock()
        entry = self._buckets.get((key_id, tier.name))
        if entry is None:
            entry = {}
            if tier.requests_per_minute:
                entry["requests"] = TokenBucket.per_minute(tier.requests_per_minute, now)
            if tier.tokens_per_minute:
                entry["tokens"] = TokenBucket.per_minute(tier.tokens_per_minute, now)
            self._buckets[(key_id, tier.name)] = entry
            while len(self._buckets) > self._max:
                self._buckets.popitem(last=False)
        self._buckets.move_to_end((key_id, tier.name))
        for bucket in entry.values():
            bucket.refill(now)
        # A tier made per key (the batch tier carries its key's tier's batch budget): its limits
        # follow the tier the key has now.
        limits = _limits(tier)
        if any(
            (entry[name].capacity if name in entry else None) != (limit or None)
            for name, limit in limits.items()
        ):
            _set_limits(entry, limits, now)
        return entry


def _limits(tier: TierConfig) -> dict[str, int | None]:
    return {"requests": tier.requests_per_minute, "tokens": tier.tokens_per_minute}


def _set_limits(buckets: dict[str, TokenBucket], limits: dict[str, int | None], now: float) -> None:
    """New allowances for one key's buckets, keeping what it has spent this minute; a limit removed
    drops its bucket, one added starts full."""
    for name, limit in limits.items():
        bucket = buckets.get(name)
        if not limit:
            buckets.pop(name, None)
        elif bucket is None:
            buckets[name] = TokenBucket.per_minute(limit, now)
        elif bucket.capacity != limit:
            bucket.refill(now)
            spent = bucket.capacity - bucket.level
            bucket.capacity, bucket.per_second = float(limit), limit / 60.0
            bucket.level = float(limit) - spent
