"""A request's record: what the gateway learns of one HTTP request while serving it.

`RequestLogMiddleware` (deployments/gateway/request_log.py) opens a `RequestRecord` per request and
makes it `current_record()` for the handler and the stream it returns; the handler adds what only it
knows (the router's time, a pool's `RequestSummary`, resumptions), the middleware what the response
says. Finished, the record is one line of the request log and the gateway's HTTP metrics.
"""

from __future__ import annotations

import contextvars
import json
import time
from dataclasses import dataclass, field
from typing import Any

from raylane import tracing
from raylane.deployments.gateway.spans import route_attributes
from raylane.deployments.protocol.wire import RequestSummary

# The record of the request being handled: set by the middleware around the handler and its stream.
CURRENT: contextvars.ContextVar[RequestRecord | None] = contextvars.ContextVar(
    "raylane_request", default=None
)


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    method: str
    path: str
    started: float = field(default_factory=time.monotonic)
    endpoint: str = "other"  # the route's path template (bounded label values)
    status: int | None = None
    route: str | None = None
    pool: str | None = None
    adapter: str | None = None  # the LoRA adapter it ran with
    tier: str | None = None
    fallback: str | None = None  # x-raylane-fallback: "from;reason=why, ..."
    decision: str | None = None  # x-raylane-decision: how `auto` chose (semantic, rule, default, sticky)
    shed: bool = False
    error_code: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    ttft_s: float | None = None
    finish_reason: str | None = None
    router_latency_s: float | None = None  # set by the gateway where it times the router
    config_generation: int | None = None  # the live config that served it (`raylane apply`)
    resumptions: list[tuple[str, str]] = field(default_factory=list)  # (pool, reason) per resumption
    latency_s: float | None = None
    prompt: Any = None  # only with RAYLANE_LOG_PROMPTS
    trace_id: str | None = None  # the request's trace (32 hex digits) while tracing is on
    span: Any = None  # its root span (deployments/gateway/spans.py); None while tracing is off

    def fallbacks(self) -> list[tuple[str, str, str]]:
        """(from_pool, to_pool, reason) per move down the fallback chain: each pool left handed the
        request to the next one left, the last to the pool that served. Leaving the last candidate
        (every pool busy or down: a 429 or 503) is no fallback and is not listed."""
        if not self.fallback:
            return []
        left = []
        for part in self.fallback.split(","):
            pool, _, reason = part.strip().partition(";reason=")
            left.append((pool, reason or "unknown"))
        served = self.pool if self.pool and self.status is not None and self.status < 400 else None
        targets = [pool for pool, _ in left[1:]] + [served]
        return [(p, to, reason) for (p, reason), to in zip(left, targets, strict=True) if to and to != p]

    def to_json(self, include_prompt: bool = False) -> str:
        fields = {
            "ts": round(time.time(), 3),
            "request_id": self.request_id,
            "method": self.method,
            "endpoint": self.endpoint,
            "status": self.status,
            "route": self.route,
            "pool": self.pool,
            "adapter": self.adapter,
            "tier": self.tier,
            "fallback": self.fallback,
            "decision": self.decision,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "ttft_s": _round(self.ttft_s),
            "latency_s": _round(self.latency_s),
            "finish_reason": self.finish_reason,
            "config_generation": self.config_generation,
        }
        if self.trace_id:
            fields["trace_id"] = self.trace_id
        if self.error_code:
            fields["error_code"] = self.error_code
        if self.resumptions:
            fields["resumptions"] = [{"pool": pool, "reason": reason} for pool, reason in self.resumptions]
        if include_prompt and self.prompt is not None:
            fields["prompt"] = self.prompt
        return json.dumps(fields, separators=(",", ":"), default=str)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def current_record() -> RequestRecord | None:
    """The record of the request being handled (None outside one)."""
    return CURRENT.get()


def note_summary(summary: RequestSummary) -> None:
    """Add a pool's `RequestSummary` (from its last item) to the current request's record."""
    record = CURRENT.get()
    if record is None:
        return
    record.prompt_tokens = (record.prompt_tokens or 0) + summary.prompt_tokens
    record.completion_tokens = (record.completion_tokens or 0) + summary.completion_tokens
    record.cached_tokens = (record.cached_tokens or 0) + summary.cached_tokens
    record.ttft_s = summary.ttft_s
    record.finish_reason = summary.finish_reason


def note_resumption(pool: str, reason: str) -> None:
    """The current request was resumed on `pool` after its replica failed (`reason`)."""
    record = CURRENT.get()
    if record is not None:
        record.resumptions.append((pool, reason))


async def router_timed(awaitable):
    """Await a router call, adding its time to the current record (`raylane_router_latency_seconds`),
    in a `gateway.route` span that names what it decided."""
    started = time.monotonic()
    try:
        with tracing.span("gateway.route") as span:
            result = await awaitable
            if span is not None:
                route_attributes(span, result[0] if isinstance(result, tuple) else result)
            return result
    finally:
        record = CURRENT.get()
        if record is not None:
            record.router_latency_s = (record.router_latency_s or 0.0) + time.monotonic() - started
