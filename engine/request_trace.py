"""A traced request's timeline in the engine (`Request.trace`), sent as spans once it ends
(engine/request_spans.py).

The engine loop must not pay for spans per step or per token: while a request runs, the loop only
writes a few monotonic timestamps and counts on its `RequestTrace` (a request without one, every
request while tracing is off, costs nothing: `LLMEngine` skips the bookkeeping when no traced
request is in the engine). When the request finishes, `request_spans.emit_spans` turns the
timeline into spans with explicit start and end times, children of the pool's span (the W3C carrier
that came with `AddRequest`), from whichever process runs the engine core:

    engine.request            arrival in the engine -> finished (tokens, finish reason, cache hits)
      engine.queue            arrival -> first scheduled
      engine.prefill          one per chunk of prompt (or recompute after a preemption) computed
      engine.decode           first token -> finished: output tokens, speculative acceptance
    events on engine.request: first_token, preempted (each time)
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
