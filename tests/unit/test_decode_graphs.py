"""Decode steps in CUDA graphs: the batch sizes captured, the padding, and the static buffers.

No GPU here, so no graph is captured: `capture_decode_graphs(capture=False)` keeps everything a
graph needs (static buffers refilled in place each step, padded rows in the scratch block) and runs
the forward eagerly where a GPU would replay the graph. The flash_varlen backend (the one captured)
runs with the pure-torch reference of its kernel in the CUDA kernel's place
(tests/unit/test_paged_attention.py). What only a GPU shows (capture itself, NCCL inside a graph,
the graph pool's memory, speed) is left to `bench/gpu_check.sh`.
"""

import pytest
import torch

import raylane.models.paged_kernel as paged_kernel
from raylane.config import EngineConfig
from raylane.engine import LLM, SamplingParams
from raylane.engine.cuda_graph import capture_sizes, graph_size, pad_decode_batch
from raylane.engine.model_runner import ModelInput, ModelRunner
from tests.hf_models import load_hf_model, make_checkpoint
from tests.unit.test_paged_attention import varlen_attn_reference

NUM_BLOCKS = 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(make_checkpoint(tmp_path_factory.mktemp("llama"), "llama"))


@pytest.fixture
def runner(checkpoint, request, monkeypatch):
    """A CPU runner on `request.param` (torch, or flash_varlen with the kernel's reference: selected
    by hand, as auto would on a GPU), with three requests prefilled."""
    backend = request.param
    block = 256 if backend == "flash_varlen" else 16
    config = EngineConfig(
        model=checkpoint,
        device="cpu",
        block_size=block,
        max_num_seqs=8,
        max_model_len=512,
        num_kv_blocks=NUM_BLOCKS,
    )
    runner = ModelRunner(config)
    if backend == "flash_varlen":
        monkeypatch.setattr(paged_kernel, "_KERNEL", varlen_attn_reference)
        runner.attention_backend = "flash_varlen"
    runner.allocate_kv_cache(NUM_BLOCKS)
    assert runner.graphs is None  # never on CPU
    lengths = [5, 300, 40] if block == 256 else [5, 30, 40]
    runner.tables = [[0, 1], [5, 3], [9, 2]] if block == 256 else [[0], [7, 3], [11, 2, 4]]
    runner.lengths = lengths
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]
    runner.execute_model(
        ModelInput(
            token_ids=[t for p in prompts for t in p],
            positions=[i for n in lengths for i in range(n)],
            block_tables=runner.tables,
            context_lens=lengths,
            query_lens=lengths,
            sample_indices=[],
        )
    )
    return runner


def decode(runner, rows: list[int], step: int = 0) -> ModelInput:
    """The next token of requests `rows` (`step` tokens after their prompts)."""
    ctx = [runner.lengths[r] + step + 1 for r in rows]
    return ModelInput(
        token_ids=[17 + 5 * r + step for r in rows],
        positions=[c - 1 for c in ctx],
        block_tables=[runner.tables[r] for r in rows],
        context_lens=ctx,
        query_lens=[1] * len(rows),
        sample_indices=list(range(len(rows))),
    )


def caches(runner) -> list[torch.Tensor]:
    return [t.clone() for layer in runner.model.attention_layers() for t in (layer.k_cache, layer.v_cache)]


def restore(runner, saved: list[torch.Tensor]) -> None:
    tensors = [t for layer in runner.model.attention_layers() for t in (layer.k_cache, layer.v_cache)]
    for tensor, copy in zip(tensors, saved, strict=True):
        tensor.copy_(copy)


def test_batches_pad_to_the_next_captured_size():
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    assert capture_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    assert capture_sizes(1) == [1]
    sizes = capture_sizes(48)
    assert graph_size([1] * 3, sizes) == 4
    assert graph_size([1] * 33, sizes) == 48
    assert graph_size([1] * 49, sizes) is None  # more than max_num_seqs: eager
    assert graph_size([1, 7, 1], sizes) is None  # a prefill chunk in the step: eager
    assert graph_size([], sizes) is None


@pytest.mark.parametrize("runner", ["torch", "flash_varlen"], indirect=True)
def test_padded_rows_change_neither_real_rows_nor_any_requests_kv(runner):
    """Three decodes padded to four: the real rows' logits are the unpadded step's, and the padding
    row's K/V lands in the scratch block only (beyond the block manager's blocks, owned by no request)."""
    for layer in runner.model.attention_layers():  # a mark the padding row's write must replace
        layer.k_cache[NUM_BLOCKS].fill_(7.0)
    before = caches(runner)
    batch = decode(runner, [0, 1, 2])
    plain = runner.execute_model(batch)
    plain_caches = caches(runner)
    restore(runner, before)
    padded = runner.execute_model(pad_decode_batch(batch, 4, runner.scratch_block))
    torch.testing.assert_close(padded, plain, rtol=0, atol=1e-5)
    assert runner.scratch_block == NUM_BLOCKS  # the block manager hands out 0 .. NUM_BLOCKS - 1
    # The same values in every request's blocks (a matmul over 4 rows may round differently from
    # one over 3, so not bitwise); the padding row's write replaced the mark in the scratch block.
    for after, expected in zip(caches(runner), plain_caches, strict=True):
        torch.testing.assert_close(after[:NUM_BLOCKS], expected[:NUM_BLOCKS], rtol=0, atol=1e-5)
    for layer in runner.model.attention_layers():
        assert not torch.equal(
            layer.k_cache[NUM_BLOCKS, 0], torch.full_like(layer.k_cache[NUM_BLOCKS, 0], 7.0)
        )


@pytest.mark.parametrize("runner", ["flash_varlen"], indirect=True)
def test_decode_steps_through_the_static_buffers_match_eager_steps(runner):
    """Steps of 3, then 1, then 2 requests: each refills the buffers a graph reads (a smaller batch
    after a larger one must not see the larger one's rows) and gives the eager step's logits."""
    graphs = runner.capture_decode_graphs(capture=False)
    assert graphs.sizes == [1, 2, 4, 8]
    for step, rows in enumerate([[0, 1, 2], [1], [2, 0]]):
        batch = decode(runner, rows, step)
        before = caches(runner)
        runner.graphs = None
        eager = runner.execute_model(batch)
        eager_caches = caches(runner)
        restore(runner, before)
        runner.graphs = graphs
        assert graphs.size_for(batch) == {3: 4, 1: 1, 2: 2}[len(rows)]
        torch.testing.assert_close(runner.execute_model(batch), eager, rtol=0, atol=1e-5)
        for after, expected in zip(caches(runner), eager_caches, strict=True):
            # Same values (a matmul over 4 rows may round differently from one over 3: not bitwise).
            torch.testing.assert_close(after[:NUM_BLOCKS], expected[:NUM_BLOCKS], rtol=0, atol=1e-5)
    prefill = ModelInput([5, 6], [45, 46], [runner.tables[2]], [47], [2], [1])
    assert graphs.size_for(prefill) is None  # two new tokens: the eager path


@pytest.mark.parametrize("runner", ["flash_varlen"], indirect=True)
def test_graphs_only_on_cuda_with_the_flash_backend_unless_enforce_eager(runner):
    """A made-up CUDA device (none here): the switch, the backend and the device decide."""
    assert not runner.uses_cuda_graphs  # CPU
    runner.device = torch.device("cuda")
    assert runner.uses_cuda_graphs
    runner.config = runner.config.model_copy(update={"enforce_eager": True})
    assert not runner.uses_cuda_graphs
    runner.config = runner.config.model_copy(update={"enforce_eager": False})
    runner.attention_backend = "torch"
    assert not runner.uses_cuda_graphs


def test_the_engine_decoding_through_graph_buffers_generates_hugging_faces_tokens(checkpoint, monkeypatch):
    """The whole engine on flash_varlen (made up, as on a GPU) with its decode steps going through the
    graphs' static buffers (the eager stand-in for a replay): prompts of different lengths finish at
    different steps, so the batch shrinks through the captured sizes."""
    monkeypatch.setattr(paged_kernel, "_KERNEL", varlen_attn_reference)
    monkeypatch.setattr(
        "raylane.engine.model_runner.resolve_attention", lambda *args: ("flash_varlen", args[-1])
    )
    llm = LLM(checkpoint, block_size=256, num_kv_blocks=8, max_num_seqs=4, enable_prefix_caching=False)
    runner = llm.engine.runner
    runner.graphs = runner.capture_decode_graphs(capture=False)
    sizes_run = []
    run = runner.graphs.run
    monkeypatch.setattr(
        runner.graphs, "run", lambda batch, size: (sizes_run.append(size), run(batch, size))[1]
    )
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (9, 30, 4)]
    budgets = [6, 10, 3]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in budgets]
    outputs = llm.generate(prompts, params)
    assert {4, 2, 1} <= set(sizes_run)  # 3 requests pad to 4; then 2; then 1
    hf = load_hf_model(checkpoint)
    hf.generation_config.eos_token_id = None  # both sides run to the token count
    for prompt, n, out in zip(prompts, budgets, outputs, strict=True):
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
        assert out.outputs[0].token_ids == expected[0, len(prompt) :].tolist()
