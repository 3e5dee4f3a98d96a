"""Errors the router raises for a client: each knows its HTTP status and OpenAI error body."""

import math
import random

MIN_RETRY_S = 1.0  # no client is told to come back sooner
RETRY_JITTER = 0.5  # the hint is spread over [wait, wait * (1 + RETRY_JITTER)]
_jitter = random.Random()


class RouterError(Exception):
    status = 500
    type = "server_error"
    code: str | None = None
    jitter = RETRY_JITTER  # a wait on a shared pool: many clients are told it at once

    def __init__(self, message: str, *, param: str | None = None, retry_after: float | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after = retry_after  # seconds; set on 429 and 503

    def to_openai(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        """Where the client should come back later: `retry-after-ms` (as OpenAI sends it, and its SDKs
        read first) and `Retry-After` in whole seconds, from one jittered wait of at least 1 s. The
        jitter is the point: clients shed together and told the same whole second all came back in
        one burst, and each burst cost premium requests their latency (test_overload)."""
        if self.retry_after is None:
            return {}
        wait_ms = round(max(MIN_RETRY_S, self.retry_after) * _jitter.uniform(1.0, 1.0 + self.jitter) * 1000)
        return {"retry-after": str(math.ceil(wait_ms / 1000)), "retry-after-ms": str(wait_ms)}


class AuthenticationError(RouterError):
    status, type, code = 401, "authentication_error", "invalid_api_key"


class UnknownModelError(RouterError):
    status, type, code = 404, "invalid_request_error", "model_not_found"


class ContextLengthError(RouterError):
    status, type, code = 400, "invalid_request_error", "context_length_exceeded"


class RateLimitError(RouterError):
    """The key's tier is over its requests/min or tokens/min."""

    status, type, code = 429, "rate_limit_error", "rate_limit_exceeded"
    jitter = 0.0  # one key's own budget refills at a known time: no herd to spread


class KeyConcurrencyError(RateLimitError):
    """The key has as many requests held or waiting as its tier's `max_concurrent_per_key`."""

    code = "concurrency_limit_exceeded"


class OverloadedError(RouterError):
    """A pool is saturated beyond what the tier may wait; `reason` says how (for metrics and logs):
    queue_depth, wait_budget, queue_full or shed."""

    status, type, code = 429, "rate_limit_error", "overloaded"

    def __init__(self, message: str, *, retry_after: float | None = None, reason: str = "saturated"):
        super().__init__(message, retry_after=retry_after)
        self.reason = reason


class NoPoolAvailableError(RouterError):
    """No candidate pool can take the request: all unhealthy, circuit-open or failed before a token."""

    status, type, code = 503, "server_error", "pool_unavailable"
