"""The cpu_paged attention backend: decode attention on CPU reading the KV pages in place.

Checked against the torch backend's padded gather + SDPA (which the model tests hold to Hugging Face)
on caches whose blocks are shuffled, with grouped-query heads, head sizes the kernel specializes (64,
128) and one it does not (32), a sliding window, bfloat16 (caches and queries, or a bfloat16 cache
under float32 queries), and a request split over threads. The
whole engine on it against Hugging Face's greedy tokens: tests/unit/test_paged_attention.py.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from raylane.models.attention import build_attention_metadata, paged_attention
from raylane.models.paged_kernel import select_attention_backend
from raylane.parallel import cpu_kernels

BLOCK = 16


def shuffled_batch(context_lens, heads, kv_heads, dim, dtype, seed=0):
    """Caches with each request's blocks at random places, its new token's K/V, and queries."""
    g = torch.Generator().manual_seed(seed)
    needs = [-(-n // BLOCK) for n in context_lens]
    order = (torch.randperm(sum(needs) + 3, generator=g) + 1).tolist()  # block 0 and spares left unused
    tables, start = [], 0
    for n in needs:
        tables.append(order[start : start + n])
        start += n
    shape = (sum(needs) + 4, BLOCK, kv_heads, dim)
    caches = [torch.randn(shape, generator=g).to(dtype) for _ in range(2)]
    rows = len(context_lens)
    q = torch.randn(rows, heads, dim, generator=g).to(dtype)
    k, v = (torch.randn(rows, kv_heads, dim, generator=g).to(dtype) for _ in range(2))
    return tables, caches, q, k, v


def attend(backend, tables, context_lens, query_lens, caches, q, k, v, window=None):
    """One layer's attention for a step on `backend`, on its own copy of the caches."""
    k_cache, v_cache = (c.clone() for c in caches)
    meta = build_attention_metadata(
        tables, context_lens, query_lens, BLOCK, sliding_window=window, backend=backend
    )
    return paged_attention(q, k, v, k_cache, v_cache, meta, scale=q.shape[-1] ** -0.5), meta


@pytest.mark.parametrize(
    "heads,kv_heads,dim",
    # SmolLM2's grouped heads; Llama-sized heads; a generic size; seven heads a KV head (Qwen2-7B's
    # grouping), which the kernel attends in runs of four and three
    [(9, 3, 64), (8, 2, 128), (4, 4, 32), (14, 2, 64)],
)
def test_decode_matches_the_padded_gather(heads, kv_heads, dim):
    context_lens = [1, 17, 300, 64, 129, 5]  # within a block, across blocks, a block's edge
    tables, caches, q, k, v = shuffled_batch(context_lens, heads, kv_heads, dim, torch.float32)
    decodes = [1] * len(context_lens)
    out, meta = attend("cpu_paged", tables, context_lens, decodes, caches, q, k, v)
    assert meta.groups[0].kv_slots is None  # nothing gathered: the kernel read the pages
    expected, _ = attend("torch", tables, context_lens, decodes, caches, q, k, v)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_a_sliding_window_attends_its_last_tokens_only():
    context_lens = [300, 41, 12]
    tables, caches, q, k, v = shuffled_batch(context_lens, 9, 3, 64, torch.float32, seed=1)
    whole, _ = attend("cpu_paged", tables, context_lens, [1, 1, 1], caches, q, k, v)
    # The engine releases blocks that left the window (-1 in the table): the kernel must not read them.
    tables[0][:15] = [-1] * 15  # tokens 0..239, all before 300 - 40
    out, _ = attend("cpu_paged", tables, context_lens, [1, 1, 1], caches, q, k, v, window=40)
    expected, _ = attend("torch", tables, context_lens, [1, 1, 1], caches, q, k, v, window=40)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out[0], whole[0])  # the window changed request 0's answer


def test_bfloat16_caches():
    context_lens = [200, 33, 7]
    tables, caches, q, k, v = shuffled_batch(context_lens, 9, 3, 64, torch.bfloat16, seed=2)
    out, _ = attend("cpu_paged", tables, context_lens, [1, 1, 1], caches, q, k, v)
    as_float = [c.float() for c in caches]
    expected, _ = attend("torch", tables, context_lens, [1, 1, 1], as_float, q.float(), k.float(), v.float())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, rtol=0, atol=2e-2)  # one bf16 rounding of the output


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 32)])
def test_float32_queries_over_a_bfloat16_cache(heads, kv_heads, dim):
    """`kv_cache_dtype: bfloat16` on a float32 model: the step's new keys and values are rounded once as
    they are written, and the answer is float32 attention over the rounded cache."""
    context_lens = [200, 33, 7, 1]
    tables, caches, q, k, v = shuffled_batch(context_lens, heads, kv_heads, dim, torch.float32, seed=7)
    halved = [c.to(torch.bfloat16) for c in caches]
    decodes = [1] * len(context_lens)
    out, _ = attend("cpu_paged", tables, context_lens, decodes, halved, q, k, v)
    rounded = [c.float() for c in halved]
    expected, _ = attend(
        "torch", tables, context_lens, decodes, rounded, q, k.bfloat16().float(), v.bfloat16().float()
    )
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    unrounded, _ = attend("torch", tables, context_lens, decodes, caches, q, k, v)
    assert not torch.allclose(out, unrounded, rtol=1e-5, atol=1e-5)  # the cache did hold bfloat16
    gathered, _ = attend("torch", tables, context_lens, decodes, halved, q, k, v)  # the torch backend too
    torch.testing.assert_close(gathered, expected, rtol=1e-5, atol=1e-5)


def test_one_request_split_over_threads():
    """Fewer requests than threads: each KV head's query heads run as work items of their own."""
    context_lens = [257]
    tables, caches, q, k, v = shuffled_batch(context_lens, 9, 3, 64, torch.float32, seed=3)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out, _ = attend("cpu_paged", tables, context_lens, [1], caches, q, k, v)
    finally:
        torch.set_num_threads(threads)
    expected, _ = attend("torch", tables, context_lens, [1], caches, q, k, v)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_a_mixed_step_keeps_prefill_chunks_on_the_gather_path():
    context_lens, query_lens = [90, 30, 200], [1, 30, 1]  # a decode, a whole prompt, a decode
    tables, caches, _, _, _ = shuffled_batch(context_lens, 9, 3, 64, torch.float32, seed=4)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(32, 9, 64, generator=g)
    k, v = (torch.randn(32, 3, 64, generator=g) for _ in range(2))
    out, meta = attend("cpu_paged", tables, context_lens, query_lens, caches, q, k, v)
    assert [grp.block_tables is not None for grp in meta.groups] == [True, False]
    expected, _ = attend("torch", tables, context_lens, query_lens, caches, q, k, v)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_auto_takes_it_on_cpu_and_says_why_not(monkeypatch, caplog):
    cpu = torch.device("cpu")
    assert select_attention_backend("auto", cpu, torch.float32, 64, 16) == "cpu_paged"
    assert select_attention_backend("auto", cpu, torch.bfloat16, 64, 16) == "cpu_paged"
    assert select_attention_backend("torch", cpu, torch.float32, 64, 16) == "torch"
    assert select_attention_backend("auto", cpu, torch.float16, 64, 16) == "torch"
    with pytest.raises(ValueError, match=r"^dtype: attention_backend cpu_paged .*float16"):
        select_attention_backend("cpu_paged", cpu, torch.float16, 64, 16)
    with pytest.raises(ValueError, match=r"^device: attention_backend cpu_paged .*CPU kernel"):
        select_attention_backend("cpu_paged", torch.device("cuda"), torch.float32, 64, 16)
    # No compiler on the machine: auto keeps the torch backend and logs why; asked for, an error.
    monkeypatch.setattr(
        cpu_kernels, "why_not_available", lambda: "raylane's C++ kernels did not build: no c++"
    )
    assert select_attention_backend("auto", cpu, torch.float32, 64, 16) == "torch"
    assert "did not build: no c++" in caplog.text
    with pytest.raises(ValueError, match=r"^attention_backend: .*did not build"):
        select_attention_backend("cpu_paged", cpu, torch.float32, 64, 16)


def test_a_table_the_cache_cannot_hold_is_refused_not_read():
    """The kernel reads memory where the tables point: a block outside the cache, or a context longer
    than its table row, is an error before anything is read."""
    tables, (k_cache, v_cache), q, _, _ = shuffled_batch([40, 20], 9, 3, 64, torch.float32, seed=6)
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    lens = torch.tensor([40, 20])
    cpu_kernels.load()
    torch.ops.raylane_cpu.paged_decode(q, k_cache, v_cache, padded, lens, 0.125, 0)  # a valid call runs
    outside = padded.clone()
    outside[1, 0] = k_cache.shape[0]
    with pytest.raises(RuntimeError, match="not in the cache"):
        torch.ops.raylane_cpu.paged_decode(q, k_cache, v_cache, outside, lens, 0.125, 0)
    with pytest.raises(RuntimeError, match="does not fit"):
        torch.ops.raylane_cpu.paged_decode(q, k_cache, v_cache, padded, torch.tensor([40, 49]), 0.125, 0)


def test_the_kernels_follow_torchs_vector_extensions():
    held = torch.backends.cpu.get_cpu_capability() == "AVX2"
    assert ("-mno-avx512f" in cpu_kernels.CFLAGS) == held


def test_the_avx2_build_passes_the_kernels_tests():
    """An AVX2-only CPU runs other code in both kernels (no AVX-512: 8-lane loops; int8 products with
    vpmaddubsw instead of VNNI). On an AVX-512 CPU that build is made by holding torch to AVX2
    (`ATEN_CPU_CAPABILITY=avx2`), and the kernels' tests run against it in a child pytest."""
    if "avx512f" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("no AVX-512 here: the other tests already run the AVX2 build")
    selected = ["tests/unit/test_cpu_paged_kernel.py", "tests/unit/test_quantization.py"]
    child = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *selected]
    child += ["-k", "kernel and not avx2_build"]
    env = os.environ | {"ATEN_CPU_CAPABILITY": "avx2"}
    root = Path(__file__).parents[2]
    result = subprocess.run(child, env=env, cwd=root, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout


def test_the_kernels_run_on_torchs_threads():
    """ATen's parallel_for runs on the calling thread in code built without OpenMP: the kernels would
    use one core of a rank's share whatever torch.set_num_threads says."""
    cpu_kernels.load()
    saved = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert torch.ops.raylane_cpu.parallel_threads() == threads
    finally:
        torch.set_num_threads(saved)


def test_every_process_builds_with_the_packaged_ninja(tmp_path):
    """A process whose PATH finds another ninja first (a system ninja-build, a Ray worker started
    without the environment's bin folder) still builds with the `ninja` package's: two ninja versions
    on one build folder each rebuilt all the kernels (~30 s) after the other had run."""
    other = tmp_path / "other-ninja"
    other.mkdir()
    calls = tmp_path / "calls"
    (other / "ninja").write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexit 1\n')
    (other / "ninja").chmod(0o755)
    env = os.environ | {"PATH": f"{other}{os.pathsep}{os.environ.get('PATH', '')}"}
    load = "from raylane.parallel import cpu_kernels; print(cpu_kernels.why_not_available())"
    result = subprocess.run(
        [sys.executable, "-c", load], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.stdout.strip() == "None", result.stdout + result.stderr[-2000:]
    assert not calls.exists(), calls.read_text()
