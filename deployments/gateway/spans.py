"""The gateway's spans of a request: its root, the routing decision, and each call to a pool.

A request's root span is opened by the request log's middleware (deployments/gateway/request_log.py),
which wraps the handler and the stream it returns: it continues the client's `traceparent` when one
came, else starts the trace, and its ids go back in `x-raylane-trace-id` and `traceparent`. Under it:

    POST /v1/chat/completions          (server) the whole request, stream included
      gateway.authenticate             the key's tier and id (never the key)
      gateway.rate_limit               the key's limits charged before the body is read
      gateway.read_body
      gateway.grammar_check            a grammar checked in the bounded worker (only with one)
      gateway.route                    the route, pool, decision, classifier scores or rule
      gateway.admission                the wait for a slot in a pool (one per pool tried)
      chat <model>                     (client) one call to a pool, per pool tried (fallback hops),
        chat <model>  (pool replica)     whose carrier the `PoolRequest` takes to the pool
      gateway.stream                   relaying the stream to the client, after the first item
        gateway.resume                 a resumption after the replica died: the call it makes is
          chat <model>                 under it, and the new replica's spans under that

Everything here is a no-op while tracing is off (`raylane.tracing`): no span exists, the carrier is
None. Attribute names follow OpenTelemetry's GenAI and HTTP conventions where they have one, else
`raylane.*`.
"""

from __future__ import annotations

from typing import Any

from raylane import tracing
from raylane.deployments.protocol.wire import PoolRequest, RequestSummary

OPERATIONS = {"chat": "chat", "responses": "chat", "completions": "text_completion"}


def route_attributes(span: Any, resolution: Any) -> None:
    """What the router decided (a `Resolution`): route, pools, and for `auto` how it chose."""
    if span is None or resolution is None:
        return
    decision = resolution.decision
    attributes = {
        "gen_ai.request.model": resolution.model,
        "raylane.route": resolution.route,
        "raylane.pool": resolution.pools[0] if resolution.pools else None,
        "raylane.fallback_chain": list(resolution.pools),
        "raylane.adapter": resolution.adapter,
    }
    if decision is not None:
        attributes |= {
            "raylane.route.method": decision.method,
            "raylane.route.confidence": float(decision.confidence),
            # A keyword or regex rule of the route fired (router.routes[].keywords / .regex).
            "raylane.route.rule": f"routes[{decision.route}]" if decision.method == "rule" else None,
        }
        attributes |= {f"raylane.route.score.{r}": float(p) for r, p in decision.scores.items()}
    tracing.set_attributes(span, **attributes)


def start_pool_call(
    request: PoolRequest, pool: str, model: str, attempt: int, parent: Any = None, resumed_tokens: int = 0
) -> Any:
    """The client span of one call to `pool` (None when off or unsampled), child of `parent` (None:
    the current span). Its carrier goes with the call (`PoolRequest.call(..., trace=)`)."""
    if not tracing.enabled() or not tracing.recording(parent if parent is not None else tracing.current()):
        return None
    operation = OPERATIONS[request.endpoint]
    params = request.params
    return tracing.start(
        f"{operation} {model}",
        parent=parent,
        kind="client",
        attributes={
            "gen_ai.operation.name": operation,
            "gen_ai.request.model": model,
            "gen_ai.request.max_tokens": params.max_tokens,
            "gen_ai.request.choice.count": params.n if params.n != 1 else None,
            "raylane.pool": pool,
            "raylane.attempt": attempt,
            "raylane.request_id": request.request_id,
            "raylane.priority": request.priority,
            "raylane.resumed_tokens": resumed_tokens or None,
        },
    )


def end_pool_call(span: Any, failure: Any = None, reason: str | None = None) -> None:
    """End a pool call's span: as failed (the chain fell back, or the stream was resumed, for
    `reason`) when `failure` is given."""
    if span is None:
        return
    if failure is None:
        tracing.end(span)
        return
    message = getattr(failure, "message", None) or type(failure).__name__
    tracing.end(span, error=str(message)[:200], **{"raylane.failure": reason or "error"})


def summary_attributes(span: Any, summary: RequestSummary | None) -> None:
    if span is None or summary is None:
        return
    tracing.set_attributes(
        span,
        **{
            "gen_ai.usage.input_tokens": summary.prompt_tokens,
            "gen_ai.usage.output_tokens": summary.completion_tokens,
            "gen_ai.usage.cache_read.input_tokens": summary.cached_tokens,
            "gen_ai.response.finish_reasons": list(summary.finish_reasons),
        },
    )
