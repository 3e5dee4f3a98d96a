"""Relaying a pool's SSE stream to the client, after its first item decided the response."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from deployments.pool_failures import pool_failure
from deployments.request_log import note_summary
from deployments.wire import FinalItem, RequestSummary, is_error_event, sse_error
from router import Slot

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def relay(
    first: str | FinalItem, call, slot: Slot | None = None, on_done: Callable[[int], None] | None = None
) -> AsyncIterator[str]:
    """Relay a pool's SSE events; a failure mid-stream becomes an error event (the SDK raises it).
    The response ends with the pool's `FinalItem` (the rest of the pool's stream is read in the
    background). The pool's slot is released when the stream ends, as failed if an error event ended
    it; `on_done(tokens)` then counts usage: the pool's summary when it came (an event may carry
    several tokens), else the events relayed."""
    finished, failed, events, tokens = False, False, 0, None
    try:
        chunk = first
        if not isinstance(first, FinalItem):
            yield first
            async for chunk in call:
                if isinstance(chunk, FinalItem):
                    break
                if not isinstance(chunk, str):
                    failed, chunk = True, sse_error(pool_failure(chunk))
                elif is_error_event(chunk):
                    failed = True
                events += 1
                yield chunk
        if isinstance(chunk, FinalItem):
            tokens = _note(chunk.summary)
            failed = failed or is_error_event(chunk.item)  # the engine's failure ended the stream
            events += 1
            yield chunk.item
            drain_later(call)
        finished = True
    except asyncio.CancelledError:
        raise
    except Exception as e:
        finished = failed = True
        yield sse_error(pool_failure(e))
    finally:
        if not finished:  # the client went away: stop generating
            call.cancel()
        if slot is not None:  # after the first token: no retry, only the breaker learns of a failure
            slot.failed() if failed else slot.succeeded()
        if on_done is not None:
            on_done(events if tokens is None else tokens)


def _note(summary: RequestSummary | None) -> int | None:
    """Add the pool's summary to the request log; the request's tokens, if it came."""
    if summary is None:
        return None
    note_summary(summary)
    return summary.prompt_tokens + summary.completion_tokens


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
