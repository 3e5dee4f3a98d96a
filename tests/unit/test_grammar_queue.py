"""The grammar worker's queue is bounded, in all and per API key: a call that finds it full is refused
at once (WorkerBusy -> the gateway's 429 with Retry-After), never queued silently. A real worker
process runs `time.sleep` as the slow grammar."""

import asyncio
import time

import pytest

from raylane.bounded_worker import BoundedWorker, WorkerBusy, WorkerStarved

SLOW_S = 2.0  # each queued call holds the worker this long: the refusals below come microseconds in


async def started(coro) -> asyncio.Task:
    task = asyncio.ensure_future(coro)
    await asyncio.sleep(0)  # it has taken its place in the queue
    return task


def test_one_key_cannot_fill_the_grammar_queue_and_a_full_queue_refuses_at_once():
    async def main() -> None:
        worker = BoundedWorker(timeout_s=60, preload=("time",), max_pending=3, max_pending_per_key=2)
        try:
            flood = [await started(worker.run(time.sleep, SLOW_S, key="A")) for _ in range(2)]
            with pytest.raises(WorkerBusy) as excinfo:  # A's share is full; the queue is not
                await worker.run(time.sleep, 0, key="A")
            assert "for this API key" in str(excinfo.value) and excinfo.value.retry_after > 0
            victim = await started(worker.run(time.sleep, 0, key="B"))  # another key still gets in
            with pytest.raises(WorkerBusy) as excinfo:  # now the whole queue is full
                await worker.run(time.sleep, 0, key="C")
            assert "in all" in str(excinfo.value)
            await asyncio.gather(*flood, victim)
            assert worker.pending == {}
            await worker.run(time.sleep, 0, key="A")  # places come back when calls finish
        finally:
            worker.close()

    asyncio.run(main())


def test_a_caller_that_went_away_holds_its_place_until_the_worker_is_done_with_it():
    """Otherwise a client could send a costly grammar, disconnect and send another, without bound:
    the worker runs each call it was sent to the end."""

    async def main() -> None:
        worker = BoundedWorker(timeout_s=60, preload=("time",), max_pending=4, max_pending_per_key=1)
        try:
            first = await started(worker.run(time.sleep, SLOW_S, key="A"))
            first.cancel()
            with pytest.raises(asyncio.CancelledError):
                await first
            with pytest.raises(WorkerBusy):
                await worker.run(time.sleep, 0, key="A")
            deadline = time.monotonic() + 120
            while worker.pending and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await worker.run(time.sleep, 0, key="A")
        finally:
            worker.close()

    asyncio.run(main())


@pytest.mark.parametrize(
    "busy, code",
    [
        (
            WorkerBusy("64 grammar checks are already queued in all, the most allowed", retry_after=7.5),
            "grammar_queue_full",
        ),
        (
            WorkerStarved("the server is too busy: the call had 0.1 s of CPU time in 20 s", retry_after=7.5),
            "server_busy",
        ),
    ],
)
def test_a_pools_full_or_starved_compile_queue_is_the_clients_429_with_retry_after(busy, code):
    """A pool whose compile queue is full, or whose machine starved the compile, answers a 429 (no
    fallback, no breaker count: the pool is not broken) that keeps its Retry-After across the Serve
    handle (pickled) into the gateway's response."""
    import pickle
    from types import SimpleNamespace

    from raylane.deployments.gateway.dispatch import error_response
    from raylane.deployments.pool.serving import OpenAIServing
    from raylane.deployments.protocol.errors import OpenAIError

    class FullQueue:
        async def prepare(self, structured, tenant: str = "") -> None:
            raise busy

    serving = OpenAIServing(SimpleNamespace(tokenizer=None), "m", 128, grammar=FullQueue())
    params = SimpleNamespace(structured=object())
    with pytest.raises(OpenAIError) as excinfo:
        asyncio.run(serving._compile(params, "response_format"))
    error = pickle.loads(pickle.dumps(excinfo.value))
    assert error.status == 429 and error.is_client_error
    assert error.to_dict()["error"]["code"] == code
    assert error.to_dict()["error"]["param"] == "response_format"
    response = error_response(error, {"x-raylane-pool": "chat"})
    assert response.status_code == 429 and response.headers["retry-after"] == "8"
    assert response.headers["x-raylane-pool"] == "chat"


BOUND_S = 1.0  # the sleeps below have a second of margin on either side of the wall-clock bound


def burn(seconds: float) -> None:
    """CPU work for `seconds` of the process's own CPU time."""
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_the_bound_is_the_workers_cpu_time_and_it_runs_below_serving(monkeypatch):
    """A grammar is judged by the CPU it takes, not by how loaded the machine is: a call that waits
    (here it sleeps, as a worker starved of CPU at a peak would) past its bound in wall-clock time
    still gets its answer, within `WALL_FACTOR` x the bound, and past that a `WorkerStarved` (the
    client's 429 with Retry-After, not a 400 blaming its grammar); one that computes past its bound
    is killed with `WorkerTimeout`. And the worker runs SCHED_IDLE, below every serving process."""
    import gc
    import os

    from raylane import bounded_worker
    from raylane.bounded_worker import WALL_FACTOR, WorkerTimeout

    async def main() -> None:
        worker = BoundedWorker(timeout_s=BOUND_S, preload=("time",))
        try:
            assert await worker.run(os.sched_getscheduler, 0) == os.SCHED_IDLE
            # What it shares with its forkserver stays shared: no full collection copies those pages
            # (one large embeddings call added ~70 MB to a worker that collected them).
            assert await worker.run(gc.get_freeze_count) > 0
            await worker.run(time.sleep, 2 * BOUND_S)  # wall-clock time, no CPU: within the bound
            assert worker.restarts == 0
            with pytest.raises(WorkerStarved) as starved:
                await worker.run(time.sleep, WALL_FACTOR * BOUND_S + 1)  # past the wall-clock bound
            assert "too busy" in str(starved.value) and starved.value.retry_after > 0
            # A worker below serving gets only what the cores leave: however busy the machine
            # running this test, 30 s of wall-clock time hold its 1 s of CPU.
            monkeypatch.setattr(bounded_worker, "WALL_FACTOR", 30)
            with pytest.raises(WorkerTimeout):
                await worker.run(burn, 30.0)
            assert worker.restarts == 2
            assert await worker.run(os.getpid) > 0  # a fresh worker serves the next call
        finally:
            worker.close()

    asyncio.run(main())
