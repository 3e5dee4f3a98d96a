"""A pool replica's span of one request: the server side of the gateway's call.

It continues the W3C carrier the `PoolRequest` brought (the gateway's span of this call) and is
current while the replica makes the request's items, so the serving code's spans (`pool.render`,
`pool.tokenize`, `pool.grammar_compile`) and the engine's (engine/request_trace.py, through
`AsyncLLM.generate(trace=)`) go under it. It ends with the request's last item, whose summary gives
the GenAI usage attributes. No span without a carrier: tracing off, or the request unsampled.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from raylane import tracing
from raylane.deployments.protocol.wire import FinalItem

if TYPE_CHECKING:
    from raylane.config import PoolConfig
    from raylane.deployments.protocol.wire import PoolItem, PoolRequest

OPERATIONS = {"chat": "chat", "responses": "chat", "completions": "text_completion"}


def start_pool_span(request: PoolRequest, pool: PoolConfig) -> Any:
    """The replica's span of `request` (None while tracing is off here)."""
    operation = OPERATIONS[request.endpoint]
    params = request.params
    attributes = {
        "gen_ai.operation.name": operation,
        "gen_ai.request.model": pool.model_id,
        "gen_ai.request.max_tokens": params.max_tokens,
        "gen_ai.request.temperature": params.temperature,
        "gen_ai.request.top_p": params.top_p,
        "gen_ai.request.seed": params.seed,
        "gen_ai.request.choice.count": params.n if params.n != 1 else None,
        "gen_ai.response.id": request.request_id,
        "raylane.pool": pool.name,
        "raylane.instance": tracing.instance(),
        "raylane.priority": request.priority,
        "raylane.adapter": None if request.adapter is None else request.adapter.name,
        "raylane.resumed_tokens": request.resume.num_tokens if request.resume is not None else None,
    }
    if tracing.include_content():  # the operator turned it on (observability.tracing.include_content)
        attributes["gen_ai.input.messages"] = _input_text(request)
    return tracing.start(
        f"{operation} {pool.model_id}", parent=request.trace, kind="server", attributes=attributes
    )


def end_pool_span(span: Any, last: PoolItem | None) -> None:
    """End the replica's span with the request's summary (from its last item), if it came."""
    if span is None:
        return
    if not isinstance(last, FinalItem):
        tracing.end(span, error="ended before its last item" if last is None else None)
        return
    summary = last.summary
    attributes = {}
    if summary is not None:
        attributes = {
            "gen_ai.usage.input_tokens": summary.prompt_tokens,
            "gen_ai.usage.output_tokens": summary.completion_tokens,
            "gen_ai.usage.cache_read.input_tokens": summary.cached_tokens,
            "gen_ai.response.finish_reasons": list(summary.finish_reasons),
        }
    tracing.end(span, error="engine failed" if last.engine_failed else None, **attributes)


def _input_text(request: PoolRequest) -> str:
    body = request.body
    if request.endpoint == "completions":
        return json.dumps(body.prompt)
    return json.dumps([m.model_dump(exclude_none=True) for m in body.messages])
