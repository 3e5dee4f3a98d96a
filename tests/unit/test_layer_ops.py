"""raylane's fused float32 layer ops on CPU (parallel/csrc/layer_ops.cpp) against the torch ops they
replace in eager steps: RMSNorm, the residual add and RMSNorm after it, SiLU-and-multiply, and rotary
embedding in place on views of a fused QKV output. The engine on them against Hugging Face's greedy
tokens: tests/unit/test_engine_vs_hf.py, test_models.py and test_real_model.py, eager float32 on CPU."""

import contextlib

import pytest
import torch
import torch.nn.functional as F

from raylane.models.layers import RMSNorm, apply_rotary, rotate_qk
from raylane.parallel import cpu_kernels


@contextlib.contextmanager
def torch_ops():
    """The layers take torch's ops (the reference) inside."""
    saved = cpu_kernels._layer_ops
    cpu_kernels._layer_ops = False
    try:
        yield
    finally:
        cpu_kernels._layer_ops = saved


@pytest.mark.parametrize("rows,width", [(1, 576), (37, 576), (5, 100)])
def test_rms_norm_and_the_residual_add_before_it(rows, width):
    g = torch.Generator().manual_seed(rows)
    norm = RMSNorm(width, eps=1e-5)
    norm.weight.copy_(torch.rand(width, generator=g) + 0.5)
    x, delta = torch.randn(rows, width, generator=g) * 3, torch.randn(rows, width, generator=g)
    assert cpu_kernels.fuses_layer_ops(x)
    fused, (fused_sum, fused_norm) = norm(x), norm.add_and_norm(x, delta)
    with torch_ops():
        expected, (expected_sum, expected_norm) = norm(x), norm.add_and_norm(x, delta)
    torch.testing.assert_close(fused, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused_sum, expected_sum, rtol=0, atol=0)
    torch.testing.assert_close(fused_norm, expected_norm, rtol=1e-5, atol=1e-6)


def test_silu_and_mul_over_the_whole_float_range():
    """Gates from -120 to 120 (the kernel's exp clamps outside [-87, 88]) and ordinary ones."""
    g = torch.Generator().manual_seed(0)
    gate = torch.cat([torch.linspace(-120, 120, 4001), torch.randn(2143, generator=g)]).view(4, -1)
    up = torch.randn(gate.shape, generator=g)
    out = torch.ops.raylane_cpu.silu_and_mul(torch.cat([gate, up], dim=1))
    torch.testing.assert_close(out, F.silu(gate) * up, rtol=2e-6, atol=1e-30)


def test_silu_and_mul_leaves_the_threads_denormals_as_they_were():
    """The kernel runs with denormals flushed (parallel/csrc/flush_denormals.h: speed, on Intel);
    torch's ops after it on the same thread still keep denormal values."""
    assert cpu_kernels.why_not_available() is None
    tiny = torch.tensor([1e-39, -3e-40])  # denormal float32s
    assert torch.all(tiny * 1.0 != 0)
    torch.ops.raylane_cpu.silu_and_mul(torch.randn(1, 64))  # one row: it runs on this thread
    assert torch.all(tiny * 1.0 != 0) and torch.all(tiny / 2 != 0)


@pytest.mark.parametrize("rows", [1, 21])
def test_rotary_rotates_q_and_k_in_place_and_leaves_v(rows):
    heads, kv_heads, dim = 9, 3, 64
    g = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=g)
    angles = torch.rand(rows, dim // 2, generator=g) * 50
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)

    def split(t):
        q, k, v = t.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        return q.reshape(rows, heads, dim), k.reshape(rows, kv_heads, dim), v

    q, k, _ = split(qkv.clone())
    expected = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    q, k, v = split(qkv.clone())
    assert cpu_kernels.fuses_layer_ops(q)
    out_q, out_k = rotate_qk(q, k, cos, sin)
    assert out_q.data_ptr() == q.data_ptr()  # in place, on the views
    torch.testing.assert_close(out_q, expected[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out_k, expected[1], rtol=1e-5, atol=1e-6)
    assert torch.equal(v, split(qkv)[2])


def test_compiled_graphs_keep_torchs_ops():
    """Inside torch.compile the layers do not call the fused ops (inductor fuses its own)."""
    norm = RMSNorm(64)
    x = torch.randn(3, 64)
    compiled = torch.compile(norm, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x), norm(x), rtol=1e-5, atol=1e-6)
    graph = torch._dynamo.explain(norm)(x).graphs[0]
    assert "raylane_cpu" not in str(graph.code)
