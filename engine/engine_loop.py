"""The loop that steps an `LLMEngine`: commands in, events out (`engine/core_messages.py`).

`AsyncLLM` runs it on a thread of the serving process, or in a process of its own
(`engine/core_proc.py`); either way it is the only code that touches the engine.

`receive(block)` returns the commands that arrived (waiting for at least one when `block`: the
engine has nothing to do); `emit(events)` gets the events of one pass, in order: the outputs held
from earlier steps (when commands came), the answers to that pass's commands, then the step's
`Outputs` that are due.

A request's outputs between its first and its last are held back until `hold_s` has passed since
its previous one was emitted (the engine's `stream_batching_interval_ms`): its consumer sends at
most one output per interval anyway (`RequestOutputCollector`), and an emitted output costs the
serving side a wake-up of its reader and of its event loop. At one stream those wake-ups came
every step and took CPU from the step's own threads (bench/README.md, "Two threads a side").
"""

from __future__ import annotations

import logging
import queue
import time
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
    from raylane.engine.outputs import RequestOutput

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
        self.hold_s = engine.config.stream_batching_interval_ms / 1000
        self._held: dict[str, list[RequestOutput]] = {}  # request id -> outputs not emitted yet
        self._emitted_at: dict[str, float] = {}  # request id -> when its last output was emitted

    def run(self) -> None:
        engine = self.engine
        try:
            while not self._stopped:
                commands = self._receive(not engine.has_unfinished_requests())
                # What was held goes out before the answers: an aborted request's outputs before its end.
                events: list[Event] = self._flush() if commands else []
                events += self._handle_commands(commands)
                if engine.has_unfinished_requests() and not self._stopped:
                    if outputs := self._due(engine.step()):
                        events.append(Outputs(outputs))
                else:  # about to wait for commands: nothing stays behind
                    events += self._flush()
                    self._emitted_at.clear()
                if events:
                    self._emit(events)
        except BaseException as e:  # noqa: BLE001 - every waiting request must hear about it
            logger.exception("engine loop failed")
            died = EngineDied(str(e) if isinstance(e, EngineDeadError) else f"engine failed: {e!r}")
            self._emit([*self._flush(), died])

    def _due(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """The outputs to emit after a step, each request's in order: a request's first and its last,
        and those of a request whose interval has passed (this step's or held before: a request the
        scheduler left out of this step too); the rest are held."""
        if self.hold_s <= 0:
            return outputs
        for out in outputs:
            self._held.setdefault(out.request_id, []).append(out)
        now = time.monotonic()
        due = []
        for request_id, held in list(self._held.items()):
            emitted_at = self._emitted_at.get(request_id)
            if held[-1].finished or emitted_at is None or now - emitted_at >= self.hold_s:
                due += self._held.pop(request_id)
                if held[-1].finished:
                    self._emitted_at.pop(request_id, None)
                else:
                    self._emitted_at[request_id] = now
        return due

    def _flush(self) -> list[Event]:
        """Every held output, as one `Outputs` event (none if nothing is held)."""
        if not self._held:
            return []
        held = [out for outs in self._held.values() for out in outs]
        self._held.clear()
        return [Outputs(held)]

    def _handle_commands(self, commands: list[Command]) -> list[Event]:
        events: list[Event] = []
        for command in commands:
            match command:
                case AddRequest():
                    events.append(self._add(command))
                case AbortRequest(token, request_id):
                    self._emitted_at.pop(request_id, None)
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
                cache_salt=command.cache_salt,
                trace=command.trace,
            )
        except Exception as e:  # a bad prompt or parameter: the caller's ValueError
            return RequestAdded(command.token, e)
        return RequestAdded(command.token, None)

    def _run(self, token: int, fn) -> RunResult:
        try:
            return RunResult(token, fn(self.engine), None)
        except Exception as e:
            return RunResult(token, None, e)
