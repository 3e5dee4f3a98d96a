"""The spans of a traced request, made from its timeline (engine/request_trace.py) when it ends."""

from __future__ import annotations

import time

from raylane import tracing
from raylane.engine.request import Request


def is_prefill(request: Request) -> bool:
    """Whether the request's next computed tokens are prompt (or recompute), not its newest token."""
    return request.num_output_tokens == 0 or request.num_computed_tokens < request.num_tokens - 1


def emit_spans(request: Request, finish_reason: str | None, finished: float | None = None) -> None:
    """The request's spans, now that it has ended (their tree: engine/request_trace.py)."""
    trace = request.trace
    if trace is None or not tracing.enabled():
        return
    finished = time.monotonic() if finished is None else finished
    offset = time.time_ns() - time.monotonic_ns()

    def ns(t: float) -> int:
        return int(t * 1e9) + offset

    root = tracing.start(
        "engine.request",
        parent=trace.carrier,
        start_ns=ns(request.arrival_time),
        attributes={
            "raylane.request_id": request.parent_id,
            "raylane.sample_index": request.index,
            "raylane.priority": request.priority,
            "gen_ai.usage.input_tokens": request.num_prompt_tokens,
            "gen_ai.usage.output_tokens": request.num_output_tokens,
            "gen_ai.usage.cache_read.input_tokens": max(request.num_cached_tokens, 0),
            "gen_ai.response.finish_reasons": [finish_reason or "abort"],
            "raylane.preemptions": request.num_preemptions,
        },
    )
    if root is None:
        return
    if trace.first_scheduled is not None:
        tracing.end(
            tracing.start("engine.queue", root, start_ns=ns(request.arrival_time)),
            end_ns=ns(trace.first_scheduled),
        )
    for i, (start, end, tokens) in enumerate(trace.prefill_chunks):
        chunk = tracing.start(
            "engine.prefill",
            root,
            start_ns=ns(start),
            attributes={"raylane.chunk": i, "raylane.tokens": tokens},
        )
        tracing.end(chunk, end_ns=ns(end))
    if request.first_token_time is not None:
        tracing.event(root, "first_token", ns(request.first_token_time))
        decode = tracing.start(
            "engine.decode",
            root,
            start_ns=ns(request.first_token_time),
            attributes={"gen_ai.usage.output_tokens": request.num_output_tokens},
        )
        if trace.draft_tokens:
            tracing.set_attributes(
                decode,
                **{
                    "raylane.spec_decode.draft_tokens": trace.draft_tokens,
                    "raylane.spec_decode.accepted_tokens": trace.accepted_tokens,
                    "raylane.spec_decode.acceptance_rate": trace.accepted_tokens / trace.draft_tokens,
                },
            )
        tracing.end(decode, end_ns=ns(finished))
    for at in trace.preemptions:
        tracing.event(root, "preempted", ns(at))
    tracing.end(root, error="aborted" if finish_reason is None else None, end_ns=ns(finished))
