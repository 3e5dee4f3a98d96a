"""The engine's greedy tokens and logprobs equal Hugging Face transformers' on the same checkpoint."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from raylane.engine import LLM, SamplingParams
from tests.hf_models import FAMILIES

NEW_TOKENS = 8
PROMPT_LENS = (5, 23, 40)  # different lengths, one spanning several blocks
ENGINE_SETTINGS = {
    "prefix-caching": dict(enable_prefix_caching=True),
    "no-prefix-caching": dict(enable_prefix_caching=False),
    # A 16-token budget forces the 23- and 40-token prompts to be prefilled in chunks.
    "chunked-prefill": dict(enable_prefix_caching=True, max_num_batched_tokens=16, block_size=4),
}


def prompts(vocab_size: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(0, vocab_size, (20,), generator=g).tolist()
    out = [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]
    out.append(shared + out[0])
    out.append(shared + out[1])  # shares a 20-token prefix with the one before
    return out


def hf_greedy(path: str, prompt_sets: list[list[int]]):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # Like the engine's ignore_eos: no EOS handling at all (min_new_tokens would instead mask EOS out).
    model.generation_config.eos_token_id = None
    results = []
    for prompt in prompt_sets:
        gen = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
        tokens = gen.sequences[0, len(prompt) :].tolist()
        logprobs = [torch.log_softmax(step[0].float(), -1) for step in gen.logits]
        results.append((tokens, logprobs))
    return results


@pytest.fixture(scope="module")
def hf_reference(checkpoint):
    cache = {}

    def get(family):
        if family not in cache:
            path = checkpoint(family)
            vocab = AutoModelForCausalLM.from_pretrained(path).config.vocab_size
            cache[family] = (path, prompts(vocab), hf_greedy(path, prompts(vocab)))
        return cache[family]

    return get


@pytest.mark.parametrize("setting", list(ENGINE_SETTINGS))
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_and_logprobs_match_hf(family, setting, hf_reference):
    path, prompt_sets, expected = hf_reference(family)
    llm = LLM(path, num_kv_blocks=128, **ENGINE_SETTINGS[setting])
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)
    # The last prompt runs after the others, so the prefix it shares is already cached.
    outputs = llm.generate(prompt_sets[:-1], params) + llm.generate(prompt_sets[-1:], params)
    for out, (hf_tokens, hf_logprobs) in zip(outputs, expected, strict=True):
        completion = out.outputs[0]
        assert completion.token_ids == hf_tokens
        assert completion.finish_reason == "length"
        for step, entry in enumerate(completion.logprobs):
            top = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:5]
            for token_id, lp in top:
                assert lp.logprob == pytest.approx(hf_logprobs[step][token_id].item(), abs=2e-3)
    if setting != "no-prefix-caching":
        assert outputs[-1].num_cached_tokens >= 16  # the shared 20-token prefix came from the cache
