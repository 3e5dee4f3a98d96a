"""The serving engine: `AsyncLLM` drives an engine core from asyncio and streams its outputs.

The core is an `EngineLoop` (`engine/engine_loop.py`) stepping an `LLMEngine`. With
`engine_core: thread` it runs on a background thread of this process (`engine/core_thread.py`;
torch releases the GIL inside kernels); with `engine_core: process` in a child process
(`engine/core_proc.py`), so the serving work of this process never competes with the steps for the
GIL. Either way commands go in and events come back to `_on_events` (`engine/core_messages.py`),
which hands outputs to each request's `RequestOutputCollector` with `call_soon_threadsafe`. If the
core fails (a step raised, a rank or the core process died), every request in flight and every
later call ends with `EngineDeadError`, and `check_health()` raises it, so Serve replaces the
replica.
"""

import asyncio
import contextlib
import itertools
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from raylane.config import EngineConfig
from raylane.engine.core_launch import CoreLaunch
from raylane.engine.core_messages import (
    Aborted,
    AbortRequest,
    AddRequest,
    Command,
    EngineDied,
    Event,
    Outputs,
    RequestAdded,
    RunInEngine,
    RunResult,
)
from raylane.engine.errors import EngineDeadError
from raylane.engine.lora import LoRARequest
from raylane.engine.output_collector import RequestOutputCollector
from raylane.engine.outputs import RequestOutput
from raylane.engine.request import Resumption
from raylane.engine.sampling_params import RequestOutputKind, SamplingParams
from raylane.engine.tokenizer import load_tokenizer

if TYPE_CHECKING:  # the model and its torch/transformers imports load only where the engine runs
    from raylane.engine.llm_engine import LLMEngine


class AsyncLLM:
    def __init__(
        self,
        config: EngineConfig | None = None,
        placement_group=None,
        core_launch: CoreLaunch | None = None,
        **engine_args,
    ):
        """`core_launch`: the engine core process, started already with `config` by the caller
        (`engine/core_launch.py`), for an engine that runs in one."""
        self.config = config or EngineConfig(**engine_args)
        self._lock = threading.Lock()  # orders commands against the core dying
        self._streams: dict[str, RequestOutputCollector] = {}
        self._pending: dict[int, asyncio.Future] = {}
        self._tokens = itertools.count()
        self._error: str | None = None
        self._last_event = time.monotonic()  # when the core last reported anything: its progress
        # The core's thread must not keep this object alive: it gets a weak callback, and dropping the
        # AsyncLLM stops the core (thread or process) and releases its ranks through the finalizer.
        on_events = _weak_callback(self._on_events)
        if placement_group is None and self.config.uses_core_process:
            from raylane.engine.core_proc import EngineCoreProc

            self._core = EngineCoreProc(self.config, on_events, core_launch)
            self.engine: LLMEngine | None = None  # it lives in the core process
        else:
            from raylane.engine.core_thread import EngineCoreThread

            self._core = EngineCoreThread(self.config, placement_group, on_events)
            self.engine = self._core.engine
        self._finalizer = weakref.finalize(self, self._core.shutdown)
        try:
            self.tokenizer = (
                self.engine.tokenizer
                if self.engine is not None
                else load_tokenizer(self.config.tokenizer or self.config.model)
            )
        except BaseException:
            self._finalizer()
            raise
        try:
            self._core.wait_ready()  # a core process loaded the model while the tokenizer loaded here
        except BaseException:
            self._finalizer()
            raise
        self.max_model_len: int = self._core.max_model_len

    @classmethod
    def from_config(cls, config: EngineConfig) -> "AsyncLLM":
        return cls(config)

    async def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        on_abort: Callable[[RequestOutput], None] | None = None,
        resume: Resumption | None = None,
        tenant: str = "",
        lora_request: LoRARequest | None = None,
        cache_salt: str = "",
        trace: dict[str, str] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield outputs as tokens arrive; the last one has `finished=True`. Leaving the loop
        early (a client disconnect, a cancelled task) aborts the request and frees its blocks;
        `on_abort` then gets the engine's last output of it (what `abort` returns), which the
        caller would otherwise never see. `resume`: continue after the output another replica had
        produced (`LLMEngine.add_request`). `tenant`: whose request it is (the scheduler shares each
        priority's slots between tenants). `lora_request`: the adapter to run it with. `cache_salt`:
        the prefix-cache scope it shares cached blocks within. `trace`: the W3C carrier of the
        caller's span; the engine records the request's timeline and emits its spans under it
        (engine/request_trace.py)."""
        request_id = request_id or uuid.uuid4().hex
        delta = sampling_params is not None and sampling_params.output_kind == RequestOutputKind.DELTA
        stream = RequestOutputCollector(
            asyncio.get_running_loop(),
            delta,
            self.config.stream_interval,
            self.config.stream_batching_interval_ms / 1000,
        )
        if not self._streams:  # an idle engine's silence so far is not a stall
            self._last_event = time.monotonic()
        self._streams[request_id] = stream
        try:
            await self._call(
                AddRequest,
                request_id,
                prompt,
                sampling_params,
                priority,
                resume,
                tenant,
                lora_request,
                cache_salt,
                trace,
            )
        except BaseException:  # the engine's ValueError for a bad prompt or parameter, or a dead core
            self._streams.pop(request_id, None)
            raise
        finished = False
        try:
            while not finished:
                output = await stream.get()
                finished = output.finished
                yield output
        finally:
            if not finished:
                last = await asyncio.shield(self.abort(request_id))
                if last is not None and on_abort is not None:
                    on_abort(last)

    async def abort(self, request_id: str) -> RequestOutput | None:
        """Abort a request; returns once its KV blocks are free (at once if the engine is dead), with
        its last output (finish reason "abort"; only what its stream has not had yet for DELTA
        requests), or None when the engine no longer knew the request."""
        try:
            return await self._call(AbortRequest, request_id)
        except EngineDeadError:
            self._streams.pop(request_id, None)
            return None

    async def run_in_engine(self, fn):
        """Run `fn(engine)` on the engine core between steps (for stats and tests). With a core
        process, `fn` and its result cross a pipe: a module-level function and plain data."""
        return await self._call(RunInEngine, fn)

    async def check_health(self) -> None:
        """Raise `EngineDeadError` if the engine loop stopped, a rank of its worker group died, or the
        engine is stuck: requests in flight and no event from the core for `iteration_timeout_s`.
        A busy engine is slow, not stuck: each step it takes reports outputs."""
        if self._error is not None:
            raise EngineDeadError(self._error)
        if not self._core.is_alive():
            raise EngineDeadError("engine is shut down")
        silent_s = time.monotonic() - self._last_event
        if self._streams and silent_s > self.config.iteration_timeout_s:
            raise EngineDeadError(
                f"the engine produced nothing for {silent_s:.0f}s with {len(self._streams)} requests in "
                f"flight (iteration_timeout_s = {self.config.iteration_timeout_s:g})"
            )
        if self.engine is not None:
            await asyncio.to_thread(self.engine.check_health)

    def shutdown(self) -> None:
        """Stop the engine core (thread or process) and release its ranks; idempotent. Requests in
        flight and later calls end with `EngineDeadError`."""
        self._finalizer()
        self._fail("engine is shut down")

    async def __aenter__(self) -> "AsyncLLM":
        return self

    async def __aexit__(self, *exc_info) -> None:
        self.shutdown()

    def __enter__(self) -> "AsyncLLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    # -- commands out, events in ---------------------------------------------------------------

    async def _call(self, command: Callable[..., Command], *args):
        """Send one command (a `core_messages` class, given its fields after the token) and wait for
        the event that answers it."""
        done: asyncio.Future = asyncio.get_running_loop().create_future()
        token = next(self._tokens)
        with self._lock:
            if self._error is not None:
                raise EngineDeadError(self._error)
            self._pending[token] = done
            try:
                self._core.submit(command(token, *args))
            except BaseException:
                del self._pending[token]
                raise
        return await done

    def _on_events(self, events: list[Event]) -> None:
        """Called on the engine thread or the core process's reader thread. A pass's outputs reach each
        event loop in one callback, not one wake-up per request."""
        deliveries: dict[asyncio.AbstractEventLoop, list] = {}
        self._last_event = time.monotonic()
        for event in events:
            match event:
                case Outputs(outputs):
                    for out in outputs:
                        stream = self._streams.get(out.request_id)
                        if stream is not None:
                            if out.finished:
                                self._streams.pop(out.request_id, None)
                            deliveries.setdefault(stream.loop, []).append((stream, out))
                case RequestAdded(token, error):
                    self._resolve(token, None, error)
                case Aborted(token, request_id, out):
                    stream = self._streams.pop(request_id, None)
                    if stream is not None and out is not None:
                        deliveries.setdefault(stream.loop, []).append((stream, out))
                    self._resolve(token, out, None)
                case RunResult(token, result, error):
                    self._resolve(token, result, error)
                case EngineDied(message):
                    _deliver(deliveries)  # what came before the failure first
                    self._fail(message)
        _deliver(deliveries)

    def _resolve(self, token: int, result, error: BaseException | None) -> None:
        done = self._pending.pop(token, None)
        if done is not None:
            _call_soon(done.get_loop(), _set_future, done, result, error)

    def _fail(self, message: str) -> None:
        """The core is dead: every stream and every command waiting for an answer ends."""
        with self._lock:
            self._error = self._error or message  # the first cause, not the core process's exit after it
            streams, self._streams = self._streams, {}
            pending, self._pending = self._pending, {}
        failures: dict[asyncio.AbstractEventLoop, list] = {}
        for stream in streams.values():
            failures.setdefault(stream.loop, []).append((stream, EngineDeadError(message)))
        _deliver(failures)
        for done in pending.values():
            _call_soon(done.get_loop(), _set_future, done, None, EngineDeadError(message))


def _weak_callback(method: Callable[[list[Event]], None]) -> Callable[[list[Event]], None]:
    """`method` (bound) without a strong reference to its object; calls after it is gone do nothing."""
    ref = weakref.WeakMethod(method)

    def call(events: list[Event]) -> None:
        target = ref()
        if target is not None:
            target(events)

    return call


def _deliver(deliveries: dict[asyncio.AbstractEventLoop, list]) -> None:
    for loop, items in deliveries.items():
        _call_soon(loop, _put_all, items)
    deliveries.clear()


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    """`call_soon_threadsafe`, except that a closed loop (its consumer is gone) is not the engine's
    failure: raising here would end the engine loop for everyone."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(fn, *args)


def _put_all(items: list[tuple[RequestOutputCollector, RequestOutput | BaseException]]) -> None:
    for stream, item in items:
        stream.put(item)


def _set_future(future: asyncio.Future, result, error) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
