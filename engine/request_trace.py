"""A traced request's timeline in the engine, sent as spans once the request ends.

The engine loop must not pay for spans per step or per token: while a request runs, the loop only
writes a few monotonic timestamps and counts on its `RequestTrace` (a request without one, every
request while tracing is off, costs nothing: `LLMEngine` skips the bookkeeping when no traced
request is in the engine). When the request finishes, `emit_spans` turns the timeline into spans with
explicit start and end times, children of the pool's span (the W3C carrier that came with
`AddRequest`), from whichever process runs the engine core:

    engine.request            arrival in the engine -> finished (tokens, finish reason, cache hits)
      engine.queue            arrival -> first scheduled
      engine.prefill          one per chunk of prompt (or recompute after a preemption) computed
      engine.decode           first token -> finished: output tokens, speculative acceptance
    events on engine.request: first_token, preempted (each time)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from raylane import tracing

if TYPE_CHECKING:
    from raylane.engine.request import Request


@dataclass(slots=True)
class RequestTrace:
    carrier: dict[str, str]  # the pool span's W3C context: the parent of this request's spans
    first_scheduled: float | None = None  # monotonic, as every time here
    prefill_chunks: list[tuple[float, float, int]] = field(default_factory=list)  # (start, end, tokens)
    preemptions: list[float] = field(default_factory=list)
    draft_tokens: int = 0  # speculative decoding: drafts verified, and of them accepted
    accepted_tokens: int = 0

    def step(self, started: float, ended: float, num_new: int, prefill: bool) -> None:
        """The request had `num_new` tokens computed in a step from `started` to `ended`: a chunk of
        its prompt (or of a recompute) when `prefill`, else a decode."""
        if self.first_scheduled is None:
            self.first_scheduled = started
        if prefill:
            self.prefill_chunks.append((started, ended, num_new))

    def verified(self, drafts: int, accepted: int) -> None:
        self.draft_tokens += drafts
        self.accepted_tokens += accepted


def is_prefill(request: Request) -> bool:
    """Whether the request's next computed tokens are prompt (or recompute), not its newest token."""
    return request.num_output_tokens == 0 or request.num_computed_tokens < request.num_tokens - 1


def emit_spans(request: Request, finish_reason: str | None, finished: float | None = None) -> None:
    """The request's spans, now that it has ended (see the module's docstring)."""
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
