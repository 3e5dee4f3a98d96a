"""The engine core in a process of its own (`engine_core: process`), as vLLM V1 runs it.

In a serving process the event loop spends CPU on every streamed chunk (the replica's RPC, the
SSE framing). On an engine thread of the same process that work takes turns with the engine's
Python for the GIL, so streaming slows the steps themselves. Here the `EngineLoop` runs in a child
process (started by `engine/core_launch.py`, so no thread state is forked) and talks to `AsyncLLM`
over a pipe: pickled commands in, one pickled list of events per engine pass out
(`engine/core_messages.py`), never a round trip per step.

The child ignores SIGINT (the serving process decides when to stop: `raylane serve` drains first)
and exits when the pipe closes, so it never outlives the process that started it. The model runs
in the child, so this mode is for the in-process executor only; tensor-parallel ranks are already
processes of their own.
"""

import contextlib
import dataclasses
import logging
import pickle
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection

from raylane import tracing
from raylane.config import EngineConfig
from raylane.engine.core_launch import CoreFailed, CoreLaunch, CoreReady, StartCore, launch_core
from raylane.engine.core_messages import Command, EngineDied, Event, RunResult, Shutdown
from raylane.engine.engine_loop import EngineLoop
from raylane.engine.errors import EngineDeadError

logger = logging.getLogger(__name__)


def _dumps(obj) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _sendable(message):
    """`message` if it pickles; else the same message with its exceptions (or its result) made plain
    text, so the serving side still hears that the call ended, and how."""
    try:
        _dumps(message)
        return message
    except Exception as e:
        if isinstance(message, RunResult) and message.error is None:
            return RunResult(
                message.token, None, RuntimeError(f"run_in_engine: the result does not pickle: {e}")
            )
        plain = {
            f.name: RuntimeError(f"{type(value).__name__}: {value}")
            for f in dataclasses.fields(message)
            if isinstance(value := getattr(message, f.name), BaseException)
        }
        return dataclasses.replace(message, **plain)


def run_engine_core(conn: Connection) -> None:
    """The child's main: load the engine, report ready, then run the loop until `Shutdown` or EOF."""
    import torch

    from raylane.engine.llm_engine import LLMEngine

    try:
        start: StartCore = pickle.loads(conn.recv_bytes())
    except EOFError:  # the serving side gave up before it needed this core
        return
    if start.torch_threads is not None:
        torch.set_num_threads(start.torch_threads)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s engine-core: %(message)s")
    if start.tracing is not None:
        tracing.configure(start.tracing, start.tracing_instance)
    try:
        engine = LLMEngine(start.config)
        logging.info("warmed up in %.2fs", engine.warm_up())
    except BaseException as e:  # noqa: BLE001 - the serving process re-raises it
        conn.send_bytes(_dumps(_sendable(CoreFailed(e))))
        return

    def emit(events: list[Event]) -> None:
        try:
            payload = _dumps(events)
        except Exception:
            payload = _dumps([_sendable(e) for e in events])
        conn.send_bytes(payload)

    def receive(block: bool) -> list[Command]:
        # The loop polls the socket itself between steps: no reader thread to take turns with for the GIL.
        commands = []
        try:
            while conn.poll(None if block and not commands else 0):
                commands.append(pickle.loads(conn.recv_bytes()))
        except (EOFError, OSError):
            commands.append(Shutdown())  # the serving process is gone: nobody will read another output
        return commands

    conn.send_bytes(_dumps(CoreReady(engine.max_model_len)))
    EngineLoop(engine, receive, emit).run()
    engine.shutdown()
    tracing.shutdown()  # the spans of requests that ended last, before the process exits


class EngineCoreProc:
    """The serving side of an engine core process: `submit` commands, events go to `on_events`
    from a reader thread. If the child dies, `on_events` gets a last `EngineDied`."""

    def __init__(
        self, config: EngineConfig, on_events: Callable[[list[Event]], None], launch: CoreLaunch | None = None
    ):
        """Starts the child with `config` (or takes `launch`, the child a caller started already with
        it); it loads the model while this process goes on (the caller loads its tokenizer meanwhile);
        `wait_ready` waits for it."""
        if launch is None:
            import torch

            launch = launch_core(config, torch.get_num_threads())
        self.process, self._conn = launch.process, launch.conn
        self._on_events = on_events
        self._send_lock = threading.Lock()
        self._closing = False
        self.max_model_len: int | None = None

    def wait_ready(self) -> None:
        """Until the child has loaded the model (its `max_model_len` is set then); its load error,
        or EngineDeadError if it died."""
        try:
            started = pickle.loads(self._conn.recv_bytes())
        except (EOFError, OSError):
            raise EngineDeadError(
                f"engine core process exited while loading (exit code {self.process.wait(5)})"
            ) from None
        if isinstance(started, CoreFailed):
            self.process.wait(5)
            raise started.error
        self.max_model_len = started.max_model_len
        self._reader = threading.Thread(
            target=self._read, args=(self._on_events,), name="raylane-engine-events", daemon=True
        )
        self._reader.start()

    def submit(self, command: Command) -> None:
        payload = _dumps(command)  # a command that does not pickle fails here, in its caller
        try:
            with self._send_lock:
                self._conn.send_bytes(payload)
        except OSError as e:
            raise EngineDeadError(f"engine core process is gone: {e}") from None

    def is_alive(self) -> bool:
        return self.process.poll() is None

    def _read(self, on_events: Callable[[list[Event]], None]) -> None:
        while True:
            try:
                events = pickle.loads(self._conn.recv_bytes())
            except (EOFError, OSError):
                if not self._closing:
                    try:
                        code = self.process.wait(1)
                    except subprocess.TimeoutExpired:
                        code = None
                    on_events([EngineDied(f"engine core process exited (exit code {code})")])
                return
            on_events(events)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._closing = True
        grace = timeout if self.max_model_len is not None else 0  # still loading: no work to finish
        with contextlib.suppress(EngineDeadError):
            self.submit(Shutdown())
        try:
            self.process.wait(grace)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout)
        self._conn.close()


if __name__ == "__main__":
    run_engine_core(Connection(int(sys.argv[1])))
