"""The serving side of the engine core without a model: what a stream hands its reader, and what
crosses the core process's socket."""

import asyncio
import pickle

import pytest

from raylane.engine import EngineDeadError
from raylane.engine.core_messages import (
    Aborted,
    AddRequest,
    EngineDied,
    Outputs,
    RequestAdded,
    RunResult,
    Shutdown,
)
from raylane.engine.core_proc import _sendable
from raylane.engine.output_collector import RequestOutputCollector
from raylane.engine.outputs import CompletionOutput, RequestOutput


def delta(tokens: list[int], finished: bool = False) -> RequestOutput:
    text = "".join(f"<{t}>" for t in tokens)
    completion = CompletionOutput(0, text, tokens, finish_reason="length" if finished else None)
    return RequestOutput("r", None, [1, 2], [completion], finished)


def collector(interval: int = 1, is_delta: bool = True) -> RequestOutputCollector:
    return RequestOutputCollector(asyncio.get_running_loop(), is_delta, interval)


async def test_outputs_that_pile_up_reach_a_late_reader_as_one():
    stream = collector()
    for tokens in ([1], [2, 3], [4]):
        stream.put(delta(tokens))
    out = await stream.get()
    assert out.outputs[0].token_ids == [1, 2, 3, 4] and out.outputs[0].text == "<1><2,3><4>".replace(
        ",", "><"
    )
    stream.put(delta([5], finished=True))
    last = await stream.get()
    assert last.finished and last.outputs[0].token_ids == [5]


async def test_cumulative_outputs_are_replaced_not_joined():
    stream = collector(is_delta=False)
    stream.put(delta([1]))
    stream.put(delta([1, 2]))
    assert (await stream.get()).outputs[0].token_ids == [1, 2]


async def test_stream_interval_holds_small_deltas_until_enough_tokens_or_the_end():
    stream = collector(interval=3)
    stream.put(delta([1]))
    assert (await stream.get()).outputs[0].token_ids == [1]  # the first token goes out at once
    stream.put(delta([2]))
    stream.put(delta([3]))
    waiting = asyncio.ensure_future(stream.get())
    await asyncio.sleep(0.01)
    assert not waiting.done()  # two tokens: held
    stream.put(delta([4]))
    assert (await waiting).outputs[0].token_ids == [2, 3, 4]
    stream.put(delta([5], finished=True))
    assert (await stream.get()).outputs[0].token_ids == [5]  # the last goes out however small


async def test_a_batching_interval_sends_what_a_fast_engine_made_in_it_as_one_output():
    loop = asyncio.get_running_loop()
    stream = RequestOutputCollector(loop, True, batching_interval_s=0.2)
    before = loop.time()
    stream.put(delta([1]))
    assert (await stream.get()).outputs[0].token_ids == [1]  # the first token goes out at once
    for token in (2, 3, 4):
        stream.put(delta([token]))
        await asyncio.sleep(0)
    assert (await stream.get()).outputs[0].token_ids == [2, 3, 4]
    assert loop.time() >= before + 0.2  # not before the interval since the first went out


async def test_the_last_output_and_a_failure_do_not_wait_for_the_batching_interval():
    stream = RequestOutputCollector(asyncio.get_running_loop(), True, batching_interval_s=60)
    stream.put(delta([1]))
    await stream.get()
    stream.put(delta([2]))
    stream.put(delta([3], finished=True))
    last = await asyncio.wait_for(stream.get(), 10)
    assert last.finished and last.outputs[0].token_ids == [2, 3]
    failing = RequestOutputCollector(asyncio.get_running_loop(), True, batching_interval_s=60)
    failing.put(delta([1]))
    await failing.get()
    failing.put(delta([2]))
    failing.put(EngineDeadError("engine is shut down"))
    assert (await asyncio.wait_for(failing.get(), 10)).outputs[0].token_ids == [2]
    with pytest.raises(EngineDeadError):
        await failing.get()


async def test_a_failure_ends_the_stream_after_the_outputs_made_before_it():
    stream = collector(interval=4)
    stream.put(delta([1]))
    await stream.get()
    stream.put(delta([2]))  # held for the interval
    stream.put(EngineDeadError("engine is shut down"))
    assert (await stream.get()).outputs[0].token_ids == [2]
    with pytest.raises(EngineDeadError, match="shut down"):
        await stream.get()


async def test_a_waiting_reader_wakes_up_for_an_output_put_later():
    stream = collector()
    reader = asyncio.ensure_future(stream.get())
    await asyncio.sleep(0.01)
    stream.put(delta([7], finished=True))
    assert (await reader).finished


def test_messages_pickle_as_they_cross_the_socket():
    messages = [
        AddRequest(3, "r", [1, 2], None, 0),
        Shutdown(),
        RequestAdded(3, ValueError("prompt: must not be empty")),
        Aborted(4, "r", delta([1], finished=True)),
        Outputs([delta([1]), delta([2])]),
        EngineDied("engine failed"),
    ]
    for message in messages:
        again = pickle.loads(pickle.dumps(message))
        assert type(again) is type(message) and repr(again) == repr(message)


class Unpicklable(Exception):
    def __reduce__(self):
        raise TypeError("no pickling")


def test_what_does_not_pickle_still_tells_the_caller_how_the_call_ended():
    result = _sendable(RunResult(5, lambda: None, None))
    assert result.token == 5 and result.result is None and "does not pickle" in str(result.error)
    added = _sendable(RequestAdded(6, Unpicklable("bad grammar")))
    assert added.token == 6 and str(added.error) == "Unpicklable: bad grammar"
    pickle.dumps(added)
