"""Prompt logprobs (`SamplingParams.prompt_logprobs`) wherever the engine can take a prompt apart: one
token a step beside a decoding request (a pure-decode batch: CUDA graphs' buffers, the compiled
decode step), preempted halfway, and a first sample that lags the second. Each against transformers'
log-softmax of one forward over the prompt, on a tiny random checkpoint; the real model's values are
tests/unit/test_real_model.py's."""

import pytest
import torch

import raylane.models.paged_kernel as paged_kernel
from raylane.engine import LLM, SamplingParams
from raylane.engine.compiled_decode import CompiledDecode
from raylane.engine.sampling_params import RequestOutputKind
from tests.hf_models import load_hf_model
from tests.unit.test_paged_attention import varlen_attn_reference

TOL = 1e-4  # float32 on both sides, a two-layer model


@pytest.fixture(scope="module")
def llama(checkpoint) -> str:
    return checkpoint("llama")


@pytest.fixture(scope="module")
def hf(llama):
    return load_hf_model(llama)


def prompt_of(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_equal_to_transformers(hf, prompt: list[int], prompt_logprobs, k: int) -> None:
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    assert prompt_logprobs is not None and len(prompt_logprobs) == len(prompt)
    assert prompt_logprobs[0] is None
    for i, entry in enumerate(prompt_logprobs[1:], start=1):
        assert prompt[i] in entry and len(entry) in (k, k + 1)
        for token_id, lp in entry.items():
            assert lp.logprob == pytest.approx(ref[i - 1, token_id].item(), abs=TOL)


def one_token_prefill_beside_a_decode(llm: LLM, k: int = 2) -> tuple[list[int], object]:
    """Request A decodes while B's prompt, with prompt logprobs, is prefilled one token a step (a
    budget of 2 tokens: A's decode and one of B's): every step but the first is a pure-decode batch
    (one new token per request) in which B's row is a prompt-logprob row, not a sampling one."""
    a, b = prompt_of(2, seed=1), prompt_of(9, seed=2)
    params_a = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    params_b = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=k)
    _, out_b = llm.generate([a, b], [params_a, params_b])
    return b, out_b


def count_pure_decode_steps_with_prompt_rows(calls: list) -> int:
    """Steps run on the fast path whose rows include one that does not sample (B's prompt rows)."""
    return sum(1 for batch in calls if len(batch.query_lens) == 2 and len(batch.sample_indices) == 2)


def test_one_token_prompt_chunks_through_the_cuda_graph_buffers(llama, hf, monkeypatch):
    """As on a GPU (flash_varlen, made up here, with the graphs' eager stand-in): the pure-decode steps
    replay through the graphs' static buffers, and B's prompt rows come back from them."""
    monkeypatch.setattr(paged_kernel, "_KERNEL", varlen_attn_reference)
    monkeypatch.setattr(
        "raylane.engine.model_runner.resolve_attention", lambda *args: ("flash_varlen", args[-1])
    )
    llm = LLM(llama, block_size=256, num_kv_blocks=8, max_num_seqs=4, max_num_batched_tokens=2)
    runner = llm.engine.runner
    runner.graphs = runner.capture_decode_graphs(capture=False)
    calls = []
    run = runner.graphs.run
    monkeypatch.setattr(runner.graphs, "run", lambda batch, size: (calls.append(batch), run(batch, size))[1])
    prompt, out = one_token_prefill_beside_a_decode(llm)
    assert count_pure_decode_steps_with_prompt_rows(calls) >= 7
    assert_equal_to_transformers(hf, prompt, out.prompt_logprobs, k=2)


def test_one_token_prompt_chunks_through_the_compiled_decode_step(llama, hf, monkeypatch):
    """The CPU's compiled decode path (`torch_compile`), with torch.compile made the identity: its
    batch handling is what is under test here (a compile takes a minute; tests/unit/
    test_compiled_decode.py compiles)."""
    llm = LLM(llama, block_size=16, num_kv_blocks=16, max_num_seqs=4, max_num_batched_tokens=2)
    runner = llm.engine.runner
    monkeypatch.setattr(torch, "compile", lambda forward, **_: forward)
    caches = [c for layer in runner.model.attention_layers() for c in (layer.k_cache, layer.v_cache)]
    runner.compiled = CompiledDecode(
        runner.model,
        caches,
        runner.block_size,
        runner.scratch_block,
        runner.model.sliding_window,
        runner.config.max_num_seqs,
        runner.attention_backend,
    )
    calls = []
    run = runner.compiled.run
    monkeypatch.setattr(runner.compiled, "run", lambda batch: (calls.append(batch), run(batch))[1])
    prompt, out = one_token_prefill_beside_a_decode(llm)
    assert count_pure_decode_steps_with_prompt_rows(calls) >= 7
    assert_equal_to_transformers(hf, prompt, out.prompt_logprobs, k=2)


def test_a_request_preempted_halfway_through_its_prompt_still_gets_all_of_them(llama, hf):
    """KV blocks for about two requests: the prompt-logprob request (the lower priority) is preempted
    while its prompt is half read, recomputed from its first token, and reads the rest."""
    llm = LLM(llama, block_size=16, num_kv_blocks=5, max_num_seqs=4, max_num_batched_tokens=8)
    long_running = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    scored = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, prompt_logprobs=3)
    a, b = prompt_of(40, seed=3), prompt_of(35, seed=4)
    llm.engine.add_request(a, long_running, request_id="a", priority=0)
    llm.engine.add_request(b, scored, request_id="b", priority=1)
    finals = {}
    while llm.engine.has_unfinished_requests():
        finals |= {out.request_id: out for out in llm.engine.step() if out.finished}
    assert finals["b"].metrics["num_preemptions"] >= 1
    assert_equal_to_transformers(hf, b, finals["b"].prompt_logprobs, k=3)


def test_the_first_delta_output_carries_them_when_the_other_sample_runs_ahead(llama, hf):
    """n = 2, the prompt cached, the second sample served first (as after the first one's preemption:
    the queue is reordered by hand here): it takes the cached prompt and samples at once, while the
    first forwards the whole prompt (a cached position is never forwarded) in chunks. No output goes
    out before the prompt logprobs are read, so the first carries them, none after it, and no token of
    the second sample is lost on the way."""
    llm = LLM(llama, block_size=4, num_kv_blocks=64, max_num_batched_tokens=8)
    prompt = prompt_of(30, seed=5)
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))  # the prompt is now cached
    params = SamplingParams(
        n=2,
        temperature=0,
        max_tokens=6,
        ignore_eos=True,
        prompt_logprobs=1,
        output_kind=RequestOutputKind.DELTA,
    )
    llm.engine.add_request(prompt, params, request_id="r")
    waiting = llm.engine.scheduler.waiting
    first = next(r for r in waiting if r.index == 0)
    waiting.remove(first)
    waiting.push(first)  # behind the second sample
    outputs, steps = [], 0
    while llm.engine.has_unfinished_requests():
        outputs += llm.engine.step()
        steps += 1
    assert steps > len(outputs)  # steps of the second sample alone gave no output
    assert outputs[0].prompt_logprobs is not None and all(o.prompt_logprobs is None for o in outputs[1:])
    assert_equal_to_transformers(hf, prompt, outputs[0].prompt_logprobs, k=1)
    for index in (0, 1):
        assert sum(len(c.token_ids) for o in outputs for c in o.outputs if c.index == index) == 6
