"""Relaying a pool's SSE stream to the client, after its first item decided the response.

A client that stops reading must not hold its pool slot (and the engine's sequence) for as long as
it likes: `BoundedStreamingResponse` gives each write to the client `gateway.stream_write_timeout_s`;
a write still blocked then ends the response, which closes the relay: the pool call is cancelled
(the engine aborts the request) and the slot released. Where the ASGI server applies backpressure
(uvicorn: `send` waits while the socket's buffers are full) this is what bounds a slow reader. Under
Ray Serve the replica's `send` only appends to a queue that the proxy drains, so it never blocks:
there a slow reader's slot is freed when generation ends (bounded by max_tokens), and the events it
has not read wait in the proxy.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Message, Send

from raylane import tracing
from raylane.deployments.gateway.pool_failures import pool_failure
from raylane.deployments.gateway.request_record import note_summary
from raylane.deployments.gateway.resumption import Resumer
from raylane.deployments.gateway.spans import end_pool_call, summary_attributes
from raylane.deployments.protocol.errors import OpenAIError
from raylane.deployments.protocol.wire import (
    EngineDeadError,
    FinalItem,
    PoolItem,
    RequestSummary,
    StreamItem,
    is_error_event,
    sse_error,
)
from raylane.router import Slot

logger = logging.getLogger(__name__)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def relay(
    first: PoolItem,
    call,
    slot: Slot | None = None,
    on_done: Callable[[int], None] | None = None,
    resumer: Resumer | None = None,
    pool: str | None = None,
    call_span: Any = None,
) -> AsyncIterator[str]:
    """Relay a pool's SSE events. The response ends with the pool's `FinalItem` (the rest of the
    pool's stream is read in the background). A failure of the pool's health mid-stream (the replica
    died, its engine died) resumes the stream elsewhere (`resumer`, deployments/gateway/resumption.py): the
    client sees one unbroken stream. Any other failure, or one past the resumption limit, becomes an
    error event (the SDK raises it). The pool's slot is released when the stream ends, as failed if an
    error event ended it; `on_done(tokens)` then counts usage: the pool's summary when it came (an
    event may carry several tokens; a resumed stream adds the tokens sent before), else the events.
    `call_span`: the gateway's span of the pool call (deployments/gateway/spans.py), ended with the
    call; the relay's own `gateway.stream` span holds any resumption."""
    finished, failed, events, tokens = False, False, 0, None
    pool = pool or getattr(slot, "pool", None)
    item: PoolItem | None = first
    stream_span = tracing.start("gateway.stream") if call_span is not None else None
    if resumer is not None:
        resumer.trace_parent = stream_span
    try:
        while True:
            failure: object = None  # what ended this pool call early, if anything did
            try:
                while item is not None:
                    if isinstance(item, FinalItem):
                        if item.engine_failed and resumer is not None and resumer.state is not None:
                            failure = EngineDeadError(item.item)
                            break
                        tokens = _note(item.summary, resumer)
                        summary_attributes(call_span, item.summary)
                        failed = failed or is_error_event(item.item)  # the engine's failure ended it
                        events += 1
                        yield item.item
                        drain_later(call)
                        break
                    if isinstance(item, StreamItem):
                        if resumer is not None:
                            resumer.track(item)
                        text = item.text
                    elif isinstance(item, str):
                        text = item
                    else:  # an error item mid-stream
                        failure = item
                        break
                    failed = failed or is_error_event(text)
                    events += 1
                    yield text
                    item = await anext(call, None)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                failure = e
            if failure is None:
                break
            call.cancel()
            logger.warning("pool %s failed mid-stream: %r", pool, failure)
            error = failure if isinstance(failure, OpenAIError) else pool_failure(failure)
            end_pool_call(call_span, error, "died")
            call_span = None
            resumed = await resumer.resume(pool, failure) if resumer is not None and pool else None
            if resumed is None:
                failed = True
                yield sse_error(error)
                break
            item, call = resumed
            call_span = getattr(resumer, "call_span", None)  # (a test's stand-in may have none)
        finished = True
    finally:
        end_pool_call(call_span)
        tracing.end(stream_span, error="stream failed" if failed else None, **{"raylane.events": events})
        if not finished:  # the client went away: stop generating
            call.cancel()
        if slot is not None:  # only the breaker learns of a failure the stream could not survive
            slot.failed() if failed else slot.succeeded()
        if on_done is not None:
            on_done(events if tokens is None else tokens)


def _note(summary: RequestSummary | None, resumer: Resumer | None) -> int | None:
    """Add the pool's summary to the request log; the request's tokens, if it came. A resumed stream's
    last pool counted only what it generated: the tokens sent before are added."""
    if summary is None:
        return None
    if resumer is not None and resumer.tokens_before:
        summary.completion_tokens += resumer.tokens_before
        # Its cache hits may cover the output it was resumed after: only the prompt's count.
        summary.cached_tokens = min(summary.cached_tokens, summary.prompt_tokens)
    note_summary(summary)
    return summary.prompt_tokens + summary.completion_tokens


class _SlowReader(Exception):
    pass


class BoundedStreamingResponse(StreamingResponse):
    """A `StreamingResponse` whose writes to the client each get `write_timeout_s`: a client that
    stops reading is cut off and its stream (the relay, the pool call, the slot) closed."""

    def __init__(self, content, *, write_timeout_s: float, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self.write_timeout_s = write_timeout_s

    async def stream_response(self, send: Send) -> None:
        async def bounded(message: Message) -> None:
            try:
                await asyncio.wait_for(send(message), self.write_timeout_s)
            except TimeoutError:
                raise _SlowReader from None

        try:
            await super().stream_response(bounded)
        except _SlowReader:
            logger.warning(
                "client stopped reading its stream for %gs: aborted, its pool slot released",
                self.write_timeout_s,
            )
            await self.body_iterator.aclose()  # the relay's clean-up: cancel the call, free the slot


_draining: set[asyncio.Task] = set()


def drain_later(call) -> None:
    """Read what is left of a pool call (its end) in the background, so that Serve sees the call
    finish: an unread stream would count as a request still running on the replica."""

    async def drain() -> None:
        try:
            async for _ in call:
                pass
        except Exception:  # the response is out already; nothing to tell anyone
            pass

    task = asyncio.get_running_loop().create_task(drain())
    _draining.add(task)
    task.add_done_callback(_draining.discard)
