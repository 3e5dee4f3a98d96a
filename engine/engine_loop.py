"""The loop that steps an `LLMEngine`: commands in, events out.

`AsyncLLM` runs it on a thread of the serving process, or in a process of its own
(`engine/core_proc.py`); either way it is the only code that touches the engine. Commands are
tuples whose second item is a token the caller matches events to:

    ("add", token, request_id, prompt, params, priority)  -> ("added", token, error | None)
    ("abort", token, request_id)                          -> ("aborted", token, request_id, output | None)
    ("call", token, fn)                                   -> ("result", token, fn(engine), error | None)
    ("stop",)

and every step's outputs come as ("output", RequestOutput). If the engine fails, the last event
is ("dead", message): nothing runs after it.

`receive(block)` returns the commands that arrived (waiting for at least one when `block`: the
engine has nothing to do); `emit(events)` gets the events of one pass, in order.
"""

import logging
import queue
from collections.abc import Callable

from engine.executor import EngineDeadError
from engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

Event = tuple


def queue_receiver(commands: queue.SimpleQueue) -> Callable[[bool], list[tuple]]:
    """`receive` for a loop on a thread: commands put on `commands` by the serving side."""

    def receive(block: bool) -> list[tuple]:
        received = [commands.get()] if block else []
        while not commands.empty():
            received.append(commands.get_nowait())
        return received

    return receive


class EngineLoop:
    def __init__(
        self,
        engine: LLMEngine,
        receive: Callable[[bool], list[tuple]],
        emit: Callable[[list[Event]], None],
    ):
        self.engine = engine
        self._receive = receive
        self._emit = emit
        self._stopped = False

    def run(self) -> None:
        engine = self.engine
        try:
            while not self._stopped:
                events = self._handle_commands(self._receive(not engine.has_unfinished_requests()))
                if engine.has_unfinished_requests() and not self._stopped:
                    events.extend(("output", out) for out in engine.step())
                if events:
                    self._emit(events)
        except BaseException as e:  # noqa: BLE001 - every waiting request must hear about it
            logger.exception("engine loop failed")
            self._emit([("dead", str(e) if isinstance(e, EngineDeadError) else f"engine failed: {e!r}")])

    def _handle_commands(self, commands: list[tuple]) -> list[Event]:
        events: list[Event] = []
        for kind, *args in commands:
            if kind == "stop":
                self._stopped = True
            else:
                events.append(getattr(self, f"_do_{kind}")(*args))
        return events

    def _do_add(self, token: int, request_id: str, prompt, params, priority: int) -> Event:
        try:
            self.engine.add_request(prompt, params, request_id=request_id, priority=priority)
        except Exception as e:  # a bad prompt or parameter: the caller's ValueError
            return ("added", token, e)
        return ("added", token, None)

    def _do_abort(self, token: int, request_id: str) -> Event:
        return ("aborted", token, request_id, self.engine.abort_request(request_id))

    def _do_call(self, token: int, fn) -> Event:
        try:
            return ("result", token, fn(self.engine), None)
        except Exception as e:
            return ("result", token, None, e)
