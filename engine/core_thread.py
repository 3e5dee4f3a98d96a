"""The engine core on a daemon thread of the serving process (`engine_core: thread`).

The counterpart of `engine/core_proc.py` for ranks that are Ray actors already (and for a
placement group handed in) and for the simulated engine: the `EngineLoop` steps the engine here, and
torch releases the GIL inside its kernels (the simulated engine's steps sleep). Commands go in on a
queue; events go to `on_events` on the engine thread.
"""

import queue
import threading
from collections.abc import Callable

from raylane.config import EngineConfig
from raylane.engine.backends import make_engine
from raylane.engine.core_messages import Command, Event, Shutdown
from raylane.engine.engine_loop import EngineLoop, queue_receiver


class EngineCoreThread:
    def __init__(self, config: EngineConfig, placement_group, on_events: Callable[[list[Event]], None]):
        self.engine = make_engine(config, placement_group)
        self.engine.warm_up()  # a first step's one-time costs, before any client's request
        self.max_model_len = self.engine.max_model_len
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        loop = EngineLoop(self.engine, queue_receiver(self._commands), on_events)
        self._thread = threading.Thread(target=loop.run, name="raylane-engine", daemon=True)
        self._thread.start()

    def wait_ready(self) -> None:
        """Ready once constructed: the engine loaded on this thread."""

    def submit(self, command: Command) -> None:
        self._commands.put(command)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def shutdown(self) -> None:
        self._commands.put(Shutdown())
        # The finalizer of a dropped AsyncLLM can run on this very thread (in an event callback):
        # the loop then sees `Shutdown` as soon as that callback returns.
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)
        self.engine.shutdown()
