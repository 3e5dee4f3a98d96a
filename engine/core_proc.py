"""The engine core in a process of its own (`engine_core: process`), as vLLM V1 runs it.

In a serving process the event loop spends CPU on every streamed chunk (the replica's RPC, the
SSE framing). On an engine thread of the same process that work takes turns with the engine's
Python for the GIL, so streaming slows the steps themselves. Here the `EngineLoop` runs in a child
process (spawned, so no thread state is forked) and talks to `AsyncLLM` over a pipe: pickled
command tuples in, one pickled list of events per engine pass out, never a round trip per step.
The child is `python -m engine.core_proc FD` with one end of a socket pair, not a multiprocessing
spawn, which would re-run the caller's `__main__` script in the child.

The child ignores SIGINT (the serving process decides when to stop: `raylane serve` drains first)
and exits when the pipe closes, so it never outlives the process that started it. The model runs
in the child, so this mode is for the in-process executor only; tensor-parallel ranks are already
processes of their own.
"""

import contextlib
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection

from cluster.config import EngineConfig
from engine.engine_loop import EngineLoop, Event
from engine.executor import EngineDeadError

logger = logging.getLogger(__name__)


def _dumps(obj) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _sendable(event: Event) -> Event:
    """`event` if it pickles; else the same event with its exception or result made plain text."""
    try:
        _dumps(event)
        return event
    except Exception as e:
        if event[0] == "result":
            return ("result", event[1], None, RuntimeError(f"run_in_engine: the result does not pickle: {e}"))
        return tuple(
            RuntimeError(f"{type(x).__name__}: {x}") if isinstance(x, BaseException) else x for x in event
        )


def run_engine_core(conn: Connection) -> None:
    """The child's main: load the engine, report ready, then run the loop until "stop" or EOF."""
    import torch

    from engine.llm_engine import LLMEngine

    config, torch_threads = pickle.loads(conn.recv_bytes())
    torch.set_num_threads(torch_threads)  # as many as the serving process has (an engine thread's count)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s engine-core: %(message)s")
    try:
        engine = LLMEngine(config)
    except BaseException as e:  # noqa: BLE001 - the serving process re-raises it
        conn.send_bytes(_dumps(("failed", _sendable(("failed", e))[1])))
        return

    def emit(events: list[Event]) -> None:
        try:
            payload = _dumps(events)
        except Exception:
            payload = _dumps([_sendable(e) for e in events])
        conn.send_bytes(payload)

    def receive(block: bool) -> list[tuple]:
        # The loop polls the socket itself between steps: no reader thread to take turns with for the GIL.
        commands = []
        try:
            while conn.poll(None if block and not commands else 0):
                commands.append(pickle.loads(conn.recv_bytes()))
        except (EOFError, OSError):
            commands.append(("stop",))  # the serving process is gone: nobody will read another output
        return commands

    conn.send_bytes(_dumps(("ready", {"max_model_len": engine.max_model_len})))
    EngineLoop(engine, receive, emit).run()
    engine.shutdown()


class EngineCoreProc:
    """The serving side of an engine core process: `submit` commands, events go to `on_events`
    from a reader thread. If the child dies, `on_events` gets a last ("dead", ...) event."""

    def __init__(self, config: EngineConfig, on_events: Callable[[list[Event]], None]):
        import torch

        mine, theirs = socket.socketpair()
        env = os.environ | {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # import what we import
        fd = theirs.fileno()
        command = [sys.executable, "-m", "engine.core_proc", str(fd)]
        self.process = subprocess.Popen(command, pass_fds=[fd], env=env)
        theirs.close()
        self._conn = Connection(mine.detach())
        self._conn.send_bytes(_dumps((config, torch.get_num_threads())))
        try:
            kind, info = pickle.loads(self._conn.recv_bytes())  # blocks while the child loads the model
        except (EOFError, OSError):
            raise EngineDeadError(
                f"engine core process exited while loading (exit code {self.process.wait(5)})"
            ) from None
        if kind == "failed":
            self.process.wait(5)
            raise info
        self.max_model_len: int = info["max_model_len"]
        self._send_lock = threading.Lock()
        self._closing = False
        self._reader = threading.Thread(
            target=self._read, args=(on_events,), name="raylane-engine-events", daemon=True
        )
        self._reader.start()

    def submit(self, command: tuple) -> None:
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
                    on_events([("dead", f"engine core process exited (exit code {code})")])
                return
            on_events(events)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._closing = True
        with contextlib.suppress(EngineDeadError):
            self.submit(("stop",))
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout)
        self._conn.close()


if __name__ == "__main__":
    run_engine_core(Connection(int(sys.argv[1])))
