"""Requests/min and tokens/min per API key, as token buckets that say when to retry.

Each principal has a bucket per limit its tier sets, holding up to one minute's allowance and
refilling continuously. A request needs one request token and its prompt tokens up front; the
tokens it generates are charged when it finishes and may push the bucket below zero, so the
key's next request waits for them. Buckets of keys not seen lately are dropped beyond
`max_principals`, so open mode with many client addresses stays bounded in memory.
"""

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from cluster.config import TierConfig
from router.errors import RateLimitError


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

    def take(self, amount: float) -> None:
        self.level -= min(amount, self.capacity)


class RateLimiter:
    def __init__(self, clock: Callable[[], float] = time.monotonic, max_principals: int = 100_000):
        self._clock = clock
        self._max = max_principals
        self._buckets: OrderedDict[tuple[str, str], dict[str, TokenBucket]] = OrderedDict()

    def check(self, key_id: str, tier: TierConfig, prompt_tokens: int = 0) -> None:
        """Take one request and `prompt_tokens`, or raise RateLimitError with retry_after, taking nothing."""
        buckets = self._buckets_of(key_id, tier)
        waits = {}
        if "requests" in buckets:
            waits["requests"] = buckets["requests"].wait_for(1)
        if "tokens" in buckets:
            waits["tokens"] = buckets["tokens"].wait_for(prompt_tokens)
        limited = {name: w for name, w in waits.items() if w > 0}
        if limited:
            which = " and ".join(f"{name}/min" for name in limited)
            raise RateLimitError(
                f"rate limit of tier {tier.name!r} reached ({which}); retry later",
                retry_after=max(limited.values()),
            )
        if "requests" in buckets:
            buckets["requests"].take(1)
        if "tokens" in buckets:
            buckets["tokens"].take(prompt_tokens)

    def charge_tokens(self, key_id: str, tier: TierConfig, tokens: int) -> None:
        """Generated tokens, counted once known; may leave the bucket in debt."""
        bucket = self._buckets_of(key_id, tier).get("tokens")
        if bucket is not None:
            bucket.level -= tokens

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
        return entry
