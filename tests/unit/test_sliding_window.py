"""Sliding-window attention: outputs equal Hugging Face's for prompts longer than the window, and a
request's KV blocks stay bounded by the window however long it runs."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config

from raylane.engine import LLM, SamplingParams
from raylane.engine.block_manager import NULL_BLOCK, BlockManager
from raylane.engine.request import Request
from tests.hf_models import TINY_CONFIG

WINDOW, BLOCK_SIZE, NEW_TOKENS = 8, 4, 24
COMMON = dict(TINY_CONFIG, sliding_window=WINDOW)
CONFIGS = {
    "mistral": lambda: MistralConfig(**COMMON),
    # Qwen2 windows layers from max_window_layers on: 0 windows every layer.
    "qwen2": lambda: Qwen2Config(**COMMON, use_sliding_window=True, max_window_layers=0),
}


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    made = {}

    def get(family: str):
        if family not in made:
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(CONFIGS[family](), dtype=torch.float32).eval()
            with torch.no_grad():
                for param in model.parameters():
                    if param.dim() == 1:  # norms and biases: away from HF's constant init
                        param.add_(torch.randn_like(param) * 0.2)
            path = tmp_path_factory.mktemp(family)
            model.save_pretrained(path)
            model.generation_config.eos_token_id = None
            made[family] = (str(path), model)
        return made[family]

    return get


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in (37, 5, 21)]


def hf_greedy(model, prompt: list[int]) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("chunked", [False, True], ids=["whole-prefill", "chunked-prefill"])
@pytest.mark.parametrize("family", list(CONFIGS))
def test_windowed_outputs_match_hf_and_kv_stays_bounded(windowed, family, chunked):
    path, hf = windowed(family)
    budget = dict(max_num_batched_tokens=12) if chunked else {}
    llm = LLM(path, num_kv_blocks=64, block_size=BLOCK_SIZE, **budget)
    assert llm.engine.block_manager.sliding_window == WINDOW
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    engine, bm = llm.engine, llm.engine.block_manager
    ids = [engine.add_request(p, params) for p in prompts()]
    finished, most_held = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
        for request in engine.scheduler.running:
            if request.num_computed_tokens >= request.num_prompt_tokens:  # decoding
                most_held = max(most_held, sum(b != NULL_BLOCK for b in request.block_ids))
    # Decoding holds the window plus the block the next token goes to, never the whole context.
    assert most_held <= math.ceil(WINDOW / BLOCK_SIZE) + 1
    assert bm.num_used_blocks == 0
    for rid, prompt in zip(ids, prompts(), strict=True):
        assert finished[rid] == hf_greedy(hf, prompt)


def test_blocks_before_the_window_are_released_and_keep_their_slots():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True, sliding_window=6)
    request = Request("r", list(range(20)), SamplingParams(), max_total_tokens=100)
    assert bm.allocate_slots(request, 20)
    request.num_computed_tokens = 20
    bm.cache_full_blocks(request)
    held = list(request.block_ids)
    request.append_token(7)
    assert bm.allocate_slots(request, 1)
    # The next query (position 20) sees keys 15..20: blocks 0-2 (positions 0..11) are dead.
    assert request.block_ids[:3] == [NULL_BLOCK] * 3
    assert request.block_ids[3:5] == held[3:5]
    assert bm.num_used_blocks == 3  # blocks 3, 4 and the new block 5
    bm.free(request)
    assert bm.num_used_blocks == 0
    # Released blocks keep their hashes: a request with the same prefix finds them in the cache.
    again = Request("s", list(range(20)), SamplingParams(), max_total_tokens=100)
    assert bm.get_computed_blocks(again)[:3] == held[:3]
