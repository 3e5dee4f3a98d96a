"""The flash_varlen attention backend's arguments, checked on CPU.

No GPU here, so FlashAttention's CUDA kernel cannot run: `varlen_attn_reference` below computes what
torch's `varlen_attn` computes for a paged cache (the contract in `models/paged_kernel.py`: pages
through `block_table`, `seqused_k` keys per request, bottom-right aligned causal masks, windows as
(left, right)) and checks the kernel's preconditions (int32 metadata, pages of a multiple of 256).
The tests put it in the kernel's place and compare with the torch backend, which the other model tests
hold to Hugging Face. What only a GPU shows (the kernel itself, speed) is `bench/gpu_check.sh`'s part.
"""

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, MistralConfig

import raylane.models.paged_kernel as paged_kernel
from raylane.config import EngineConfig
from raylane.engine import LLM, SamplingParams
from raylane.engine.block_manager import NULL_BLOCK
from raylane.models.attention import build_attention_metadata, paged_attention
from raylane.models.paged_kernel import PAGE_MULTIPLE, resolve_attention, select_attention_backend
from tests.hf_models import TINY_CONFIG

BLOCK = PAGE_MULTIPLE
CUDA = torch.device("cuda")


def varlen_attn_reference(
    query,
    key,
    value,
    cu_seq_q,
    cu_seq_k,
    max_q,
    max_k,
    *,
    scale,
    window_size,
    enable_gqa,
    seqused_k,
    block_table,
):
    """torch's `varlen_attn` with a paged cache, computed per request in float32 on any device."""
    for t in (cu_seq_q, cu_seq_k, seqused_k, block_table):
        assert t.dtype == torch.int32, "the kernel's metadata tensors are int32"
    num_pages, page, num_kv_heads, head_dim = key.shape
    assert page % 256 == 0, "Paged KV cache block size must be divisible by 256"
    batch = cu_seq_q.numel() - 1
    assert block_table.shape[0] == batch and seqused_k.shape == (batch,) and cu_seq_k.shape == (batch + 1,)
    assert enable_gqa == (query.shape[1] != num_kv_heads) and query.shape[1] % num_kv_heads == 0
    left, right = window_size
    out = torch.empty_like(query)
    for b in range(batch):
        q = query[cu_seq_q[b] : cu_seq_q[b + 1]].float()
        n_q, n_k = q.shape[0], int(seqused_k[b])
        assert n_q <= max_q and n_k <= max_k and n_k <= block_table.shape[1] * page
        pages = block_table[b, : -(-n_k // page)].long()
        assert bool((pages >= 0).all() and (pages < num_pages).all())
        k = key[pages].reshape(-1, num_kv_heads, head_dim)[:n_k].float()
        v = value[pages].reshape(-1, num_kv_heads, head_dim)[:n_k].float()
        group = query.shape[1] // num_kv_heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        # Bottom-right alignment: query row i sits at key position i + n_k - n_q.
        diag = torch.arange(n_q)[:, None] + n_k - n_q
        j = torch.arange(n_k)[None, :]
        allowed = torch.ones(n_q, n_k, dtype=torch.bool)
        if right >= 0:
            allowed &= j <= diag + right
        if left >= 0:
            allowed &= j >= diag - left
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        out[cu_seq_q[b] : cu_seq_q[b + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out


@pytest.fixture
def reference_kernel(monkeypatch):
    """The CUDA kernel's place taken by its reference (no GPU here)."""
    monkeypatch.setattr(paged_kernel, "_KERNEL", varlen_attn_reference)


def test_the_reference_is_causal_attention_and_aligns_a_chunk_to_the_end_of_its_context():
    """The reference against SDPA: a whole prompt is plain causal attention; a chunk of the last
    3 queries of the same context gives the same rows (FlashAttention-2's bottom-right causal)."""
    g = torch.Generator().manual_seed(0)
    n, heads, dim = 300, 2, 8
    q, k, v = (torch.randn(n, heads, dim, generator=g) for _ in range(3))
    pool_k = torch.zeros(2, BLOCK, heads, dim)
    pool_v = torch.zeros(2, BLOCK, heads, dim)
    pool_k.view(-1, heads, dim)[:n], pool_v.view(-1, heads, dim)[:n] = k, v
    expected = F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in (q, k, v)), is_causal=True)
    expected = expected.transpose(0, 1)

    def run(rows):
        i32 = dict(dtype=torch.int32)
        return varlen_attn_reference(
            q[-rows:], pool_k, pool_v, torch.tensor([0, rows], **i32), torch.tensor([0, n], **i32), rows, n,
            scale=dim**-0.5, window_size=(-1, 0), enable_gqa=False,
            seqused_k=torch.tensor([n], **i32), block_table=torch.tensor([[0, 1]], **i32),
        )  # fmt: skip

    torch.testing.assert_close(run(n), expected)
    torch.testing.assert_close(run(3), expected[-3:])


def mixed_batch():
    """Decodes and prefill chunks with cached prefixes, blocks out of order, partial last pages, and
    (for the windowed run) a first block released outside the window (NULL_BLOCK)."""
    g = torch.Generator().manual_seed(1)
    blocks = torch.randperm(16, generator=g).tolist()
    context_lens = [700, 5, 257, 600, 300, 1]
    query_lens = [1, 1, 1, 44, 300, 1]  # three decodes, a chunk after a 556-token prefix, a whole prompt
    tables = []
    for ctx in context_lens:
        n = -(-ctx // BLOCK)
        tables.append(blocks[:n])
        blocks = blocks[n:]
    return tables, context_lens, query_lens


@pytest.mark.parametrize("window", [None, 300], ids=["full", "sliding-window"])
@pytest.mark.parametrize("heads", [(4, 2), (4, 4)], ids=["gqa", "mha"])
def test_kernel_arguments_give_the_torch_backends_outputs_for_a_mixed_batch(reference_kernel, window, heads):
    tables, context_lens, query_lens = mixed_batch()
    if window is not None:  # request 0 decodes at 699: its first block (0..255) is before 699 - 300
        tables[0] = [NULL_BLOCK, *tables[0][1:]]
    num_heads, num_kv_heads = heads
    g = torch.Generator().manual_seed(2)
    n, dim = sum(query_lens), 16
    q = torch.randn(n, num_heads, dim, generator=g)
    k, v = torch.randn(n, num_kv_heads, dim, generator=g), torch.randn(n, num_kv_heads, dim, generator=g)
    cache = torch.randn(2, 16, BLOCK, num_kv_heads, dim, generator=g)  # cached prefixes: whatever is there

    def run(backend):
        k_cache, v_cache = cache[0].clone(), cache[1].clone()
        meta = build_attention_metadata(
            tables, context_lens, query_lens, BLOCK, sliding_window=window, backend=backend
        )
        return paged_attention(q, k, v, k_cache, v_cache, meta, dim**-0.5), k_cache, v_cache

    torch_out, torch_k, torch_v = run("torch")
    flash_out, flash_k, flash_v = run("flash_varlen")
    torch.testing.assert_close(flash_out, torch_out)
    assert torch.equal(flash_k, torch_k) and torch.equal(flash_v, torch_v)  # same slots written


def test_the_kernel_arguments_are_the_kernels_types_and_shapes():
    tables, context_lens, query_lens = mixed_batch()
    meta = build_attention_metadata(
        tables, context_lens, query_lens, BLOCK, sliding_window=300, backend="flash_varlen"
    )
    args = meta.paged
    assert meta.groups == []  # one call for the whole step: nothing padded per group
    assert args.cu_seq_q.tolist() == [0, 1, 2, 3, 47, 347, 348]
    assert args.seqused_k.tolist() == context_lens
    assert args.block_table.shape == (6, 3) and args.block_table.dtype == torch.int32
    assert (args.max_q, args.max_k, args.window_size) == (300, 700, (299, 0))
    full = build_attention_metadata(tables, context_lens, query_lens, BLOCK, backend="flash_varlen")
    assert full.paged.window_size == (-1, 0)


@pytest.fixture(scope="module")
def windowed_checkpoint(tmp_path_factory):
    """A Mistral-shaped tiny model with a 40-token window, so a 300-token prompt's first block dies."""
    torch.manual_seed(0)
    config = MistralConfig(**TINY_CONFIG, sliding_window=40)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    path = tmp_path_factory.mktemp("mistral")
    model.save_pretrained(path)
    model.generation_config.eos_token_id = None
    return str(path), model


def test_the_engine_on_the_flash_backend_generates_hugging_faces_tokens(windowed_checkpoint, monkeypatch):
    """The whole engine with the runner on flash_varlen (selected as on a GPU: made up here) and the
    reference in the kernel's place: chunked prefills beside decodes, a window releasing a block."""
    path, hf = windowed_checkpoint
    calls = []

    def recording_kernel(query, *args, **kwargs):
        calls.append((kwargs["seqused_k"].numel(), args[4]))  # requests, max_q of the call
        return varlen_attn_reference(query, *args, **kwargs)

    monkeypatch.setattr(paged_kernel, "_KERNEL", recording_kernel)
    monkeypatch.setattr(
        "raylane.engine.model_runner.resolve_attention", lambda *args: ("flash_varlen", args[-1])
    )
    llm = LLM(path, block_size=BLOCK, num_kv_blocks=8, max_num_batched_tokens=64, enable_prefix_caching=False)
    assert llm.engine.runner.attention_backend == "flash_varlen"
    generates_hugging_faces_tokens(llm, hf)
    assert any(n > 1 and max_q > 1 for n, max_q in calls)  # a prefill chunk and decodes in one call


def test_the_engine_on_cpu_paged_generates_hugging_faces_tokens(windowed_checkpoint):
    """The same on the cpu_paged backend (raylane's C++ decode kernel), with 16-token blocks."""
    path, hf = windowed_checkpoint
    llm = LLM(path, attention_backend="cpu_paged", max_num_batched_tokens=64, enable_prefix_caching=False)
    assert llm.engine.runner.attention_backend == "cpu_paged"
    generates_hugging_faces_tokens(llm, hf)


def generates_hugging_faces_tokens(llm: LLM, hf) -> None:
    """Prompts of 300, 37 and 5 tokens, 12 greedy tokens each, stepped through the engine: each
    request's tokens are `hf.generate`'s, and the 300-token prompt's first block left the window."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (300, 37, 5)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine, finished, released = llm.engine, {}, False
    ids = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
        released |= any(NULL_BLOCK in r.block_ids for r in engine.scheduler.running)
    assert released
    for rid, prompt in zip(ids, prompts, strict=True):
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)
        assert finished[rid] == expected[0, len(prompt) :].tolist()


# -- which backend runs ---------------------------------------------------------------------------


def test_auto_takes_flash_varlen_on_a_gpu_that_runs_it(caplog):
    """A made-up GPU (sm90, the kernel present): no CUDA device here."""
    gpu = dict(kernel_available=True, compute_capability=(9, 0))
    assert select_attention_backend("auto", CUDA, torch.bfloat16, 128, 256, **gpu) == "flash_varlen"
    assert select_attention_backend("torch", CUDA, torch.bfloat16, 128, 256, **gpu) == "torch"
    # Where it cannot run, auto falls back to the padded torch path and says why.
    assert select_attention_backend("auto", CUDA, torch.bfloat16, 128, 16, **gpu) == "torch"
    assert "set engine.block_size: 256" in caplog.text
    assert select_attention_backend("auto", CUDA, torch.float32, 128, 256, **gpu) == "torch"
    old_gpu = dict(kernel_available=True, compute_capability=(7, 5))
    assert select_attention_backend("auto", CUDA, torch.float16, 128, 256, **old_gpu) == "torch"
    older_torch = dict(kernel_available=False, compute_capability=(9, 0))
    assert select_attention_backend("auto", CUDA, torch.bfloat16, 128, 256, **older_torch) == "torch"


def test_flash_varlen_where_it_cannot_run_names_the_setting():
    gpu = dict(kernel_available=True, compute_capability=(9, 0))
    with pytest.raises(ValueError, match=r"^block_size: .*multiple of 256"):
        select_attention_backend("flash_varlen", CUDA, torch.bfloat16, 128, 16, **gpu)
    with pytest.raises(ValueError, match=r"^dtype: "):
        select_attention_backend("flash_varlen", CUDA, torch.float32, 128, 256, **gpu)
    with pytest.raises(ValueError, match=r"^device: "):
        select_attention_backend("flash_varlen", torch.device("cpu"), torch.bfloat16, 128, 256, **gpu)


def test_the_kernel_is_found_by_its_signature(monkeypatch):
    """torch 2.13 (installed here) has the paged kernel; an older varlen_attn without block_table is
    not taken for it."""
    import torch.nn.attention.varlen as varlen

    assert paged_kernel.varlen_kernel() is varlen.varlen_attn

    def older(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False, scale=None): ...

    monkeypatch.setattr(varlen, "varlen_attn", older)
    assert paged_kernel.varlen_kernel() is None


def test_an_unset_block_size_is_chosen_on_the_device():
    """`device: auto` does not know at validation whether a GPU will run the engine: the rank decides,
    256 where flash_varlen runs (a made-up sm90 with the kernel), 16 elsewhere, a set size kept."""
    gpu = dict(kernel_available=True, compute_capability=(9, 0))
    assert resolve_attention("auto", CUDA, torch.bfloat16, 128, None, **gpu) == ("flash_varlen", 256)
    assert resolve_attention("auto", torch.device("cpu"), torch.float32, 128, None) == ("cpu_paged", 16)
    assert resolve_attention("torch", CUDA, torch.bfloat16, 128, None, **gpu) == ("torch", 16)
    assert resolve_attention("auto", CUDA, torch.float32, 128, None, **gpu) == ("torch", 16)
    older_torch = dict(kernel_available=False, compute_capability=(9, 0))
    assert resolve_attention("auto", CUDA, torch.bfloat16, 128, None, **older_torch) == ("torch", 16)
    assert resolve_attention("auto", CUDA, torch.bfloat16, 128, 32, **gpu) == ("torch", 32)
    assert resolve_attention("auto", CUDA, torch.bfloat16, 128, 512, **gpu) == ("flash_varlen", 512)
    with pytest.raises(ValueError, match=r"^attention_backend: .*torch 2.13"):
        resolve_attention("flash_varlen", CUDA, torch.bfloat16, 128, None, **older_torch)


def test_the_engine_takes_its_block_size_from_the_ranks(windowed_checkpoint, monkeypatch):
    """The block manager, the context limit and the cache use the size the runner chose (made up
    here: 8), not the config's unset one; the engine still generates Hugging Face's tokens."""
    path, hf = windowed_checkpoint
    monkeypatch.setattr("raylane.engine.model_runner.resolve_attention", lambda *args: ("torch", 8))
    llm = LLM(path, num_kv_blocks=40, max_num_batched_tokens=64)
    assert llm.engine.config.block_size is None
    assert llm.engine.block_manager.block_size == 8 and llm.engine.max_model_len == 320
    prompt = list(range(3, 40))
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert out[0].outputs[0].token_ids == expected[0, len(prompt) :].tolist()


def test_config_leaves_the_block_size_to_the_device_and_refuses_a_flash_backend_it_cannot_run():
    assert EngineConfig(model="m").block_size is None
    assert EngineConfig(model="m", device="cuda").block_size is None
    assert EngineConfig(model="m", device="cuda", block_size=32).block_size == 32
    with pytest.raises(ValueError, match="block_size: attention_backend flash_varlen"):
        EngineConfig(model="m", device="cuda", attention_backend="flash_varlen", block_size=16)
    with pytest.raises(ValueError, match="attention_backend: flash_varlen is a CUDA kernel"):
        EngineConfig(model="m", device="cpu", attention_backend="flash_varlen")
    with pytest.raises(ValueError, match="kv_cache_dtype: bfloat16 with attention_backend flash_varlen"):
        EngineConfig(model="m", attention_backend="flash_varlen", dtype="float16", kv_cache_dtype="bfloat16")
    EngineConfig(model="m", attention_backend="flash_varlen", dtype="bfloat16", kv_cache_dtype="bfloat16")
