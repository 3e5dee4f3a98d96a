"""KV block bookkeeping: what a user notices is memory reuse and prefix hits, counted in blocks."""

from raylane.engine.block_manager import BlockManager
from raylane.engine.request import Request
from raylane.engine.sampling_params import SamplingParams


def make_request(tokens: list[int], rid: str = "r") -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), max_total_tokens=10_000)


def schedule_prompt(bm: BlockManager, request: Request) -> int:
    computed = bm.get_computed_blocks(request)
    cached = len(computed) * bm.block_size
    assert bm.allocate_slots(request, request.num_tokens - cached, computed)
    request.num_cached_tokens = cached
    request.num_computed_tokens = request.num_tokens
    bm.cache_full_blocks(request)
    return cached


def test_shared_prefix_reuses_blocks_and_counts_hits():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_request(list(range(10)), "a")
    assert schedule_prompt(bm, a) == 0
    b = make_request(list(range(8)) + [99, 98, 97], "b")
    assert schedule_prompt(bm, b) == 8
    assert b.block_ids[:2] == a.block_ids[:2]  # same physical blocks for the shared prefix
    assert b.block_ids[2] != a.block_ids[2]
    assert bm.prefix_cache_queries == 21 and bm.prefix_cache_hits == 8


def test_fully_cached_prompt_still_computes_its_last_token():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_request(list(range(8)), "a")
    schedule_prompt(bm, a)
    b = make_request(list(range(8)), "b")
    assert schedule_prompt(bm, b) == 4  # the last block is recomputed so logits exist for token 8


def test_freed_blocks_stay_cached_until_reused_then_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_request(list(range(9)), "a")
    schedule_prompt(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 4 and bm.usage == 0.0
    again = make_request(list(range(9)), "again")
    assert schedule_prompt(bm, again) == 8  # revived from the free queue
    bm.free(again)
    other = make_request([50 + i for i in range(16)], "other")  # needs every block: evicts the cache
    assert schedule_prompt(bm, other) == 0
    bm.free(other)
    late = make_request(list(range(9)), "late")
    assert schedule_prompt(bm, late) == 0


def test_allocation_fails_without_enough_blocks_and_free_returns_them():
    bm = BlockManager(num_blocks=3, block_size=4, enable_prefix_caching=False)
    a = make_request(list(range(8)), "a")
    assert bm.allocate_slots(a, 8)
    b = make_request(list(range(100, 108)), "b")
    assert not bm.allocate_slots(b, 8)
    assert b.block_ids == []  # a failed allocation takes nothing
    bm.free(a)
    assert bm.num_free_blocks == 3
    assert bm.allocate_slots(b, 8)


def test_cached_blocks_are_shared_only_within_one_cache_salt():
    """A tenant's scope (vLLM's cache_salt): the same prompt from another scope finds nothing cached,
    so its hit count tells it nothing of what the first sent; the same scope finds its blocks."""
    bm = BlockManager(num_blocks=32, block_size=4)
    a = make_request(list(range(13)), "a")
    a.cache_salt = "key:A"
    assert schedule_prompt(bm, a) == 0
    for rid, salt, hits in (("b", "key:B", 0), ("none", "", 0), ("a2", "key:A", 12)):
        request = make_request(list(range(13)), rid)
        request.cache_salt = salt
        assert schedule_prompt(bm, request) == hits, salt
