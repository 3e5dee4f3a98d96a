"""The loop that steps an `LLMEngine`: commands in, events out (`engine/core_messages.py`).

`AsyncLLM` runs it on a thread of the serving process, or in a process of its own
(`engine/core_proc.py`); either way it is the only code that touches the engine.

`receive(block)` returns the commands that arrived (waiting for at least one when `block`: the
engine has nothing to do); `emit(events)` gets the events of one pass, in order: the answers to
that pass's commands, then the step's `Outputs`.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from typing import TYPE_CHECKING

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
    Shutdown,
)
from raylane.engine.errors import EngineDeadError

if TYPE_CHECKING:  # the serving side of a core process imports this module, never the model
    from raylane.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)


def queue_receiver(commands: queue.SimpleQueue) -> Callable[[bool], list[Command]]:
    """`receive` for a loop on a thread: commands put on `commands` by the serving side."""

    def receive(block: bool) -> list[Command]:
        received = [commands.get()] if block else []
        while not commands.empty():
            received.append(commands.get_nowait())
        return received

    return receive


class EngineLoop:
    def __init__(
        self,
        engine: LLMEngine,
        receive: Callable[[bool], list[Command]],
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
                    outputs = engine.step()
                    if outputs:
                        events.append(Outputs(outputs))
                if events:
                    self._emit(events)
        except BaseException as e:  # noqa: BLE001 - every waiting request must hear about it
            logger.exception("engine loop failed")
            self._emit([EngineDied(str(e) if isinstance(e, EngineDeadError) else f"engine failed: {e!r}")])

    def _handle_commands(self, commands: list[Command]) -> list[Event]:
        events: list[Event] = []
        for command in commands:
            match command:
                case AddRequest():
                    events.append(self._add(command))
                case AbortRequest(token, request_id):
                    events.append(Aborted(token, request_id, self.engine.abort_request(request_id)))
                case RunInEngine(token, fn):
                    events.append(self._run(token, fn))
                case Shutdown():
                    self._stopped = True
                case _:
                    raise TypeError(f"engine loop: unknown command {command!r}")
        return events

    def _add(self, command: AddRequest) -> RequestAdded:
        try:
            self.engine.add_request(
                command.prompt,
                command.params,
                request_id=command.request_id,
                priority=command.priority,
                resume=command.resume,
                tenant=command.tenant,
                lora_request=command.lora_request,
            )
        except Exception as e:  # a bad prompt or parameter: the caller's ValueError
            return RequestAdded(command.token, e)
        return RequestAdded(command.token, None)

    def _run(self, token: int, fn) -> RunResult:
        try:
            return RunResult(token, fn(self.engine), None)
        except Exception as e:
            return RunResult(token, None, e)
