"""Paged KV cache bookkeeping: fixed-size blocks, ref counts, prefix caching.

A full block is identified by a chain hash (hash of the parent block's hash and its own
token ids), so two requests with the same prefix map their leading blocks to the same
physical blocks. Freed blocks keep their contents and hash and sit in an LRU free queue:
a later request with the same prefix revives them; a new allocation takes the least
recently freed block and forgets its hash.

With sliding-window attention (`sliding_window` set) a running request's blocks that lie entirely
before every future query's window are released as it advances (`free_outside_window`): its block
table keeps `NULL_BLOCK` in their place, so later positions keep their slots, and the attention mask
never reads them. KV held per request is then bounded by the window (plus one step's tokens).
"""

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from raylane.engine.request import Request

NULL_BLOCK = -1  # a block-table entry whose block was released (outside the sliding window)


def block_salt(request: Request) -> bytes | None:
    """The first block's parent. Under an adapter: the same tokens under two adapters (or under one
    and the base model) have different KV, so they never share a block. With a cache salt (the
    tenant's scope, vLLM's `cache_salt`): a block computed for one scope is never a hit for another,
    so a hit, and `cached_tokens`, tells no tenant what another one sent."""
    if request.lora is None and not request.cache_salt:
        return None
    lora = 0 if request.lora is None else request.lora.lora_int_id
    return b"lora:%d\x00salt:" % lora + request.cache_salt.encode("utf-8", "surrogatepass")


def hash_block(parent: bytes | None, token_ids: list[int]) -> bytes:
    # A cryptographic hash, so one tenant cannot craft a prompt that collides with another's prefix.
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        sliding_window: int | None = None,
    ):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}  # chain hash -> block id
        self.prefix_cache_queries = 0  # prompt tokens looked up
        self.prefix_cache_hits = 0  # of those, found cached

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free blocks count as free, as in vLLM)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def _update_hashes(self, request: Request, num_tokens: int) -> None:
        bs, hashes, tokens = self.block_size, request.block_hashes, request.all_token_ids
        while (len(hashes) + 1) * bs <= num_tokens:
            i = len(hashes)
            parent = hashes[-1] if hashes else block_salt(request)
            hashes.append(hash_block(parent, tokens[i * bs : (i + 1) * bs]))

    def get_computed_blocks(self, request: Request) -> list[int]:
        """Leading blocks of the request already in the cache. At least one token is always
        left to compute, since the model must produce logits for the last one. None for a request
        whose prompt logprobs are still to be read: a cached position is never forwarded, so its
        logits would never come (engine/prompt_logprobs.py)."""
        if not self.enable_prefix_caching or request.needs_prompt_logprobs:
            return []
        self._update_hashes(request, request.num_tokens - 1)
        hits: list[int] = []
        for block_hash in request.block_hashes:
            block_id = self.cached.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        if request.num_cached_tokens < 0:  # count each request's first lookup only
            self.prefix_cache_queries += request.num_prompt_tokens
            self.prefix_cache_hits += min(len(hits) * self.block_size, request.num_prompt_tokens)
        return hits

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def allocate_slots(self, request: Request, num_new_tokens: int, computed: list[int] = ()) -> bool:
        """Give the request blocks for `num_new_tokens` beyond what it has computed (plus the
        cached blocks in `computed` on its first scheduling). False when blocks run out."""
        self.free_outside_window(request)
        num_needed_tokens = request.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        num_needed = -(-num_needed_tokens // self.block_size) - len(request.block_ids) - len(computed)
        evictable_computed = sum(1 for b in computed if self.blocks[b].ref_count == 0)
        if num_needed + evictable_computed > self.num_free_blocks:
            return False
        for block_id in computed:
            self._take(block_id)
        request.block_ids.extend(computed)
        for _ in range(num_needed):
            block_id = next(iter(self.free_queue))
            self._take(block_id)
            block = self.blocks[block_id]
            if block.block_hash is not None:  # evict the cached content this block held
                if self.cached.get(block.block_hash) == block_id:
                    del self.cached[block.block_hash]
                block.block_hash = None
            request.block_ids.append(block_id)
        return True

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def cache_full_blocks(self, request: Request) -> None:
        """Publish the request's computed full blocks for reuse by later requests."""
        if not self.enable_prefix_caching:
            return
        self._update_hashes(request, request.num_computed_tokens)
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        for i in range(num_full):
            if request.block_ids[i] == NULL_BLOCK:  # published before it left the window
                continue
            block = self.blocks[request.block_ids[i]]
            if block.block_hash is None:
                block.block_hash = request.block_hashes[i]
                self.cached.setdefault(block.block_hash, block.block_id)

    def free_outside_window(self, request: Request) -> None:
        """Release the leading blocks no future query of the request can attend to.

        The earliest query still to come is at position num_computed_tokens (rejected speculative
        tokens never roll back below it), and it sees keys after position num_computed - window.
        """
        if self.sliding_window is None:
            return
        num_dead = (request.num_computed_tokens - self.sliding_window + 1) // self.block_size
        for i in range(min(num_dead, len(request.block_ids))):
            if request.block_ids[i] != NULL_BLOCK:
                self._release(request.block_ids[i])
                request.block_ids[i] = NULL_BLOCK

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_queue[block_id] = None

    def free(self, request: Request) -> None:
        """Release the request's blocks. Tail blocks go to the LRU end first, so they are
        evicted before the shared prefix blocks at the head."""
        for block_id in reversed(request.block_ids):
            if block_id != NULL_BLOCK:
                self._release(block_id)
        request.block_ids.clear()

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
