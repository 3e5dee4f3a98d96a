"""Engines give their Ray resources back: `shutdown()`, `with`, and garbage collection.

A tensor-parallel engine holds a placement group and one actor per rank. A user who closes it (or
drops it) and builds another in the same process must get the second one running, not a wait for
resources that never come back: each way of ending an engine must remove its placement group and
end its rank actors, and one test starts a second engine after it. Every check is against the real
Ray of the test session.
"""

import asyncio
import gc
import weakref

import pytest

from raylane.engine import LLM, AsyncLLM, EngineDeadError, SamplingParams

CPUS_PER_RANK = 0.25  # the session cluster is shared with Serve tests: keep every actor fractional
PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PROMPT = [5, 6, 7, 8, 9]
TP2 = dict(num_kv_blocks=64, tensor_parallel_size=2, cpus_per_rank=CPUS_PER_RANK)


def group_state(ray, executor) -> str:
    return ray.util.placement_group_table(executor.placement_group)["state"]


def assert_released(ray, pg, workers) -> None:
    """The placement group is removed and every rank actor is gone."""
    assert ray.util.placement_group_table(pg)["state"] == "REMOVED"
    for worker in workers:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(worker.ping.remote(), timeout=30)


@pytest.fixture(scope="module")
def expected(checkpoint) -> list[int]:
    """The greedy tokens a one-rank engine produces (a tensor-parallel engine must match them)."""
    with LLM(checkpoint("llama"), num_kv_blocks=64) as llm:
        return llm.generate([PROMPT], PARAMS)[0].outputs[0].token_ids


def test_with_block_releases_the_group_and_a_second_engine_runs(ray_cluster, checkpoint, expected):
    ray = ray_cluster
    with LLM(checkpoint("llama"), **TP2) as llm:
        assert llm.generate([PROMPT], PARAMS)[0].outputs[0].token_ids == expected
        executor = llm.engine.executor
        pg, workers = executor.placement_group, list(executor.workers)
        assert group_state(ray, executor) == "CREATED"
    assert_released(ray, pg, workers)
    with pytest.raises(EngineDeadError, match="shut down"):
        llm.generate([PROMPT], PARAMS)
    llm.shutdown()  # a second shutdown is harmless
    with LLM(checkpoint("llama"), **TP2) as second:
        assert second.generate([PROMPT], PARAMS)[0].outputs[0].token_ids == expected


def test_dropped_engine_releases_its_group_when_collected(ray_cluster, checkpoint, expected):
    ray = ray_cluster
    llm = LLM(checkpoint("llama"), **TP2)
    assert llm.generate([PROMPT], PARAMS)[0].outputs[0].token_ids == expected
    pg, workers = llm.engine.executor.placement_group, list(llm.engine.executor.workers)
    engine = weakref.ref(llm.engine)
    del llm
    gc.collect()
    assert engine() is None
    assert_released(ray, pg, workers)  # (what a second engine needs: the with-block test starts one)


async def generate(engine: AsyncLLM) -> list[int]:
    tokens: list[int] = []
    async for out in engine.generate(PROMPT, PARAMS):
        tokens = out.outputs[0].token_ids
    return tokens


async def test_async_engine_shutdown_releases_the_group_and_ends_requests(ray_cluster, checkpoint, expected):
    ray = ray_cluster
    async with AsyncLLM(model=checkpoint("llama"), **TP2) as engine:
        assert await generate(engine) == expected
        executor = engine.engine.executor
        pg, workers = executor.placement_group, list(executor.workers)
        long = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
        stream = engine.generate(PROMPT, long)
        await anext(stream)  # a request in flight when the engine shuts down
    # Outputs the engine made before it stopped may still come; then the stream ends with the error.
    with pytest.raises(EngineDeadError, match="shut down"):
        async with asyncio.timeout(30):
            async for _ in stream:
                pass
    assert_released(ray, pg, workers)
    with pytest.raises(EngineDeadError, match="shut down"):
        await asyncio.wait_for(generate(engine), timeout=10)
    with pytest.raises(EngineDeadError, match="shut down"):
        await engine.check_health()
    engine.shutdown()  # idempotent


async def test_dropped_async_engine_stops_its_thread_and_releases_its_group(
    ray_cluster, checkpoint, expected
):
    """The engine thread must not keep its AsyncLLM alive: dropping it stops the loop and frees the ranks."""
    ray = ray_cluster
    engine = AsyncLLM(model=checkpoint("llama"), **TP2)
    assert await generate(engine) == expected
    executor = engine.engine.executor
    pg, workers, thread = executor.placement_group, list(executor.workers), engine._core._thread
    del engine, executor
    gc.collect()
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert_released(ray, pg, workers)
