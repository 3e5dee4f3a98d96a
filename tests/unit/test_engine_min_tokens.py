"""`min_tokens` as vLLM has it: stop tokens and EOS cannot be sampled until `min_tokens` are out.

The reference is Hugging Face's `generate(min_new_tokens=...)`, which masks every EOS id of the
generation config the same way. Checkpoints here get EOS ids chosen to be what the model would
greedily say first, so a request that merely ignored EOS for stopping (and still sampled it)
would differ from the reference at the first token.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from raylane.engine import LLM, SamplingParams
from raylane.engine.request import Request
from raylane.engine.sampler import mask_min_tokens
from raylane.engine.spec_decode import RejectionSampler
from tests.hf_models import VOCAB_SIZE, make_checkpoint
from tests.unit.test_spec_decode import NGRAM, repeating_prompts, windowed  # noqa: F401 (a fixture)

PROMPTS = [[5, 6, 7, 8, 9], list(range(40, 63))]
NEW_TOKENS = 12


def hf_greedy_tokens(path: str, prompt: list[int], max_new: int, **kwargs) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, pad_token_id=0, **kwargs
    )
    return out[0, len(prompt) :].tolist()


def set_eos(path: str, eos: list[int]) -> None:
    """The checkpoint's EOS ids, as a generation config lists them (e.g. Llama 3's several)."""
    GenerationConfig(eos_token_id=eos, bos_token_id=1, pad_token_id=0).save_pretrained(path)


@pytest.fixture(scope="module")
def eos_first(tmp_path_factory) -> tuple[str, list[int], list[list[int]]]:
    """A tiny Llama whose EOS ids are the first greedy token for each prompt and, as a second id,
    the third greedy token of the first prompt. Returns (path, eos ids, ignore-EOS continuations)."""
    path = str(make_checkpoint(tmp_path_factory.mktemp("eos-first"), "llama"))
    set_eos(path, [])
    free = [hf_greedy_tokens(path, p, NEW_TOKENS) for p in PROMPTS]
    eos = sorted({c[0] for c in free} | {free[0][2]})
    set_eos(path, eos)
    return path, eos, free


def test_greedy_min_tokens_equals_hf_min_new_tokens(eos_first):
    path, eos, free = eos_first
    llm = LLM(path, num_kv_blocks=64)
    # Without min_tokens the first token is EOS and ends the request: the masks below are what differ.
    for prompt, out in zip(
        PROMPTS, llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8)), strict=True
    ):
        assert out.outputs[0].token_ids == [free[PROMPTS.index(prompt)][0]]
        assert out.outputs[0].finish_reason == "stop"
    for min_tokens in (1, 3, 6):
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=min_tokens, logprobs=3)
        outputs = llm.generate(PROMPTS, params)
        for prompt, out in zip(PROMPTS, outputs, strict=True):
            expected = hf_greedy_tokens(path, prompt, NEW_TOKENS, min_new_tokens=min_tokens)
            tokens = out.outputs[0].token_ids
            assert tokens == expected, f"min_tokens={min_tokens}"
            assert not set(tokens[:min_tokens]) & set(eos)
            # An EOS after min_tokens still stops the request.
            assert out.outputs[0].finish_reason == ("stop" if tokens[-1] in eos else "length")
        # Logprobs are of the raw distribution (vLLM's default): at step 0 EOS is still the model's top token.
        first = outputs[0].outputs[0].logprobs[0]
        top = max(first.items(), key=lambda kv: kv[1].logprob)[0]
        assert top in eos and outputs[0].outputs[0].token_ids[0] not in eos


def test_stop_token_ids_are_masked_too_and_ignore_eos_leaves_eos_alone(eos_first):
    path, eos, free = eos_first
    llm = LLM(path, num_kv_blocks=64)
    # A stop token id that greedy decoding would produce at step 2: masked until min_tokens.
    stop = free[0][1]
    plain = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, stop_token_ids=[stop])
    assert llm.generate(PROMPTS[:1], plain)[0].outputs[0].token_ids == free[0][:2]
    masked = plain.clone(min_tokens=4)
    tokens = llm.generate(PROMPTS[:1], masked)[0].outputs[0].token_ids
    assert tokens[:1] == free[0][:1]  # EOS is allowed (ignore_eos) and is the greedy first token
    assert stop not in tokens[:4] and len(tokens) >= 4


@pytest.fixture(scope="module")
def half_eos(tmp_path_factory) -> tuple[str, list[int]]:
    """Every other token of the vocabulary is an EOS id: unmasked, sampling hits one within a few tokens."""
    path = str(make_checkpoint(tmp_path_factory.mktemp("half-eos"), "llama", seed=3))
    eos = list(range(2, VOCAB_SIZE, 2))
    set_eos(path, eos)
    return path, eos


@pytest.mark.parametrize("speculation", [None, "ngram"])
def test_sampled_output_has_no_eos_before_min_tokens(half_eos, speculation):
    path, eos = half_eos
    settings = {} if speculation is None else dict(speculative_config=dict(NGRAM, prompt_lookup_min=1))
    llm = LLM(path, num_kv_blocks=256, **settings)
    min_tokens = 10
    params = [
        SamplingParams(temperature=1.0, max_tokens=40, min_tokens=min_tokens, seed=s) for s in range(16)
    ]
    prompts = [[5, 6, 7, 8] * 3] * len(params)  # repeats itself: ngram lookup proposes drafts
    outputs = llm.generate(prompts, params)
    eos_set = set(eos)
    for out in outputs:
        tokens = out.outputs[0].token_ids
        assert len(tokens) >= min_tokens
        assert not eos_set & set(tokens[:min_tokens])
    # After min_tokens the mask is gone: with half the vocabulary EOS, requests stop on it.
    stopped = [o for o in outputs if o.outputs[0].finish_reason == "stop"]
    assert len(stopped) >= len(outputs) // 2
    assert all(o.outputs[0].token_ids[-1] in eos_set for o in stopped)
    if speculation:
        assert llm.engine.spec_decode_stats.num_drafts > 0


def test_verification_never_accepts_an_eos_draft_before_min_tokens():
    vocab, eos = 8, 3
    logits = torch.zeros(3, vocab)
    logits[:, eos] = 5.0  # the target's argmax at every position is EOS
    logits[:, 6] = 1.0
    sampler = RejectionSampler(torch.Generator().manual_seed(0))
    for greedy in (True, False):
        sp = SamplingParams(temperature=0 if greedy else 1.0, min_tokens=2, max_tokens=8)
        for _ in range(20 if not greedy else 1):
            request = Request("r", [1, 2], sp, eos_token_ids=frozenset({eos}))
            tokens = sampler(logits, [eos, eos], None, request)
            assert tokens[0] != eos and len(tokens) == 1  # the first draft is rejected
    request = Request(
        "r", [1, 2], SamplingParams(temperature=0, min_tokens=2), eos_token_ids=frozenset({eos})
    )
    assert sampler(logits, [eos, eos], None, request) == [6]  # the best other token takes its place
    # With one output token, position 0 is output token 2 (masked) and position 1 token 3 (free).
    request.all_token_ids.append(6)
    assert sampler(logits, [6, eos], None, request) == [6, eos, eos]
    # The step's logits are left as the model made them (the mask works on a copy).
    assert logits[0, eos] == 5.0


def test_spec_decode_greedy_with_min_tokens_equals_plain(windowed):  # noqa: F811
    """Repeated spans make ngram drafts that the target accepts; with an EOS id inside such a span,
    verification must reject it before min_tokens exactly as plain decoding never samples it."""
    plain = LLM(windowed, num_kv_blocks=256)
    prompts = repeating_prompts(plain, VOCAB_SIZE)
    spans = [
        o.outputs[0].token_ids
        for o in plain.generate(prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    ]
    set_eos(windowed, sorted({s[3] for s in spans}))  # this module's own copy of the checkpoint
    plain = LLM(windowed, num_kv_blocks=256)
    spec = LLM(windowed, num_kv_blocks=256, speculative_config=NGRAM)
    params = SamplingParams(temperature=0, max_tokens=30, min_tokens=20)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == expected
    assert any(e[:4] != s[:4] for e, s in zip(expected, spans, strict=True))  # the mask changed output
    assert spec.engine.spec_decode_stats.num_accepted_tokens > 0


def test_a_grammar_that_allows_only_eos_still_ends_the_request():
    """When the grammar is complete (only EOS allowed), masking EOS too would leave nothing to sample:
    the grammar wins, as the request cannot continue validly."""
    eos = 3
    request = Request("r", [1, 2], SamplingParams(min_tokens=5), eos_token_ids=frozenset({eos}))
    grammar_done = torch.full((1, 8), float("-inf"))
    grammar_done[0, eos] = 0.0
    mask_min_tokens(grammar_done, request, 0, 0)
    assert grammar_done[0, eos] == 0.0
    free = torch.zeros(1, 8)
    mask_min_tokens(free, request, 0, 0)
    assert free[0, eos] == float("-inf") and torch.isfinite(free[0, :eos]).all()
