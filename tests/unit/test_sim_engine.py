"""The simulated engine (engine/sim/): the real scheduler, block manager and output path on a timing
model. Time here is a `VirtualClock`'s: simulated seconds, no wall-clock bound."""

import subprocess
import sys
from pathlib import Path

import pytest

from raylane.config import SIM_PROFILES, EngineConfig, PoolConfig
from raylane.engine import SamplingParams
from raylane.engine.sim.clock import VirtualClock
from raylane.engine.sim.engine import SimulatedEngine
from raylane.engine.sim.profile import PROFILE_DIR, load_profile

H100 = "sim:llama-3.1-8b-h100"


def engine(model: str = H100, **fields) -> SimulatedEngine:
    return SimulatedEngine(EngineConfig(model=model, **fields), clock=VirtualClock())


@pytest.fixture(scope="module")
def tokenizer():
    return engine().tokenizer


def prompt_ids(tokenizer, i: int, length: int) -> list[int]:
    """A prompt of exactly `length` tokens, different for each i (no prefix shared between streams)."""
    ids = tokenizer.encode(f"Stream {i}: " + "the quick brown fox jumps over the lazy dog " * length)
    return ids[:length]


def run(eng: SimulatedEngine, requests: dict[str, list[int]], params: SamplingParams) -> dict[str, dict]:
    """Add all at time 0, step to the end; per request its first and last token's simulated time."""
    for rid, ids in requests.items():
        eng.add_request(ids, params, request_id=rid)
    seen: dict[str, dict] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            now, n = eng.clock.now(), len(out.outputs[0].token_ids)
            rec = seen.setdefault(out.request_id, {"first": now})
            rec.update(last=now, tokens=n, ids=out.outputs[0].token_ids, text=out.outputs[0].text)
            rec["reason"] = out.outputs[0].finish_reason
    return seen


@pytest.mark.parametrize("profile", SIM_PROFILES)
@pytest.mark.parametrize("streams", [1, 16, 64])
def test_timing_is_the_profiles_model(profile, streams, tokenizer):
    """N streams of P prompt and O output tokens, all at once: TTFT, TPOT and output throughput on
    simulated time within 10% of what the profile's formula gives (one prefill step of N*P tokens,
    then O-1 decode steps of N sequences whose contexts grow by one token a step)."""
    p = load_profile(profile)
    prompt, output = min(96, p.max_num_batched_tokens // streams), 64  # the prompts fit one step's budget
    eng = engine(f"sim:{profile}")
    assert streams <= p.max_num_seqs
    done = run(
        eng,
        {f"r{i}": prompt_ids(tokenizer, i, prompt) for i in range(streams)},
        SamplingParams(max_tokens=output, ignore_eos=True),
    )
    t = p.timing
    ttft = t.step_time(streams, streams * prompt, 0)
    decode = [t.step_time(streams, 0, streams * (prompt + k)) for k in range(1, output)]
    tpot = sum(decode) / len(decode)
    throughput = streams * output / (ttft + sum(decode))
    measured_ttft = sum(r["first"] for r in done.values()) / streams
    measured_tpot = sum((r["last"] - r["first"]) / (r["tokens"] - 1) for r in done.values()) / streams
    measured_throughput = sum(r["tokens"] for r in done.values()) / max(r["last"] for r in done.values())
    assert all(r["tokens"] == output for r in done.values())
    assert measured_ttft == pytest.approx(ttft, rel=0.10)
    assert measured_tpot == pytest.approx(tpot, rel=0.10)
    assert measured_throughput == pytest.approx(throughput, rel=0.10)


def test_tokens_come_from_the_prompt_alone(tokenizer):
    """Same prompt, same tokens, on two engines and whatever ran beside it; another prompt, others.
    Without ignore_eos an answer ends (EOS, `stop`) at a length drawn from its prompt."""
    a, b = engine(), engine()
    prompt = "Tell me about the sea."
    alone = run(a, {"x": tokenizer.encode(prompt)}, SamplingParams(max_tokens=600))["x"]
    crowd = {f"o{i}": prompt_ids(tokenizer, i, 50) for i in range(8)} | {"x": tokenizer.encode(prompt)}
    beside = run(b, crowd, SamplingParams(max_tokens=600))
    assert beside["x"]["ids"] == alone["ids"] and beside["x"]["text"] == alone["text"]
    assert alone["reason"] == "stop" and alone["tokens"] < 600
    assert beside["o1"]["ids"] != beside["o2"]["ids"]
    assert alone["text"].strip() and all(w.isalpha() for w in alone["text"].split())


def test_a_resumed_request_goes_on_as_the_first_would_have(tokenizer):
    from raylane.engine import Resumption

    ids = tokenizer.encode("Write a poem about mountains.")
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    whole = run(engine(), {"x": ids}, params)["x"]["ids"]
    resumed = engine()
    resumed.add_request(ids, params, request_id="x", resume=Resumption((tuple(whole[:12]),)))
    rest = []
    while resumed.has_unfinished_requests():
        for out in resumed.step():
            rest = out.outputs[0].token_ids
    assert list(whole[:12]) + list(rest)[-18:] == list(whole)


def test_prefix_cache_hits_and_shorter_prefill(tokenizer):
    """A second request sharing a 512-token prefix finds it cached (as the real engine's block manager
    does) and its first token comes sooner by the prefill it skipped."""
    eng = engine()
    shared = prompt_ids(tokenizer, 0, 512)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    first = run(eng, {"a": shared + [11, 12, 13]}, params)["a"]
    start = eng.clock.now()
    second = run(eng, {"b": shared + [21, 22, 23]}, params)["b"]
    assert eng.block_manager.prefix_cache_hits == 512
    assert second["first"] - start < first["first"] - eng.profile.timing.per_prefill_token_s * 400


def test_kv_capacity_preempts_and_every_request_finishes(tokenizer):
    """Too few KV blocks for the batch: requests are preempted (recomputed), the lowest priority
    first, and all finish with their full output."""
    eng = engine(num_kv_blocks=40, block_size=16)
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    for i in range(6):
        eng.add_request(prompt_ids(tokenizer, i, 80), params, request_id=f"r{i}", priority=1 if i < 3 else 0)
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = len(out.outputs[0].token_ids)
    assert done == {f"r{i}": 48 for i in range(6)}
    assert eng.scheduler.num_preemptions > 0


def test_what_it_does_not_simulate_is_a_named_error(tokenizer):
    from raylane.engine.structured_params import StructuredOutputParams

    eng = engine()
    with pytest.raises(ValueError, match="^structured:"):
        eng.add_request("hi", SamplingParams(structured=StructuredOutputParams(json_object=True)))
    with pytest.raises(ValueError, match="^prompt_logprobs:"):
        eng.add_request("hi", SamplingParams(prompt_logprobs=1))
    out = run(eng, {"x": tokenizer.encode("hi")}, SamplingParams(max_tokens=3, logprobs=2))
    assert out["x"]["tokens"] == 3


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"model": "x", "backend": "simulated"}, "sim_profile"),
        ({"model": "sim:no-such-gpu"}, "sim_profile"),
        ({"model": H100, "engine_core": "process"}, "engine_core"),
        (
            {"model": H100, "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
            "speculative",
        ),
        ({"model": H100, "tensor_parallel_size": 2}, "tensor_parallel_size"),
    ],
)
def test_config_errors_name_the_field(fields, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**fields)


def test_shipped_profiles_load_and_cite_sources():
    assert sorted(p.stem for p in PROFILE_DIR.glob("*.yaml")) == sorted(SIM_PROFILES)
    for name in SIM_PROFILES:
        p = load_profile(name)
        assert p.name == name and "http" in p.source and p.num_kv_blocks * p.block_size >= p.max_model_len
    pool = PoolConfig(name="sim", model=H100, engine={})
    assert pool.sim_profile == "llama-3.1-8b-h100" and pool.engine_config().simulated


def test_a_simulated_engine_imports_no_torch():
    code = (
        "import sys, asyncio\n"
        "from raylane.engine import AsyncLLM, SamplingParams\n"
        f"llm = AsyncLLM(model={H100!r})\n"
        "async def main():\n"
        "    async for out in llm.generate('hi', SamplingParams(max_tokens=3)): pass\n"
        "asyncio.run(main()); llm.shutdown()\n"
        "print('torch' in sys.modules, 'raylane.models.loader' in sys.modules)\n"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "False"]
