"""Errors the router raises for a client: each knows its HTTP status and OpenAI error body."""

import math


class RouterError(Exception):
    status = 500
    type = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, retry_after: float | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after = retry_after  # seconds; set on 429 and 503

    def to_openai(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        """`Retry-After` in whole seconds (at least 1) where the client should come back later."""
        if self.retry_after is None:
            return {}
        return {"retry-after": str(max(1, math.ceil(self.retry_after)))}


class AuthenticationError(RouterError):
    status, type, code = 401, "authentication_error", "invalid_api_key"


class UnknownModelError(RouterError):
    status, type, code = 404, "invalid_request_error", "model_not_found"


class ContextLengthError(RouterError):
    status, type, code = 400, "invalid_request_error", "context_length_exceeded"


class RateLimitError(RouterError):
    """The key's tier is over its requests/min or tokens/min."""

    status, type, code = 429, "rate_limit_error", "rate_limit_exceeded"


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
