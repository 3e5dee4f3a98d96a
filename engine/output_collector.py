"""One request's outputs on their way from the engine core to its `generate` task.

vLLM V1's `RequestOutputCollector`. The core produces an output per step; the consumer (a replica
shipping the last chunk on, a slow client) may fall behind. Outputs that arrive before the
consumer takes the next one are merged into one (`RequestOutput.merged`), so a stream never lags
the engine. With a stream interval N > 1 (vLLM's `--stream-interval`, DELTA outputs only) every
output after the first waits until it carries at least N tokens, or the request finished. With a
batching interval T (Ray Serve LLM's `stream_batching_interval_ms`) every output after the first
also waits until T has passed since the last one went out: a fast engine's tokens then cross the
replica -> gateway -> proxy hops as one chunk per T per stream, whatever the step rate, which bounds
the serving CPU a stream costs (the cost of those hops is per chunk, not per token).
"""

import asyncio

from raylane.engine.outputs import RequestOutput


class RequestOutputCollector:
    """`put` on the consumer's event loop (the core's thread hands over with `call_soon_threadsafe`),
    `get` from the request's `generate` task."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        delta: bool,
        stream_interval: int = 1,
        batching_interval_s: float = 0.0,
    ):
        self.loop = loop  # the event loop `get` runs on, where `put` must be called
        self.delta = delta
        self.stream_interval = stream_interval if delta else 1
        self.batching_interval_s = batching_interval_s
        self._output: RequestOutput | None = None  # everything not yet taken, merged
        self._error: BaseException | None = None
        self._sent_at: float | None = None  # the loop's time the last output went out
        self._timer: asyncio.TimerHandle | None = None  # wakes `get` when the interval is over
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        """An output, or the failure that ends the stream (raised once the outputs before it are out)."""
        if isinstance(item, BaseException):
            self._error = self._error or item
        elif self._output is None:
            self._output = item
        else:
            self._output = self._output.merged(item, self.delta)
        self._ready.set()

    async def get(self) -> RequestOutput:
        """The next output to send; raises the failure once nothing is left before it."""
        while not self._due():
            self._ready.clear()
            await self._ready.wait()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        output, self._output = self._output, None
        if output is None:
            raise self._error
        self._sent_at = self.loop.time()
        return output

    def _due(self) -> bool:
        output = self._output
        if self._error is not None:
            return True
        if output is None:
            return False
        if output.finished or self._sent_at is None:
            return True
        if _new_tokens(output) < self.stream_interval:
            return False
        due_at = self._sent_at + self.batching_interval_s
        if self.loop.time() >= due_at:
            return True
        if self._timer is None:
            self._timer = self.loop.call_at(due_at, self._wake)
        return False

    def _wake(self) -> None:
        # The loop may run a timer up to its clock resolution early: `_due` then sets another.
        self._timer = None
        self._ready.set()


def _new_tokens(output: RequestOutput) -> int:
    return max((len(c.token_ids) for c in output.outputs), default=0)
