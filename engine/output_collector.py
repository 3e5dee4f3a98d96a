"""One request's outputs on their way from the engine core to its `generate` task.

vLLM V1's `RequestOutputCollector`. The core produces an output per step; the consumer (a replica
shipping the last chunk on, a slow client) may fall behind. Outputs that arrive before the
consumer takes the next one are merged into one (`RequestOutput.merged`), so a stream never lags
the engine. With a stream interval N > 1 (vLLM's `--stream-interval`, DELTA outputs only) every
output after the first waits until it carries at least N tokens, or the request finished.
"""

import asyncio

from raylane.engine.outputs import RequestOutput


class RequestOutputCollector:
    """`put` on the consumer's event loop (the core's thread hands over with `call_soon_threadsafe`),
    `get` from the request's `generate` task."""

    def __init__(self, loop: asyncio.AbstractEventLoop, delta: bool, stream_interval: int = 1):
        self.loop = loop  # the event loop `get` runs on, where `put` must be called
        self.delta = delta
        self.stream_interval = stream_interval if delta else 1
        self._output: RequestOutput | None = None  # everything not yet taken, merged
        self._error: BaseException | None = None
        self._sent = False
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
        output, self._output = self._output, None
        if output is None:
            raise self._error
        self._sent = True
        return output

    def _due(self) -> bool:
        output = self._output
        if self._error is not None:
            return True
        if output is None:
            return False
        return output.finished or not self._sent or _new_tokens(output) >= self.stream_interval


def _new_tokens(output: RequestOutput) -> int:
    return max((len(c.token_ids) for c in output.outputs), default=0)
