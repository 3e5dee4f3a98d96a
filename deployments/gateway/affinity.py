"""Conversation affinity for `auto`: a conversation's later turns go to the pool that served its first.

Without it every turn is classified afresh, and a conversation bounces between pools when its topic
drifts ("thanks! unrelated: what should I cook tonight?"), starting cold each time on a pool that has
none of its prefix cached, and answering in another model's voice. A platform team expects the
conversation to stay where it started, as OpenAI's own prompt caching keeps requests that share a
prefix (or a `prompt_cache_key`) on one machine.

**What a conversation is.** The request's `prompt_cache_key` when it sends one (OpenAI's field for
"requests with this key share a cache"), else the messages up to and including the first user turn:
every later turn of a chat repeats them. Not `user`: one end user holds many conversations on many
subjects. A request with no earlier turn (no assistant or tool message, one user message) and no
`prompt_cache_key` is a first turn: it is always classified, and its answer names the pool for the
turns that follow.

**Whose it is.** A conversation belongs to the API key that sent it (`Principal.key_id`): the key of
the map is a 16-byte BLAKE2b digest of that key id and the conversation's identity, so another
tenant sending the same `prompt_cache_key` or the same opening messages gets a conversation of its
own and cannot steer this one's pool; and the map keeps no client text, whatever its length.

**Where it holds.** A later turn's candidates are the remembered pool first, then the rest of its
route's chain (the route's pool and fallbacks), so a pool that cannot serve it now (down, open
circuit, busy past the tier's budget, context too short) hands it on as any fallback does, and the
pool that did serve it is remembered from then on. Each gateway replica keeps its own map (bounded,
least recently used first out, entries older than `router.affinity.ttl_s` forgotten); with several
gateway replicas, a turn that reaches another replica is classified there once and sticks from then.
The decision is `sticky` in the `x-raylane-decision` header, the request log and
`raylane_auto_routing_decisions_total`.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import Callable

from fastapi.responses import Response

from raylane.config import AUTO_MODELS, AffinityConfig
from raylane.router import Principal, Resolution, RouteDecision, Router

STICKY = "sticky"


def conversation_key(owner: str, messages: list[dict], prompt_cache_key: str | None = None) -> str | None:
    """The conversation's identity within `owner` (the API key's id; see the module docstring), as a
    32-character hex digest; None when there is no user turn."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(json.dumps(owner).encode())  # quoted: no owner's id is a prefix of another's
    if prompt_cache_key:
        digest.update(b"key\0" + prompt_cache_key.encode("utf-8", "surrogatepass"))
        return digest.hexdigest()
    digest.update(b"messages\0")
    for message in messages:
        digest.update(json.dumps([message.get("role"), message.get("content")], sort_keys=True).encode())
        if message.get("role") == "user":
            return digest.hexdigest()
    return None


def is_later_turn(messages: list[dict]) -> bool:
    roles = [m.get("role") for m in messages]
    return "assistant" in roles or "tool" in roles or roles.count("user") > 1


class ConversationAffinity:
    def __init__(self, config: AffinityConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config, self.clock = config, clock
        self._pools: OrderedDict[str, tuple[str, str, float]] = OrderedDict()  # key -> (route, pool, seen)

    async def resolve(
        self,
        router: Router,
        principal: Principal,
        model: str,
        messages: list[dict],
        prompt_cache_key: str | None = None,
    ) -> tuple[Resolution, str | None]:
        """The request's resolution and its conversation key (None when affinity does not apply)."""
        if model not in AUTO_MODELS or not self.config.enabled:
            return await router.resolve_async(model, messages), None
        key = conversation_key(principal.key_id, messages, prompt_cache_key)
        if key is not None and (prompt_cache_key or is_later_turn(messages)):
            held = self.lookup(key)
            if held is not None and (sticky := _sticky(router, model, *held)) is not None:
                return sticky, key
        return await router.resolve_async(model, messages), key

    def served(self, key: str | None, resolution: Resolution, response: Response) -> None:
        """Remember the pool that answered (the first item came: no fallback after it)."""
        pool = response.headers.get("x-raylane-pool")
        if key is not None and pool and response.status_code < 400:
            self.remember(key, resolution.route, pool)

    def lookup(self, key: str) -> tuple[str, str] | None:
        held = self._pools.get(key)
        if held is None:
            return None
        route, pool, seen = held
        if self.clock() - seen > self.config.ttl_s:
            del self._pools[key]
            return None
        return route, pool

    def remember(self, key: str, route: str, pool: str) -> None:
        self._pools[key] = (route, pool, self.clock())
        self._pools.move_to_end(key)
        while len(self._pools) > self.config.max_conversations:
            self._pools.popitem(last=False)

    def __len__(self) -> int:
        return len(self._pools)


def _sticky(router: Router, model: str, route_name: str, pool: str) -> Resolution | None:
    """The remembered pool first, then the rest of the route's chain; None if the route is gone."""
    route = next((r for r in router.config.routes if r.name == route_name), None)
    if route is None or pool not in router.pools:
        return None
    chain = (pool, *(p for p in (route.pool, *route.fallbacks) if p != pool))
    return Resolution(model, route.name, chain, RouteDecision(route.name, pool, 1.0, STICKY))
