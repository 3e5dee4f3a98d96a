"""Scheduling behaviour a user notices: batching, prefix reuse, preemption, abort, priority, seeds."""

import asyncio
import os
import time
from pathlib import Path

import pytest
import torch

from raylane.config import EngineConfig
from raylane.engine import LLM, AsyncLLM, SamplingParams
from raylane.engine.llm_engine import LLMEngine


def random_prompt(n: int, seed: int, vocab: int = 512) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def llama(checkpoint) -> str:
    return checkpoint("llama")


@pytest.fixture(params=["thread", "process"])
def engine_core(request) -> str:
    """Where AsyncLLM steps the engine: both must behave alike."""
    return request.param


# run_in_engine probes: module-level, so they also cross into an engine core process.
def free_blocks(engine: LLMEngine) -> int:
    return engine.block_manager.num_free_blocks


def unfinished_requests(engine: LLMEngine) -> int:
    return len(engine.scheduler.running) + len(engine.scheduler.waiting)


def count_computed_tokens(engine: LLMEngine) -> list[int]:
    """Record how many tokens each forward pass computes."""
    counts: list[int] = []
    run = engine.runner.execute_model

    def counting(batch):
        counts.append(len(batch.token_ids))
        return run(batch)

    engine.runner.execute_model = counting
    return counts


async def test_late_short_request_finishes_before_early_long_one(llama, engine_core):
    engine = AsyncLLM(model=llama, num_kv_blocks=64, max_num_seqs=4, engine_core=engine_core)
    finish_order: list[str] = []
    long_tokens_when_short_done: list[int] = []
    long_progress = [0]

    async def run(rid, prompt, max_tokens):
        async for out in engine.generate(prompt, greedy(max_tokens), request_id=rid):
            if rid == "long":
                long_progress[0] = len(out.outputs[0].token_ids)
            if out.finished:
                finish_order.append(rid)
                if rid == "short":
                    long_tokens_when_short_done.append(long_progress[0])

    long_task = asyncio.create_task(run("long", random_prompt(30, 0), 150))
    while long_progress[0] < 5:  # the long request is decoding when the short one arrives
        await asyncio.sleep(0.01)
    await run("short", random_prompt(6, 1), 5)
    await long_task
    engine.shutdown()
    assert finish_order == ["short", "long"]
    assert 5 < long_tokens_when_short_done[0] < 150  # joined the running batch, didn't wait for it


def test_prefix_cache_computes_only_the_new_suffix_and_matches_a_cold_run(llama):
    prefix, suffix = random_prompt(64, 2), random_prompt(7, 3)
    cold = LLM(llama, num_kv_blocks=64, enable_prefix_caching=False).generate(prefix + suffix, greedy(10))
    llm = LLM(llama, num_kv_blocks=64, block_size=16)
    llm.generate(prefix + random_prompt(5, 4), greedy(4))
    counts = count_computed_tokens(llm.engine)
    warm = llm.generate(prefix + suffix, greedy(10))
    assert warm[0].num_cached_tokens == 64
    assert counts[0] == 7  # only the suffix was prefilled
    assert warm[0].outputs[0].token_ids == cold[0].outputs[0].token_ids
    stats = llm.engine.block_manager
    assert stats.prefix_cache_hits == 64 and stats.prefix_cache_queries == 69 + 71


def test_a_warmed_up_engine_starts_empty_and_answers_as_a_cold_one(llama):
    """The serving cores run one short request before they take any (`warm_up`: a first step's
    one-time costs fall on the start, bench/README.md "Cold path"). It leaves no block held or
    cached and no prefix-cache count: a client prompt that starts with the warm-up's own tokens
    finds nothing cached, and gets the cold engine's answer."""

    def run(engine: LLMEngine, prompt: list[int]):
        engine.add_request(prompt, greedy(8), request_id="client")
        while engine.has_unfinished_requests():
            done = [out for out in engine.step() if out.finished]
        return done[0]

    prompt = list(range(1, 17)) + random_prompt(9, 50)  # the warm-up's prompt is 1..16
    config = EngineConfig(model=llama, num_kv_blocks=64, block_size=8)
    cold = LLMEngine(config)
    free = cold.block_manager.num_free_blocks
    warm = LLMEngine(config)
    assert warm.warm_up() > 0
    manager = warm.block_manager
    assert manager.num_free_blocks == free and not manager.cached
    assert manager.prefix_cache_queries == manager.prefix_cache_hits == 0
    answer = run(warm, prompt)
    assert answer.num_cached_tokens == 0
    assert answer.outputs[0].token_ids == run(cold, prompt).outputs[0].token_ids


def test_preemption_under_kv_pressure_keeps_outputs_identical(llama):
    prompts = [random_prompt(20 + 5 * i, 10 + i) for i in range(4)]
    params = greedy(40)
    roomy = LLM(llama, num_kv_blocks=128, block_size=8).generate(prompts, params)
    # 14 blocks of 8 tokens: each request needs up to 9, so at most one and a half fit.
    tight = LLM(llama, num_kv_blocks=14, block_size=8)
    outputs = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in roomy]
    assert tight.engine.block_manager.num_free_blocks == 14


async def test_abort_frees_kv_blocks_at_once(llama, engine_core):
    engine = AsyncLLM(model=llama, num_kv_blocks=32, engine_core=engine_core)
    seen = 0
    async for out in engine.generate(random_prompt(40, 5), greedy(200), request_id="victim"):
        seen = len(out.outputs[0].token_ids)
        if seen >= 3:
            assert await engine.run_in_engine(free_blocks) < 32
            last = await engine.abort("victim")  # what it made, for the caller's accounting
            break
    free = await engine.run_in_engine(free_blocks)
    running = await engine.run_in_engine(unfinished_requests)
    again = await engine.abort("victim")
    engine.shutdown()
    assert 3 <= seen < 200 and free == 32 and running == 0
    assert last.finished and last.outputs[0].finish_reason == "abort"
    assert seen <= len(last.outputs[0].token_ids) < 200
    assert again is None  # the engine no longer knows it


async def test_client_leaving_the_stream_aborts_the_request(llama, engine_core):
    engine = AsyncLLM(model=llama, num_kv_blocks=32, engine_core=engine_core)
    aborted = []
    gen = engine.generate(random_prompt(10, 6), greedy(200), request_id="gone", on_abort=aborted.append)
    async for _ in gen:
        break
    await gen.aclose()  # what a disconnect does to the serving task
    assert await engine.run_in_engine(free_blocks) == 32
    engine.shutdown()
    [last] = aborted  # the caller hears what the request made before it stopped
    assert last.outputs[0].finish_reason == "abort" and 1 <= len(last.outputs[0].token_ids) < 200


async def test_a_consumer_that_falls_behind_gets_the_piled_up_deltas_as_one(llama):
    """A slow reader of a DELTA stream (a busy replica, a slow client) gets fewer, bigger outputs that
    add up to exactly what a prompt reader gets: no token, text or logprob lost or repeated."""
    from operator import methodcaller

    from raylane.engine import RequestOutputKind

    engine = AsyncLLM(model=llama, num_kv_blocks=64, stream_batching_interval_ms=0)
    params = SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True, logprobs=2, output_kind=RequestOutputKind.DELTA
    )

    async def read(slow: bool, rid: str) -> tuple[int, list[int], str, int]:
        outputs, tokens, text, logprobs = 0, [], "", 0
        async for out in engine.generate(random_prompt(12, 9), params, request_id=rid):
            outputs += 1
            tokens += out.outputs[0].token_ids
            text += out.outputs[0].text
            logprobs += len(out.outputs[0].logprobs or [])
            if slow and outputs == 1:  # read nothing more until the engine has finished the request
                while await engine.run_in_engine(methodcaller("has_unfinished_requests")):
                    await asyncio.sleep(0.05)
        return outputs, tokens, text, logprobs

    prompt_outputs, *prompt = await read(False, "prompt")
    slow_outputs, *slow = await read(True, "slow")
    engine.shutdown()
    assert slow == prompt and len(prompt[0]) == 40 and prompt[2] == 40
    assert slow_outputs == 2 < prompt_outputs  # the first, then all the rest merged into one


async def test_stream_interval_sends_fewer_bigger_deltas_with_the_same_tokens(llama):
    """`stream_interval=4`: the first token at once, then deltas of at least 4 tokens until the last,
    adding up to exactly the tokens and text of an every-token stream."""
    from raylane.engine import RequestOutputKind

    params = SamplingParams(
        temperature=0, max_tokens=19, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    streams = []
    for interval in (1, 4):
        engine = AsyncLLM(
            model=llama, num_kv_blocks=64, stream_interval=interval, stream_batching_interval_ms=0
        )
        deltas = [out.outputs[0] async for out in engine.generate(random_prompt(12, 10), params)]
        engine.shutdown()
        streams.append(deltas)
    every, chunked = streams
    # A reader that falls behind gets merged deltas in both streams (the engine core may run ahead), so
    # only the interval's bounds are exact: no delta between the first and the last is under 4 tokens.
    sizes = [len(d.token_ids) for d in chunked]
    assert all(n >= 4 for n in sizes[1:-1]) and sum(sizes) == 19, sizes
    assert len(chunked) <= 2 + 18 // 4 and chunked[-1].finish_reason == "length"
    assert [t for d in chunked for t in d.token_ids] == [t for d in every for t in d.token_ids]
    assert "".join(d.text for d in chunked) == "".join(d.text for d in every)


async def test_a_batching_interval_sends_a_fast_engines_tokens_at_most_once_per_interval(llama):
    """`stream_batching_interval_ms=100`: after the first output, at most one per 100 ms until the
    last, adding up to exactly the tokens and text of an every-step stream."""
    from raylane.engine import RequestOutputKind

    params = SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    loop = asyncio.get_running_loop()
    streams = []
    for interval_ms in (0, 100):
        engine = AsyncLLM(model=llama, num_kv_blocks=64, stream_batching_interval_ms=interval_ms)
        start = loop.time()
        deltas = [out.outputs[0] async for out in engine.generate(random_prompt(12, 11), params)]
        streams.append((deltas, loop.time() - start))
        engine.shutdown()
    (every, _), (batched, elapsed) = streams
    # Each output between the first and the last went out 100 ms or more after the one before it.
    assert len(batched) - 2 <= elapsed / 0.1, (len(batched), elapsed)
    assert batched[-1].finish_reason == "length"
    assert [t for d in batched for t in d.token_ids] == [t for d in every for t in d.token_ids]
    assert "".join(d.text for d in batched) == "".join(d.text for d in every)


async def test_the_core_hands_over_a_streams_outputs_once_per_interval_not_once_per_step(
    llama, engine_core, monkeypatch
):
    """With a batching interval the engine core itself holds a request's outputs between its first and
    its last until the interval has passed: the serving side (its reader, its event loop) wakes once
    per interval, not once per engine step, and the stream still has every token, in order."""
    from raylane.engine import RequestOutputKind
    from raylane.engine.core_messages import Outputs

    handovers: list[tuple[float, int]] = []  # (when, tokens) of each hand-over carrying the request's outputs
    on_events = AsyncLLM._on_events

    def recording(self, events):
        tokens = sum(len(o.outputs[0].token_ids) for e in events if isinstance(e, Outputs) for o in e.outputs)
        if tokens:
            handovers.append((time.monotonic(), tokens))
        on_events(self, events)

    monkeypatch.setattr(AsyncLLM, "_on_events", recording)
    params = SamplingParams(
        temperature=0, max_tokens=300, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    streams = {}
    for interval_ms in (0, 100):
        handovers.clear()
        engine = AsyncLLM(
            model=llama, num_kv_blocks=64, stream_batching_interval_ms=interval_ms, engine_core=engine_core
        )
        streams[interval_ms] = [
            t
            async for out in engine.generate(random_prompt(12, 12), params)
            for t in out.outputs[0].token_ids
        ]
        engine.shutdown()
        if interval_ms == 0:
            assert len(handovers) == 300  # one per step: what the interval improves on
    elapsed = handovers[-1][0] - handovers[0][0]
    # The first and the last at once, the ones between at least 100 ms apart (+ 1: arrival jitter).
    assert len(handovers) - 2 <= elapsed / 0.1 + 1, (len(handovers), elapsed)
    assert sum(n for _, n in handovers) == 300 and streams[100] == streams[0]


def first_output_steps(engine: LLMEngine) -> dict[str, int]:
    """Step the engine until it is idle: request id -> the step that gave its first output."""
    first: dict[str, int] = {}
    step = 0
    while engine.has_unfinished_requests():
        step += 1
        for out in engine.step():
            first.setdefault(out.request_id, step)
    return first


def test_priority_zero_request_is_scheduled_before_earlier_priority_one_requests(llama):
    engine = LLMEngine(EngineConfig(model=llama, num_kv_blocks=64, max_num_seqs=1))
    engine.add_request(random_prompt(8, 20), greedy(6), request_id="running")  # fills the batch
    engine.step()
    for i in range(3):
        engine.add_request(random_prompt(8, 30 + i), greedy(6), request_id=f"low{i}", priority=1)
    engine.add_request(random_prompt(8, 40), greedy(6), request_id="urgent", priority=0)
    first_output_step = first_output_steps(engine)
    assert all(first_output_step["urgent"] < first_output_step[f"low{i}"] for i in range(3))


def test_a_higher_priority_request_takes_a_running_lower_priority_requests_slot(llama):
    """Every slot (`max_num_seqs`) held by a long batch-tier request: an interactive request sent
    then runs at the next step, preempting it, rather than waiting for it to finish; the preempted
    request is recomputed later and its answer is the one it gives alone."""
    engine = LLMEngine(EngineConfig(model=llama, num_kv_blocks=64, max_num_seqs=1))
    engine.add_request(random_prompt(8, 50), greedy(60), request_id="batch", priority=3)
    for _ in range(3):
        engine.step()
    engine.add_request(random_prompt(8, 51), greedy(4), request_id="urgent", priority=0)
    outputs: dict[str, list[int]] = {}
    first_step: dict[str, int] = {}
    step = 0
    while engine.has_unfinished_requests():
        step += 1
        for out in engine.step():
            first_step.setdefault(out.request_id, step)
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
    assert first_step["urgent"] == 1, first_step
    assert engine.scheduler.num_preemptions == 1
    alone = LLMEngine(EngineConfig(model=llama, num_kv_blocks=64, max_num_seqs=1))
    alone.add_request(random_prompt(8, 50), greedy(60), request_id="batch", priority=3)
    while alone.has_unfinished_requests():
        for out in alone.step():
            if out.finished:
                assert list(out.outputs[0].token_ids) == list(outputs["batch"])


def test_a_higher_priority_request_short_of_kv_blocks_preempts_a_lower_priority_one(llama):
    """The blocks, not the slots, run out: a running lower-priority request gives its blocks to a
    waiting higher-priority one, which would otherwise wait until it finished."""
    engine = LLMEngine(EngineConfig(model=llama, num_kv_blocks=6, block_size=16, max_num_seqs=4))
    engine.add_request(random_prompt(60, 52), greedy(20), request_id="batch", priority=3)
    engine.step()  # its prompt holds 4 of the 6 blocks
    engine.add_request(random_prompt(40, 53), greedy(4), request_id="urgent", priority=0)
    first = first_output_steps(engine)
    assert first["urgent"] == 1 and engine.scheduler.num_preemptions >= 1, first


def test_an_equal_priority_request_never_preempts(llama):
    engine = LLMEngine(EngineConfig(model=llama, num_kv_blocks=64, max_num_seqs=1))
    engine.add_request(random_prompt(8, 54), greedy(12), request_id="first", priority=1)
    engine.step()
    engine.add_request(random_prompt(8, 55), greedy(4), request_id="second", priority=1)
    first = first_output_steps(engine)
    assert first["second"] > first["first"] and engine.scheduler.num_preemptions == 0


def test_within_a_priority_a_key_with_one_request_waits_for_a_slot_not_for_another_keys_queue(llama):
    """Two slots, both held by key A, which has queued five more; key B then sends one. B's request
    runs as soon as a slot frees, not after A's queue (FCFS would run it seventh). A's own requests
    keep their order."""
    engine = LLMEngine(EngineConfig(model=llama, num_kv_blocks=64, max_num_seqs=2))
    for i in range(7):
        engine.add_request(random_prompt(8, 20 + i), greedy(4 + i), request_id=f"a{i}", tenant="key-a")
    engine.step()  # a0 and a1 run
    engine.add_request(random_prompt(8, 40), greedy(4), request_id="b", tenant="key-b")
    first_output_step = first_output_steps(engine)
    waited = sorted(set(first_output_step) - {"a0", "a1"}, key=first_output_step.get)
    assert waited == ["b", "a2", "a3", "a4", "a5", "a6"], waited


def test_kv_pressure_preempts_the_key_running_the_most(llama):
    """When blocks run out, the request preempted is of the tenant holding the most running requests
    (the newest of them), not simply the newest request: key A's three running requests yield a block
    before key B's one, although B's came last."""
    engine = LLMEngine(EngineConfig(model=llama, num_kv_blocks=9, block_size=16, max_num_seqs=4))
    for i in range(3):
        engine.add_request(random_prompt(30, 60 + i), greedy(40), request_id=f"a{i}", tenant="key-a")
    engine.add_request(random_prompt(30, 70), greedy(40), request_id="b", tenant="key-b")
    preempted: list[str] = []
    while engine.has_unfinished_requests() and not preempted:
        engine.step()
        preempted = [r.request_id for r in engine.scheduler.waiting if r.num_preemptions]
    assert preempted and "b" not in preempted, preempted


def test_seeded_sampling_is_reproducible_and_independent_of_batch_mates(llama):
    llm = LLM(llama, num_kv_blocks=64)
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=12, seed=7, ignore_eos=True)
    alone = llm.generate(random_prompt(9, 50), params)[0].outputs[0].token_ids
    batched = llm.generate([random_prompt(9, 50), random_prompt(15, 51)], [params, params.clone(seed=8)])
    assert batched[0].outputs[0].token_ids == alone
    other_seed = llm.generate(random_prompt(9, 50), params.clone(seed=8))[0].outputs[0].token_ids
    assert other_seed != alone


def test_n_completions_are_independent_samples(llama):
    llm = LLM(llama, num_kv_blocks=64)
    out = llm.generate(random_prompt(9, 60), SamplingParams(n=3, max_tokens=10, seed=1, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 10 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -1),
        ("top_p", 0.0),
        ("top_k", -3),
        ("max_tokens", 0),
        ("n", 0),
        ("min_p", 2.0),
        ("presence_penalty", 3.0),
        ("logprobs", -1),
        ("repetition_penalty", 0.0),
    ],
)
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_bad_prompts_are_rejected_with_a_clear_error(llama):
    llm = LLM(llama, num_kv_blocks=8, block_size=16)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[]], greedy(4))
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate(random_prompt(200, 1), greedy(4))  # 8 blocks x 16 = 128 tokens of KV
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[10_000]], greedy(4))


async def test_killed_engine_core_process_ends_requests_with_an_error(llama):
    """`engine_core: process`: if the core process dies mid-stream, requests in flight, health checks
    and new requests all fail with EngineDeadError instead of waiting forever."""
    from raylane.engine import EngineDeadError

    engine = AsyncLLM(model=llama, num_kv_blocks=64, engine_core="process")
    progress = [0, 0]

    async def run(i: int):
        async for out in engine.generate(random_prompt(20, 50 + i), greedy(400)):
            progress[i] = len(out.outputs[0].token_ids)

    tasks = [asyncio.create_task(run(i)) for i in range(2)]
    while min(progress) < 3:
        await asyncio.sleep(0.01)
    engine._core.process.kill()
    results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=30)
    assert all(isinstance(r, EngineDeadError) and "exit code -9" in str(r) for r in results), results
    assert max(progress) < 400
    with pytest.raises(EngineDeadError, match="exit code -9"):
        await engine.check_health()
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(anext(engine.generate([5, 6, 7])), timeout=10)
    await engine.abort("anything")  # returns at once: nothing left to free
    engine.shutdown()


async def test_a_stuck_engine_fails_its_health_check_and_an_idle_one_does_not(llama):
    """A core that is alive but takes no step (stopped here with SIGSTOP, as a hung rank or a deadlock
    leaves it) with a request in flight fails the health check, so Serve replaces the replica; an
    engine idle for longer than the same bound, then given a request, stays healthy."""
    import os
    import signal

    from raylane.engine import EngineDeadError

    engine = AsyncLLM(model=llama, num_kv_blocks=64, engine_core="process", iteration_timeout_s=1.0)
    await asyncio.sleep(1.5)  # idle past the bound
    stream = engine.generate(random_prompt(20, 7), greedy(400))
    await anext(stream)
    await engine.check_health()  # idle before, busy now: healthy
    os.kill(engine._core.process.pid, signal.SIGSTOP)
    try:
        with pytest.raises(EngineDeadError, match="produced nothing"):
            for _ in range(300):
                await engine.check_health()
                await asyncio.sleep(0.1)
    finally:
        os.kill(engine._core.process.pid, signal.SIGCONT)
        engine.shutdown()


def test_engine_core_process_ends_with_its_engine(llama):
    engine = AsyncLLM(model=llama, num_kv_blocks=64, engine_core="process")
    process = engine._core.process
    assert process.poll() is None
    engine.shutdown()
    assert process.poll() == 0


def test_a_checkpoint_the_core_process_cannot_load_is_the_callers_error(llama, tmp_path):
    """The core process loads the model while the serving process loads the tokenizer: its load error
    still reaches the caller as raised, and the process does not outlive the failed start."""
    import shutil
    import subprocess

    shutil.copy(Path(llama) / "config.json", tmp_path / "config.json")  # no weights
    with pytest.raises(FileNotFoundError, match="model weights not found"):
        AsyncLLM(model=str(tmp_path), num_kv_blocks=64, engine_core="process")
    children = subprocess.run(
        ["pgrep", "-P", str(os.getpid()), "-f", "raylane.engine.core_proc"], capture_output=True, text=True
    )
    assert children.stdout == "", children.stdout


def test_engine_core_process_needs_the_in_process_executor(llama):
    """`auto` moves a one-rank engine into its own process and leaves Ray rank groups on a thread;
    asking for a process with Ray ranks is a config error naming the field."""
    assert EngineConfig(model=llama).uses_core_process
    assert not EngineConfig(model=llama, tensor_parallel_size=2).uses_core_process
    assert not EngineConfig(model=llama, distributed_executor_backend="ray").uses_core_process
    with pytest.raises(ValueError, match="engine_core"):
        EngineConfig(model=llama, engine_core="process", tensor_parallel_size=2)


def test_dropped_async_engine_stops_its_core_process(llama):
    """Dropping an AsyncLLM without shutdown() ends its engine core process (its finalizer), and
    shutdown() may be called any number of times."""
    import gc

    with LLM(llama, num_kv_blocks=64) as llm:
        expected = llm.generate([[5, 6, 7]], greedy(3))[0].outputs[0].token_ids
    engine = AsyncLLM(model=llama, num_kv_blocks=64, engine_core="process")
    process = engine._core.process
    assert asyncio.run(_tokens(engine)) == expected
    del engine
    gc.collect()
    assert process.wait(timeout=30) == 0
    with AsyncLLM(model=llama, num_kv_blocks=64, engine_core="process") as second:
        process = second._core.process
    assert process.poll() == 0
    second.shutdown()


async def _tokens(engine: AsyncLLM) -> list[int]:
    tokens: list[int] = []
    async for out in engine.generate([5, 6, 7], greedy(3)):
        tokens = out.outputs[0].token_ids
    return tokens


def test_shut_down_llm_refuses_to_generate(llama):
    from raylane.engine import EngineDeadError

    with LLM(llama, num_kv_blocks=64) as llm:
        assert len(llm.generate([[5, 6, 7]], greedy(3))[0].outputs[0].token_ids) == 3
    with pytest.raises(EngineDeadError, match="shut down"):
        llm.generate([[5, 6, 7]], greedy(3))
