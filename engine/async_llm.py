"""The serving engine: an `LLMEngine` stepped by a background thread, driven from asyncio.

The model forward is blocking torch work, so it runs on its own thread (torch releases the
GIL inside kernels) while the event loop keeps accepting requests and streaming outputs.
Commands (add, abort) cross into the thread through a queue; outputs come back to each
request's asyncio queue with `call_soon_threadsafe`. If a step fails (a rank of the worker
group died), every request in flight and every later call ends with `EngineDeadError`, and
`check_health()` raises it, so Serve replaces the replica.
"""

import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.executor import EngineDeadError
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


def _new_tokens(output: RequestOutput) -> int:
    return max((len(c.token_ids) for c in output.outputs), default=0)


class AsyncLLM:
    def __init__(self, config: EngineConfig | None = None, placement_group=None, **engine_args):
        self.engine = LLMEngine(config or EngineConfig(**engine_args), placement_group)
        self._commands: queue.Queue = queue.Queue()
        self._lock = threading.Lock()  # orders commands against the engine dying
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._stopped = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="raylane-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> "AsyncLLM":
        return cls(config)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    async def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Yield outputs as tokens arrive; the last one has `finished=True`. Leaving the loop
        early (a client disconnect, a cancelled task) aborts the request and frees its blocks."""
        if self._error is not None:
            raise EngineDeadError(str(self._error)) from self._error
        request_id = request_id or uuid.uuid4().hex
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        added: asyncio.Future = stream.loop.create_future()
        self._send(("add", request_id, prompt, sampling_params, priority, stream, added))
        await added  # raises the engine's ValueError for a bad prompt or parameter
        delta = sampling_params is not None and sampling_params.output_kind == RequestOutputKind.DELTA
        interval = self.engine.config.stream_interval if delta else 1
        finished, failure, held, sent = False, None, None, False
        try:
            while failure is None:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if held is not None:
                    item, held = held.merged(item, delta), None
                # Outputs that piled up while the consumer was busy (sending the last one on, a slow
                # client) go out as one, as in vLLM: the stream keeps up with the engine.
                while not item.finished and not stream.queue.empty():
                    newer = stream.queue.get_nowait()
                    if isinstance(newer, BaseException):
                        failure = newer
                        break
                    item = item.merged(newer, delta)
                if sent and not item.finished and failure is None and _new_tokens(item) < interval:
                    held = item  # wait for the stream interval's tokens
                    continue
                sent = True
                yield item
                if item.finished:
                    finished = True
                    return
            raise failure
        finally:
            if not finished:
                await asyncio.shield(self.abort(request_id))

    async def abort(self, request_id: str) -> None:
        """Abort a request; returns once its KV blocks are free (at once if the engine is dead)."""
        done: asyncio.Future = asyncio.get_running_loop().create_future()
        try:
            self._send(("abort", request_id, done))
        except EngineDeadError:
            return
        await done

    async def run_in_engine(self, fn):
        """Run `fn(engine)` on the engine thread between steps (for stats and tests)."""
        done: asyncio.Future = asyncio.get_running_loop().create_future()
        self._send(("call", fn, done))
        return await done

    async def check_health(self) -> None:
        """Raise `EngineDeadError` if the engine loop stopped or a rank of its worker group died."""
        if self._error is not None:
            raise EngineDeadError(f"engine failed: {self._error}") from self._error
        if not self._thread.is_alive():
            raise EngineDeadError("engine is shut down")
        await asyncio.to_thread(self.engine.check_health)

    def shutdown(self) -> None:
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout=10)
        self.engine.shutdown()

    # -- engine thread -------------------------------------------------------------------------

    def _send(self, command: tuple) -> None:
        with self._lock:
            if self._error is not None:
                raise EngineDeadError(f"engine failed: {self._error}") from self._error
            self._commands.put(command)
        self._wakeup.set()

    def _run(self) -> None:
        try:
            while not self._stopped:
                if not self.engine.has_unfinished_requests() and self._commands.empty():
                    self._wakeup.wait()
                self._wakeup.clear()
                self._handle_commands()
                if self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        self._deliver(out)
        except BaseException as e:  # noqa: BLE001 - every waiting request must hear about it
            logger.exception("engine loop failed")
            with self._lock:
                self._error = e
            message = str(e) if isinstance(e, EngineDeadError) else f"engine failed: {e!r}"
            for request_id, stream in list(self._streams.items()):
                stream.put(EngineDeadError(message))
                self._streams.pop(request_id, None)
            self._fail_commands(EngineDeadError(message))

    def _fail_commands(self, error: EngineDeadError) -> None:
        """Answer commands sent before the engine died, so none of their callers waits forever."""
        while True:
            try:
                kind, *args = self._commands.get_nowait()
            except queue.Empty:
                return
            done = args[-1]
            result_error = None if kind == "abort" else EngineDeadError(str(error))
            done.get_loop().call_soon_threadsafe(_resolve, done, None, result_error)

    def _handle_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            kind, *args = command
            getattr(self, f"_do_{kind}")(*args)

    def _do_add(self, request_id, prompt, params, priority, stream: _Stream, added) -> None:
        try:
            self.engine.add_request(prompt, params, request_id=request_id, priority=priority)
        except Exception as e:
            stream.loop.call_soon_threadsafe(_resolve, added, None, e)
            return
        self._streams[request_id] = stream
        stream.loop.call_soon_threadsafe(_resolve, added, None, None)

    def _do_abort(self, request_id: str, done: asyncio.Future) -> None:
        out = self.engine.abort_request(request_id)
        stream = self._streams.pop(request_id, None)
        if stream is not None and out is not None:
            stream.put(out)
        done.get_loop().call_soon_threadsafe(_resolve, done, None, None)

    def _do_call(self, fn, done: asyncio.Future) -> None:
        try:
            result, error = fn(self.engine), None
        except Exception as e:
            result, error = None, e
        done.get_loop().call_soon_threadsafe(_resolve, done, result, error)

    def _deliver(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        if out.finished:
            del self._streams[out.request_id]
        stream.put(out)


def _resolve(future: asyncio.Future, result, error) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
