"""`torch_compile: true` (engine/compiled_decode.py) and `cpu_batch_weight_copy: true` on CPU.

What a user would notice: compiled decode steps compute what eager ones do (teacher-forced decode
logits over the same batches, against the eager runner, in float32 with oneDNN-packed weights, in
int4 with the batch copy and in int8); no request waits for a compile (every graph a decode batch
of 1 to 7 rows needs exists after start-up); a model inductor cannot take still serves, eagerly;
the batch copy is used from its row threshold and its memory is counted. Speed is
`raylane bench decode-profile --modes eager,compiled`'s business, not a test's.
"""

import logging

import pytest
import torch

from raylane.config import EngineConfig
from raylane.engine import LLM, SamplingParams
from raylane.engine.compiled_decode import CompiledDecode
from raylane.engine.model_runner import ModelRunner
from raylane.parallel.int4 import Int4Weight
from raylane.parallel.onednn import packed_bytes
from raylane.parallel.quantization import (
    BATCH_COPY_MIN_ROWS,
    add_batch_copy,
    quantize_linear_,
    quantized_linear,
)
from tests.unit.test_quantization import decode_logits_of
from tests.unit.test_quantization import llama_demo as llama_demo  # a fixture this module uses too

BATCHES = (1, 3, BATCH_COPY_MIN_ROWS + 2)  # one row, the int4 kernel's rows, the batch copy's rows


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test's engine compiles the same model code: without a reset, the graphs of earlier tests
    count against dynamo's recompile limit, and a later engine silently decodes eagerly."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def runner(path: str, **settings) -> ModelRunner:
    config = EngineConfig(model=path, num_kv_blocks=64, block_size=16, max_num_seqs=8, **settings)
    made = ModelRunner(config)
    made.allocate_kv_cache(64)
    return made


def sequences(count: int, seed: int) -> list[list[int]]:
    """The same sequences in every run: their lengths too come from `seed` (drawn from torch's global
    generator, they changed from run to run, and with them how far bfloat16 rounding moved the
    logits: the int4 case's mean error read 2e-7 in some runs and up to 2.2e-2 in others)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(20, 100, (count,), generator=g)
    return [torch.randint(3, 500, (int(n),), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize(
    "settings, max_mean_error, max_error",
    [
        # float32, linears packed for oneDNN: inductor only reorders float sums.
        ({}, 1e-5, 1e-4),
        # int4 (and the batch copy from BATCH_COPY_MIN_ROWS rows) and int8: activations enter the kernels
        # in bfloat16, and a float32 value that inductor's fused loop rounds one ulp apart from eager's
        # can round to a neighbouring bfloat16 (0.4% apart): the logits differ at bfloat16's precision
        # (these sequences, every run: int4 mean up to 7.6e-3 of their spread, any one logit up to
        # 7.3e-2; int8 9.5e-3 and 1.3e-1).
        ({"quantization": "int4", "cpu_batch_weight_copy": True}, 0.02, 0.15),
        ({"quantization": "int8"}, 0.02, 0.15),  # torch's int8 kernel as a custom op under compile
        # A bfloat16 KV cache: keys and values one ulp apart before the cache's rounding can land on
        # neighbouring bfloat16 values, as activations do above.
        ({"kv_cache_dtype": "bfloat16"}, 0.02, 0.15),
    ],
    ids=["float32", "int4-batch-copy", "int8", "bf16-kv-cache"],
)
def test_compiled_decode_steps_compute_what_eager_steps_do(llama_demo, settings, max_mean_error, max_error):
    eager = runner(llama_demo, **settings)
    compiled = runner(llama_demo, torch_compile=True, **settings)
    assert compiled.compiled is not None and eager.compiled is None
    for rows in BATCHES:
        seqs = sequences(rows, seed=rows)
        ref, got = decode_logits_of(eager, seqs, 4), decode_logits_of(compiled, seqs, 4)
        error = (got - ref).abs() / ref.std()
        print(
            f"{settings or 'float32'}, {rows} rows: |error| / std {error.mean():.1e}, max {error.max():.1e}"
        )
        assert error.mean() <= max_mean_error and error.max() <= max_error
        # The greedy token is the same wherever the error could not have flipped it: a differing top-1
        # only where eager's leads its runner-up by less than twice that position's largest error
        # (the random-weight model has near-ties).
        top2 = ref.topk(2, dim=-1).values
        within_error = (top2[:, 0] - top2[:, 1]) <= 2 * (got - ref).abs().amax(-1)
        assert bool(((got.argmax(-1) == ref.argmax(-1)) | within_error).all())


def test_no_decode_batch_waits_for_a_compile(llama_demo, monkeypatch):
    """After start-up every decode batch size up to max_num_seqs runs a graph compiled at start-up
    (a compile takes seconds to a minute on CPU): with a recompile made an error instead of an eager
    step, batches of 7 down to 1 rows all decode."""
    monkeypatch.setattr(CompiledDecode, "SERVING_STANCE", "fail_on_recompile")
    settings = dict(quantization="int4", cpu_batch_weight_copy=True)  # three graphs: 1, 2-4, 5+ rows
    llm = LLM(llama_demo, num_kv_blocks=64, max_num_seqs=7, torch_compile=True, **settings)
    assert llm.engine.runner.compiled is not None
    # 7 prompts finishing one step apart: decode batches of 7, 6, ... 1 rows.
    params = [SamplingParams(temperature=0, max_tokens=2 + i, ignore_eos=True) for i in range(7)]
    outputs = llm.generate(sequences(7, seed=3), params)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [2 + i for i in range(7)]


@pytest.mark.parametrize("attention", ["cpu_paged", "torch"])
def test_a_context_within_one_block_decodes_on_the_compiled_graphs(llama_demo, monkeypatch, attention):
    """A short prompt (a completion of "Hi") keeps its whole context in one KV block: its block table
    has one column, a size torch.compile never makes symbolic. That step must run a graph compiled at
    start-up (a recompile is made an error here); before, with guards skipped, it raised and stopped
    the engine, and every request on the replica with it."""
    monkeypatch.setattr(CompiledDecode, "SERVING_STANCE", "fail_on_recompile")
    llm = LLM(llama_demo, num_kv_blocks=64, block_size=16, torch_compile=True, attention_backend=attention)
    assert llm.engine.runner.compiled is not None
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    got = llm.generate([[5, 6, 7], [8, 9], [10] * 12], params)  # contexts of 3 to 17 tokens: 1 and 2 blocks
    want = LLM(llama_demo, num_kv_blocks=64, block_size=16, attention_backend=attention).generate(
        [[5, 6, 7], [8, 9], [10] * 12], params
    )
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_a_step_that_needs_a_new_graph_runs_eagerly(llama_demo, monkeypatch, caplog):
    """Should a decode batch still meet a shape no start-up graph covers, that step runs eagerly (a
    compile would stall every stream for seconds) and the engine goes on."""

    def small_batch_graphs_only(self):  # the graphs of 1 and of 2-4 rows, none from the batch copy's 5
        for rows in (1, 2):
            table = [self.scratch_block] * 3
            self._forward([0] * rows, [2 * self.block_size + 2] * rows, [table] * rows, [35] * rows)
        return 0.0

    monkeypatch.setattr(CompiledDecode, "warm_up", small_batch_graphs_only)
    settings = dict(quantization="int4", cpu_batch_weight_copy=True)
    llm = LLM(llama_demo, num_kv_blocks=64, block_size=16, torch_compile=True, **settings)
    prompts = sequences(6, seed=5)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with caplog.at_level(logging.WARNING, logger="raylane.engine.compiled_decode"):
        got = llm.generate(prompts, params)  # decode batches of six rows: no graph for them
    want = LLM(llama_demo, num_kv_blocks=64, block_size=16, **settings).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert "no graph compiled at start-up fits this decode batch" in caplog.text


def test_a_model_that_does_not_compile_decodes_eagerly(llama_demo, monkeypatch, caplog):
    def fail(self):
        raise RuntimeError("inductor: no lowering for this op")

    monkeypatch.setattr(CompiledDecode, "warm_up", fail)
    with caplog.at_level(logging.WARNING, logger="raylane.engine.model_runner"):
        llm = LLM(llama_demo, num_kv_blocks=64, torch_compile=True)
    assert "did not compile, decoding eagerly: inductor: no lowering for this op" in caplog.text
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_enforce_eager_turns_torch_compile_off(llama_demo):
    assert runner(llama_demo, torch_compile=True, enforce_eager=True).compiled is None


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_the_batch_copy_multiplies_from_its_row_threshold_and_adds_its_bytes(method):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 128, generator=g)
    plain, copied = torch.nn.Module(), torch.nn.Module()
    for layer in (plain, copied):
        layer.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
        quantize_linear_(layer, {}, method)
    add_batch_copy(copied, {})
    dense = Int4Weight(weight).dequantize() if method == "int4" else None
    if dense is None:
        dense = copied.qweight.float() * copied.weight_scale[:, None]
    for rows in (1, BATCH_COPY_MIN_ROWS - 1):  # below the threshold: the quantized kernel, unchanged
        x = torch.randn(rows, 128, generator=g)
        assert torch.equal(quantized_linear(copied, x), quantized_linear(plain, x))
    for rows in (BATCH_COPY_MIN_ROWS, 16):  # from it: the copy, the same weights in bfloat16
        x = torch.randn(rows, 128, generator=g)
        expected = x @ dense.t()
        rel_error = float((quantized_linear(copied, x) - expected).abs().max() / expected.std())
        assert rel_error <= 0.03
    assert packed_bytes(copied) >= weight.numel() * 2 and packed_bytes(plain) == 0  # the copy's memory counts
