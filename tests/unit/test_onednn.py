"""oneDNN-prepacked weights on CPU (parallel/onednn.py): what a user would notice is the same greedy
tokens as Hugging Face and as torch's own matmul, and no doubled weight memory. How much faster it
is, is `raylane bench engine`'s business (bench/README.md), not a test's."""

import pytest
import torch

from raylane.config import EngineConfig
from raylane.engine import LLM, SamplingParams
from raylane.engine.model_runner import ModelRunner
from raylane.models import load_model
from raylane.parallel import onednn
from raylane.parallel.layers import LinearBase, ParallelLMHead
from raylane.parallel.moe import FusedMoE
from tests.hf_models import load_hf_model

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 33, 70)]


def hf_greedy(path: str, prompt_ids: list[list[int]], n: int) -> list[list[int]]:
    model = load_hf_model(path)
    model.generation_config.eos_token_id = None  # like ignore_eos (min_new_tokens would mask EOS out)
    out = []
    for p in prompt_ids:
        ids = model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, pad_token_id=0)
        out.append(ids[0, len(p) :].tolist())
    return out


@pytest.mark.parametrize("family", ["llama", "llama-tied", "qwen3-moe"])
def test_prepacked_engine_gives_hf_and_unpacked_greedy_tokens(checkpoint, family):
    path = checkpoint(family)
    runs = {}
    for prepack in (True, False):
        llm = LLM(path, num_kv_blocks=64, cpu_weight_prepack=prepack)
        runs[prepack] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts(), GREEDY)]
        model = llm.engine.runner.model
        packed = [m for m in model.modules() if getattr(m, "packed_weight", None) is not None]
        packed += [m for m in model.modules() if isinstance(m, FusedMoE) and m.packed_experts is not None]
        assert bool(packed) == prepack
    assert runs[True] == runs[False] == hf_greedy(path, prompts(), GREEDY.max_tokens)


@pytest.mark.parametrize("family", ["llama", "llama-tied", "qwen3-moe"])
def test_prepacking_replaces_dense_weights_instead_of_doubling_them(checkpoint, family):
    path = checkpoint(family)
    model, config = load_model(path, cpu_weight_prepack=True)
    linears = [m for m in model.modules() if isinstance(m, LinearBase | ParallelLMHead)]
    assert linears and all(m.packed_weight is not None for m in linears)
    assert all(not hasattr(m, "weight") for m in linears if not isinstance(m, ParallelLMHead))
    experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert all(not hasattr(m, "w13") and len(m.packed_experts[0]) == m.num_local_experts for m in experts)
    # A tied LM head leaves the embedding its dense table (the embedding still looks rows up in it).
    assert hasattr(model.lm_head, "weight") == config.tie_word_embeddings
    sizes = {
        prepack: ModelRunner(
            EngineConfig(model=path, num_kv_blocks=8, cpu_weight_prepack=prepack)
        ).weight_bytes()
        for prepack in (True, False)
    }
    tied_copy = config.vocab_size * config.hidden_size * 4 if config.tie_word_embeddings else 0
    assert sizes[True] <= sizes[False] + tied_copy


def test_packed_linear_matches_torch_for_3d_and_strided_inputs():
    g = torch.Generator().manual_seed(0)
    w, bias = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    packed = onednn.pack(w)
    for x in (
        torch.randn(2, 7, 64, generator=g),
        torch.randn(9, 128, generator=g)[:, ::2],
        torch.empty(0, 64),
    ):
        expected = torch.nn.functional.linear(x, w, bias)
        assert torch.allclose(onednn.linear(x, packed, bias), expected, atol=1e-4)
