"""Speculative decoding: greedy output equals decoding without it (ngram and draft model, batches
mixing long and short requests, drafts trimmed by the token budget), sampled output follows the
target distribution, and the counters add up."""

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig

from raylane.engine import LLM, SamplingParams
from raylane.engine.request import Request
from raylane.engine.sampler import _filter
from raylane.engine.spec_decode import RejectionSampler
from raylane.engine.spec_decode.ngram import ngram_lookup
from raylane.models.demo import LLAMA
from tests.hf_models import TINY_CONFIG, make_checkpoint

NGRAM = dict(method="ngram", num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=2)
WINDOW = 16


def random_prompts(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def demo(demo_models) -> str:
    return str(demo_models[LLAMA])


@pytest.fixture(scope="module")
def windowed(tmp_path_factory) -> str:
    """A Mistral-style model whose attention window makes its continuation depend only on the last
    few tokens (RoPE is relative): a prompt P + continuation(P) + P continues with continuation(P)
    again, like a code edit re-emitting unchanged lines. That is what lets ngram drafts be accepted."""
    config = MistralConfig(**dict(TINY_CONFIG, max_position_embeddings=1024, sliding_window=WINDOW))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = tmp_path_factory.mktemp("windowed")
    model.save_pretrained(path)
    return str(path)


def greedy(llm: LLM, prompts, max_tokens: int = 24, **params) -> list[list[int]]:
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **params)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]


def repeating_prompts(llm: LLM, vocab: int) -> list[list[int]]:
    """P + continuation(P) + P for several P: outputs repeat a span of their prompt. A token depends
    on the last layers x (WINDOW - 1) tokens, which P must hold."""
    receptive_field = 2 * (WINDOW - 1)
    bases = random_prompts(vocab, (receptive_field + 1, receptive_field + 9, 3 * WINDOW), seed=5)
    conts = greedy(llm, bases, max_tokens=40)
    return [b + c + b for b, c in zip(bases, conts, strict=True)]


# --- ngram -------------------------------------------------------------------------------------


def test_ngram_lookup_takes_what_followed_the_latest_match():
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert ngram_lookup(tokens, 3, 2, 2) == [7, 8]  # the later of the two earlier "1 2 3"
    assert ngram_lookup([5, 6, 7, 8], 3, 1, 4) == []
    assert ngram_lookup([4, 4, 4], 2, 1, 3) == [4]  # overlapping match at the very start
    # A byte pattern that matches across token boundaries is not a match.
    assert ngram_lookup([0x0100, 0x0200, 0x0300, 0x01000000, 2], 1, 1, 2) == []


def test_ngram_greedy_equals_plain_and_accepts_repeated_spans(windowed):
    plain, spec = LLM(windowed, num_kv_blocks=256), LLM(windowed, num_kv_blocks=256, speculative_config=NGRAM)
    prompts = repeating_prompts(plain, 512) + random_prompts(512, (3, 70), seed=6)
    expected = greedy(plain, prompts, max_tokens=40)
    assert greedy(spec, prompts, max_tokens=40) == expected
    stats = spec.engine.spec_decode_stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens >= stats.num_accepted_tokens
    assert stats.acceptance_rate > 0.5  # the repeated spans are drafted and accepted
    assert spec.engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("model", ["demo", "llama"])
def test_ngram_greedy_equals_plain_on_mixed_batches(model, demo, checkpoint):
    path = demo if model == "demo" else checkpoint("llama")
    vocab = 4000 if model == "demo" else 512
    short_and_long = random_prompts(vocab, (4, 90, 11, 150, 30))
    prompts = short_and_long + [p * 3 for p in short_and_long[:3]]  # prompts that repeat themselves
    expected = greedy(LLM(path, num_kv_blocks=256), prompts)
    # A 24-token budget with block size 4: chunked prefills share steps with drafted decodes, and
    # drafts get trimmed when the budget runs out. Random weights do not copy their prompts, so
    # one-token lookups make sure drafts are proposed (and mostly rejected).
    ngram = dict(NGRAM, prompt_lookup_min=1)
    settings = dict(num_kv_blocks=256, block_size=4, max_num_batched_tokens=24, speculative_config=ngram)
    spec = LLM(path, **settings)
    assert greedy(spec, prompts) == expected
    assert spec.engine.spec_decode_stats.num_drafts > 0


def test_requests_with_penalties_or_logprobs_skip_speculation(windowed):
    llm = LLM(windowed, num_kv_blocks=256, speculative_config=NGRAM)
    prompts = repeating_prompts(LLM(windowed, num_kv_blocks=256), 512)
    plain = LLM(windowed, num_kv_blocks=256)
    assert greedy(llm, prompts, logprobs=2) == greedy(plain, prompts, logprobs=2)
    assert llm.engine.spec_decode_stats.num_drafts == 0
    penalized = dict(repetition_penalty=1.3)
    assert greedy(llm, prompts, **penalized) == greedy(plain, prompts, **penalized)
    assert llm.engine.spec_decode_stats.num_drafts == 0


# --- draft model -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def draft_for(tmp_path_factory):
    """A one-layer random Llama draft with the target's vocabulary, built here."""

    def make(vocab: int) -> str:
        path = tmp_path_factory.mktemp(f"draft{vocab}")
        overrides = dict(vocab_size=vocab, num_hidden_layers=1, max_position_embeddings=2048)
        return str(make_checkpoint(path, "llama", seed=7, **overrides))

    return make


@pytest.mark.parametrize("model", ["demo", "llama"])
def test_draft_model_greedy_equals_plain(model, demo, checkpoint, draft_for):
    path = demo if model == "demo" else checkpoint("llama")
    vocab = 4096 if model == "demo" else 512
    prompts = random_prompts(min(vocab, 4000), (4, 90, 11, 150, 30))
    expected = greedy(LLM(path, num_kv_blocks=256), prompts)
    settings = dict(num_kv_blocks=256, block_size=4, max_num_batched_tokens=32)
    for draft in (draft_for(vocab), path):  # a different small model; the target itself (all accepted)
        spec = dict(method="draft_model", model=draft, num_speculative_tokens=3)
        llm = LLM(path, speculative_config=spec, **settings)
        assert greedy(llm, prompts) == expected
        stats = llm.engine.spec_decode_stats
        assert stats.num_drafts > 0
        if draft == path:
            assert stats.acceptance_rate == 1.0
        assert llm.engine.proposer.block_manager.num_used_blocks == 0  # draft KV freed with the requests


def test_seeded_sampling_with_speculation_is_reproducible(demo):
    spec = dict(method="draft_model", model=demo, num_speculative_tokens=3)
    llm = LLM(demo, num_kv_blocks=128, speculative_config=spec)
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=20, seed=11, ignore_eos=True)
    first = llm.generate([[5, 6, 7, 8]], params)[0].outputs[0].token_ids
    assert llm.generate([[5, 6, 7, 8]], params)[0].outputs[0].token_ids == first
    assert len(first) == 20
    # Target = draft: every draft drawn from q = p is accepted (min(1, p/q) = 1).
    assert llm.engine.spec_decode_stats.acceptance_rate > 0.99


# --- rejection sampling preserves the target distribution --------------------------------------

VOCAB, K, SAMPLES = 6, 2, 12_000
CHI2_999 = 20.52  # chi-square 99.9% quantile, 5 degrees of freedom


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0  # nothing outside the target's support
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize("draft", ["draft_model", "ngram"])
@pytest.mark.parametrize(
    "params", [dict(temperature=1.0), dict(temperature=0.7, top_k=4)], ids=["t1", "topk"]
)
def test_rejection_sampling_follows_the_target_distribution(draft, params):
    g = torch.Generator().manual_seed(0)
    target_logits = torch.randn(K + 1, VOCAB, generator=g) * 1.5
    q = torch.softmax(torch.randn(K, VOCAB, generator=g) * 1.5, dim=-1)
    sp = SamplingParams(**params)
    p = torch.stack([_filter(target_logits[i], sp) for i in range(K + 1)])
    sampler = RejectionSampler(torch.Generator().manual_seed(1))
    request = Request("r", [1], sp)
    first, second = torch.zeros(VOCAB), torch.zeros(VOCAB)
    fixed = [3, 1]  # the ngram proposer's deterministic drafts
    for _ in range(SAMPLES):
        if draft == "ngram":
            drafts, probs = fixed, None
        else:
            drafts = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(K)]
            probs = q
        tokens = sampler(target_logits, drafts, probs, request)
        assert 1 <= len(tokens) <= K + 1
        first[tokens[0]] += 1
        # The target's logits at position 1 are those after drafts[0]: only meaningful when accepted.
        if len(tokens) > 1:
            second[tokens[1]] += 1
    assert chi2(first, p[0]) < CHI2_999
    assert chi2(second, p[1]) < CHI2_999
