"""What `AsyncLLM` and the engine core say to each other: commands in, events out.

Commands go to the `EngineLoop` (`engine/engine_loop.py`), events come back from it, over a queue
on a thread or pickled across the core process's socket (`engine/core_proc.py`, one list of events
per engine pass). So they are small frozen dataclasses that hold plain data only, never an engine
object. Every command but `Shutdown` carries a `token` that its answer repeats, which is how
`AsyncLLM` hands each answer to the caller awaiting it:

    AddRequest    -> RequestAdded(token, error | None)
    AbortRequest  -> Aborted(token, request_id, last output | None)
    RunInEngine   -> RunResult(token, fn(engine) | None, error | None)
    Shutdown         (no answer: the loop ends)

A pass's outputs come as one `Outputs` (those the loop holds to the batching interval, later). If
the engine fails, the last event is `EngineDied`: nothing runs after it. (A core process's start-up
messages are in `engine/core_launch.py`.)
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from raylane.engine.lora import LoRARequest
from raylane.engine.outputs import RequestOutput
from raylane.engine.request import Resumption
from raylane.engine.sampling_params import SamplingParams

# -- commands ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AddRequest:
    token: int
    request_id: str
    prompt: str | list[int]
    params: SamplingParams | None
    priority: int
    resume: Resumption | None = None
    tenant: str = ""
    lora_request: LoRARequest | None = None
    cache_salt: str = ""
    trace: dict[str, str] | None = None  # the pool span's W3C carrier: the engine's spans continue it


@dataclass(frozen=True, slots=True)
class AbortRequest:
    token: int
    request_id: str


@dataclass(frozen=True, slots=True)
class RunInEngine:
    """Run `fn(engine)` between steps. Across a process it must pickle: a module-level function."""

    token: int
    fn: Callable[[Any], Any]


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass


Command = AddRequest | AbortRequest | RunInEngine | Shutdown

# -- events --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RequestAdded:
    token: int
    error: BaseException | None  # the engine's ValueError for a bad prompt or parameter


@dataclass(frozen=True, slots=True)
class Aborted:
    token: int
    request_id: str
    output: RequestOutput | None  # the request's last output; None when the engine no longer knew it


@dataclass(frozen=True, slots=True)
class RunResult:
    token: int
    result: Any
    error: BaseException | None


@dataclass(frozen=True, slots=True)
class Outputs:
    outputs: list[RequestOutput]  # one step's, one per user request that advanced


@dataclass(frozen=True, slots=True)
class EngineDied:
    message: str


Event = RequestAdded | Aborted | RunResult | Outputs | EngineDied
