"""Prefix-aware replica routing: which replica of a pool serves a request (Serve's RequestRouter API).

Serve's default router picks between two random replicas by queue length alone, blind to which one
already holds a request's prefix in its KV cache: with many users sharing a few long system prompts
every replica ends up computing every prompt. `PrefixAwareRouter` is set on each `ModelPool`
deployment through its `request_router_config` (deployments/app.py), so it runs inside every handle
to the pool (the gateway's), and Serve keeps doing the rest: the replica set, queue-length probes,
rejection and backoff when replicas are full.

**What it hashes.** The engine caches KV by chain hashes of token blocks (engine/block_manager.py);
the gateway has the request's messages, not its tokens (the chat template and tokenizer are the
pool's). It hashes the same kind of chain over character blocks of the messages instead: role and
content, in order, `block_chars` characters a block (4 x the engine's block size by default, about
one KV block of English text). The chat template renders each message from itself and what came
before, so requests whose leading messages agree have rendered prompts, and token blocks, that agree
as far; a match over character blocks is then a match over KV blocks, give or take the block that
straddles the first difference. (Ray Serve LLM's PrefixCacheAffinityRouter matches text too, in a
prefix tree held by one actor; here each handle keeps its own index, with no actor call per request.)

**Bounded per request.** Only a request's leading `max_blocks_per_request` blocks are read, hashed
and remembered: a multi-megabyte prompt costs the same as one of that many blocks, and cannot flush
the prefixes of everyone else's requests out of the index (the blocks are 16-byte digests; the index
holds no prompt text).

**The index.** For each replica, the block hashes of the requests this handle routed to it, least
recently routed forgotten past `max_indexed_blocks` (the engine forgets its own least recently freed
blocks the same way). It is this handle's view: with several gateway replicas each learns from what
it routes, which for a shared system prompt converges on the same replica.

**The choice.** Each replica scores `prefix_weight * match - queue_weight * ongoing - kv_weight *
kv_usage` (`raylane.config.ReplicaRoutingConfig`); a replica with `max_imbalance` more requests in
flight than the least loaded one loses its prefix term, so a hot prefix cannot pile every request on
one replica. The best score is Serve's first choice (`prefix_hit` when it won on its match,
`least_loaded` otherwise); the others follow in score order, so a full replica hands the request on
rather than queueing it.

**LoRA adapters.** A request naming an adapter adds `adapter_weight` to the replicas that hold it (the
replica's routing stats list its resident adapters; this handle also remembers where it sent each),
so an adapter's requests go where it is loaded, as Ray Serve's model multiplexing does. Unlike
multiplexing, that preference lapses on a replica `adapter_max_imbalance` requests busier than the
least loaded: a hot adapter's next request goes elsewhere, that replica loads it, and from then on
both hold it, so a popular adapter spreads over the replicas instead of being pinned to one.

Decisions are counted in `raylane_replica_routing_decisions_total`; changes
in the replica set in `raylane_scale_events_total`.
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from raylane.deployments.protocol.wire import PoolRequest

if TYPE_CHECKING:
    from ray.serve._private.common import RequestMetadata

logger = logging.getLogger(__name__)

PREFIX_HIT = "prefix_hit"
LEAST_LOADED = "least_loaded"
_SEP = "\x00"  # between a message's role and content, and between messages: text cannot forge it
MAX_SENT_ADAPTERS = 16  # adapters remembered per replica as sent there (engine.max_loras is usually less)


def request_text(args: Iterable[Any], max_chars: int | None = None) -> str:
    """The prompt text of a pool call's `PoolRequest`: a chat request's messages (role and text of
    each, in order) or a completion request's prompt; "" when there is none (a token-id prompt). At
    most `max_chars` characters, and messages past them are not read."""
    for arg in args:
        if not isinstance(arg, PoolRequest):
            continue
        messages = getattr(arg.body, "messages", None)
        if messages is not None:
            parts, length = [], 0
            for m in messages:
                parts.append(f"{_field(m, 'role')}{_SEP}{_content_text(_field(m, 'content'))}{_SEP}")
                length += len(parts[-1])
                if max_chars is not None and length >= max_chars:
                    break
            return "".join(parts)[:max_chars]
        prompt = getattr(arg.body, "prompt", None)
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            prompt = prompt[0]  # a batch: its first prompt's replica serves the whole batch
        if isinstance(prompt, str):
            return prompt[:max_chars]
    return ""


def _field(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(t for part in content if isinstance(t := _field(part, "text"), str))
    return ""


def block_hashes(
    text: str, block_chars: int, max_blocks: int | None = None, salt: bytes = b""
) -> list[bytes]:
    """Chain hashes of the text's full blocks (the first `max_blocks` of them), as the engine hashes
    token blocks: each block's hash covers every block before it, so equal hashes mean equal prefixes.
    `salt`, the request's prefix-cache scope, seeds the chain as in the engine: a prompt is routed
    after the replicas that cached it for its own scope only."""
    hashes: list[bytes] = []
    parent = hashlib.blake2b(salt, digest_size=16).digest() if salt else b""
    if max_blocks is not None:
        text = text[: max_blocks * block_chars]  # a character is at least one byte: enough for them all
    data = text.encode("utf-8", "surrogatepass")
    chars = block_chars  # bytes of UTF-8 from here on: one block is `block_chars` bytes
    end = len(data) - chars + 1 if max_blocks is None else min(len(data) - chars + 1, max_blocks * chars)
    for start in range(0, end, chars):
        parent = hashlib.blake2b(parent + data[start : start + chars], digest_size=16).digest()
        hashes.append(parent)
    return hashes


class PrefixIndex:
    """Which prompt blocks were last routed to which replica: one LRU set of chain hashes each."""

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self._blocks: dict[ReplicaID, OrderedDict[bytes, None]] = {}

    def matched(self, replica: ReplicaID, hashes: list[bytes]) -> int:
        """How many of the leading blocks the replica was sent (a chain hash implies its parents)."""
        blocks = self._blocks.get(replica)
        if not blocks or not hashes:
            return 0
        lo, hi = 0, len(hashes)  # binary search: block i present implies every block before it was
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if hashes[mid - 1] in blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def insert(self, replica: ReplicaID, hashes: list[bytes]) -> None:
        blocks = self._blocks.setdefault(replica, OrderedDict())
        for h in hashes:
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > self.max_blocks:
            blocks.popitem(last=False)

    def drop(self, replica: ReplicaID) -> None:
        self._blocks.pop(replica, None)

    def size(self, replica: ReplicaID) -> int:
        return len(self._blocks.get(replica, ()))


@dataclass(frozen=True, slots=True)
class ReplicaScore:
    replica: RunningReplica
    match: float  # share of the request's blocks (0-1), 0 when the replica is too loaded to count it
    ongoing: int
    kv_usage: float
    score: float


class PrefixAwareRouter(FIFOMixin, RequestRouter):
    """Serve calls `initialize_state` with the deployment's `request_router_kwargs`
    (`raylane.deployments.app.request_router_config`)."""

    def _get_pending_request_matching_metadata(
        self, request_metadata: RequestMetadata | None = None
    ) -> PendingRequest | None:
        """The replica chosen for a request goes to that request while it waits (FIFOMixin then gives
        it to the oldest waiting request instead). Not by request id alone, as Serve's base router
        does: calls made from one request's context (the gateway's health loop) share an internal
        request id, and a finished one takes the id's index entry with it, leaving the next call with
        that id waiting for a match that never comes."""
        return self._get_pending_request_matching_internal_request_id(request_metadata)

    def initialize_state(
        self,
        pool: str = "",
        prefix_weight: float = 1.0,
        queue_weight: float = 0.15,
        kv_weight: float = 0.5,
        max_imbalance: int = 8,
        block_chars: int = 64,
        max_indexed_blocks: int = 65536,
        max_blocks_per_request: int = 1024,
        adapter_weight: float = 1.0,
        adapter_max_imbalance: int = 2,
        **_: Any,
    ) -> None:
        self.pool = pool or (self._deployment_id.name if self._deployment_id else "")
        self.prefix_weight, self.queue_weight, self.kv_weight = prefix_weight, queue_weight, kv_weight
        self.max_imbalance, self.block_chars = max_imbalance, block_chars
        self.index = PrefixIndex(max_indexed_blocks)
        self.max_blocks_per_request = max_blocks_per_request
        self.adapter_weight, self.adapter_max_imbalance = adapter_weight, adapter_max_imbalance
        # LoRA adapters this handle sent each replica, most recent last (a few: a replica holds few)
        self.sent_adapters: dict[ReplicaID, OrderedDict[str, None]] = {}
        self._seen_replicas = False

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is not None:
            # Serve backs off between rounds only when the router says so; without it a round that
            # finds every replica full would be retried at once, in a busy loop.
            pending_request.routing_context.should_backoff = True
        hashes = self._hashes(pending_request)
        scores = await self.score(candidate_replicas, hashes, _adapter(pending_request))
        best = scores[0]
        reason = PREFIX_HIT if best.match > 0 and best.match >= max(s.match for s in scores) else LEAST_LOADED
        _count_decision(self.pool, reason)
        return [[s.replica] for s in scores]

    async def score(
        self, replicas: list[RunningReplica], hashes: list[bytes], adapter: str | None = None
    ) -> list[ReplicaScore]:
        """The replicas, best first."""
        ongoing = await self._queue_lens(replicas)
        least = min(ongoing.values(), default=0)
        scored = []
        for r in random.sample(replicas, len(replicas)):
            queued = ongoing.get(r.replica_id, 0)
            match = self.index.matched(r.replica_id, hashes) / len(hashes) if hashes else 0.0
            if queued - least >= self.max_imbalance:
                match = 0.0  # too far behind the least loaded replica for its cache to be worth it
            kv = float((r.routing_stats or {}).get("kv_cache_usage", 0.0))
            score = self.prefix_weight * match - self.queue_weight * queued - self.kv_weight * kv
            if adapter is not None and queued - least < self.adapter_max_imbalance:
                score += self.adapter_weight * self._holds(r, adapter)
            scored.append(ReplicaScore(r, match, queued, kv, score))
        # Equal scores (idle replicas, a new prefix): the replica holding fewer prefixes first, so new
        # prompts spread over the replicas (Ray's PrefixCacheAffinityRouter picks its "smallest tenant"
        # alike); then the shuffle's order.
        scored.sort(key=lambda s: (-round(s.score, 9), self.index.size(s.replica.replica_id)))
        return scored

    async def _queue_lens(self, replicas: list[RunningReplica]) -> dict[ReplicaID, int]:
        """Requests in flight per replica, from Serve's queue-length cache (filled by the probes Serve
        sends when it tries a replica, and counted up by every request sent). A replica missing from it
        counts as idle: probing it here would double Serve's own probe, which follows for the replica
        chosen (and passes over it if it is full). Without the cache
        (`RAY_SERVE_ENABLE_QUEUE_LENGTH_CACHE=0`) the replicas are probed; one that does not answer
        counts as full."""
        if not self._use_replica_queue_len_cache:
            probed = await self._probe_queue_lens(replicas, 0)
            return {r.replica_id: r.max_ongoing_requests if n is None else n for r, n in probed}
        cache = self._replica_queue_len_cache
        return {r.replica_id: cache.get(r.replica_id) or 0 for r in replicas}

    def _holds(self, replica: RunningReplica, adapter: str) -> bool:
        resident = (replica.routing_stats or {}).get("loras") or ()
        return adapter in resident or adapter in self.sent_adapters.get(replica.replica_id, ())

    def _hashes(self, pending_request: PendingRequest | None) -> list[bytes]:
        if pending_request is None or not pending_request.args:
            return []
        blocks, chars = self.max_blocks_per_request, self.block_chars
        salt = next((a.cache_salt for a in pending_request.args if isinstance(a, PoolRequest)), "")
        text = request_text(pending_request.args, blocks * chars)
        return block_hashes(text, chars, blocks, salt.encode("utf-8", "surrogatepass"))

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        """The replica now computes (and caches) this prompt: later requests sharing it should follow."""
        hashes = self._hashes(pending_request)
        if hashes:
            self.index.insert(replica_id, hashes)
        if (adapter := _adapter(pending_request)) is not None:
            sent = self.sent_adapters.setdefault(replica_id, OrderedDict())
            sent[adapter] = None
            sent.move_to_end(adapter)
            if len(sent) > MAX_SENT_ADAPTERS:
                sent.popitem(last=False)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        before = set(self._replica_id_set)
        super().update_replicas(replicas)
        after = set(self._replica_id_set)
        for gone in before - after:
            self.index.drop(gone)
            self.sent_adapters.pop(gone, None)
        if self._seen_replicas and len(after) != len(before):
            _count_scale_event(self.pool, "up" if len(after) > len(before) else "down")
        self._seen_replicas = self._seen_replicas or bool(after)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.drop(replica_id)
        self.sent_adapters.pop(replica_id, None)


def _adapter(pending_request: PendingRequest | None) -> str | None:
    for arg in pending_request.args if pending_request is not None else ():
        if isinstance(arg, PoolRequest):
            return None if arg.adapter is None else arg.adapter.name
    return None


def _count_decision(pool: str, reason: str) -> None:
    try:
        from raylane.deployments.metrics.gateway import gateway_metrics

        gateway_metrics().replica_routing.labels(pool=pool, reason=reason).inc()
    except Exception:  # metrics must never fail a request's routing
        logger.debug("could not count a replica routing decision", exc_info=True)


def _count_scale_event(pool: str, direction: str) -> None:
    try:
        from raylane.deployments.metrics.gateway import gateway_metrics

        gateway_metrics().scale_events.labels(pool=pool, direction=direction).inc()
    except Exception:
        logger.debug("could not count a scale event", exc_info=True)
    logger.info("pool %s: replicas scaled %s", pool, direction)
