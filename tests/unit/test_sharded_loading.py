"""Sharded loading: each rank reads only its own slices of the checkpoint.

Ranks are simulated in one process by setting the parallel state the layers read when they
are built; the read volume is counted where `LazyWeight` turns a region into a tensor.
"""

import math

import pytest
import torch
from safetensors import safe_open

from raylane.models import load_model
from raylane.parallel import state
from raylane.parallel.lazy_weight import LazyWeight
from tests.hf_models import load_hf_model, make_checkpoint

DENSE = ["llama", "llama-tied", "qwen2", "qwen3"]
MOE = ["mixtral", "qwen3-moe"]


@pytest.fixture
def as_rank(monkeypatch):
    """as_rank(rank, tp, ep): build layers as that rank of a tp x ep group (layout of parallel/state)."""

    def set_rank(rank: int, tp: int, ep: int) -> None:
        ep_rank, tp_rank = state.rank_layout(rank, tp)
        monkeypatch.setattr(state._TP, "rank", tp_rank)
        monkeypatch.setattr(state._TP, "size", tp)
        monkeypatch.setattr(state._EP, "rank", ep_rank)
        monkeypatch.setattr(state._EP, "size", ep)

    return set_rank


@pytest.fixture
def elements_read(monkeypatch) -> list[int]:
    """Numbers of checkpoint elements read, one entry per region read."""
    reads: list[int] = []
    load = LazyWeight.load

    def counting(self):
        tensor = load(self)
        reads.append(tensor.numel())
        return tensor

    monkeypatch.setattr(LazyWeight, "load", counting)
    return reads


def checkpoint_elements(path, part: str = "") -> int:
    with safe_open(path / "model.safetensors", "pt") as f:
        return sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys() if part in name)  # noqa: SIM118


@pytest.mark.parametrize(
    ("family", "tp", "ep", "overrides"),
    [(f, 2, 1, {}) for f in DENSE + MOE]
    + [("llama", 2, 1, {"num_key_value_heads": 1}), ("llama", 4, 1, {})]
    + [(f, tp, ep, {}) for f in MOE for tp, ep in ((1, 2), (2, 2))],
)
def test_each_rank_reads_exactly_its_shard(tmp_path, as_rank, elements_read, family, tp, ep, overrides):
    path = make_checkpoint(tmp_path, family, **overrides)
    whole, experts = checkpoint_elements(path), checkpoint_elements(path, ".experts.")
    for rank in range(tp * ep):
        as_rank(rank, tp, ep)
        elements_read.clear()
        model, _ = load_model(path)
        held = sum(p.numel() for p in model.parameters())
        assert sum(elements_read) == held  # nothing read that the rank does not keep
        assert held < (0.7 if tp > 1 else 1) * whole
        held_experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
        assert held_experts * tp * ep == experts  # a distinct 1/(tp*ep) of every MoE layer


def test_fused_and_per_expert_layouts_give_every_rank_the_same_shard(tmp_path, as_rank):
    per_expert = make_checkpoint(tmp_path / "per_expert", "qwen3-moe")
    fused = tmp_path / "fused"
    load_hf_model(per_expert).save_pretrained(fused, save_original_format=False)
    for rank in range(4):
        as_rank(rank, 2, 2)
        a = dict(load_model(per_expert)[0].named_parameters())
        b = dict(load_model(fused)[0].named_parameters())
        for name in ("model.layers.0.mlp.experts.w13", "model.layers.1.mlp.experts.w2"):
            assert a[name].shape == b[name].shape
            torch.testing.assert_close(a[name], b[name], atol=0, rtol=0)


def test_lazy_weight_narrows_and_splits_like_a_tensor(tmp_path):
    from safetensors.torch import save_file

    full = torch.arange(4 * 6 * 5, dtype=torch.float32).reshape(4, 6, 5)
    save_file({"w": full}, tmp_path / "w.safetensors")
    with safe_open(tmp_path / "w.safetensors", "pt") as f:
        lazy = LazyWeight(f.get_slice("w"))
        assert lazy.shape == full.shape and lazy.dim() == 3
        view = lazy.narrow(1, 2, 3).narrow(-1, 1, 4)
        torch.testing.assert_close(view.load(), full.narrow(1, 2, 3).narrow(-1, 1, 4))
        for sizes in (2, [1, 3, 2]):
            for got, want in zip(lazy.split(sizes, dim=1), full.split(sizes, dim=1), strict=True):
                torch.testing.assert_close(got.load(), want)
        with pytest.raises(IndexError):
            lazy.narrow(0, 3, 2)
        with pytest.raises(ValueError, match="do not add up"):
            lazy.split([1, 1], dim=0)
