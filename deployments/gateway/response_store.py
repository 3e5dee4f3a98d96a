"""Stored responses (`store: true`), so a conversation continues by `previous_response_id`.

The store is one **detached named Ray actor** per app (`ResponseStore`), which every gateway
replica finds by name. Why an actor and not the gateway's memory: a conversation's next request may
reach another gateway replica, or a replica Serve started after the first one died, and both must
find the response; a detached actor outlives any replica (only deleting it, or Ray itself, ends it).
Why not an external database: raylane runs on Ray alone, and a response is needed for minutes, not
forever. It is bounded three ways: `gateway.responses_max_stored_per_key` responses per API key (a
key past it loses its own oldest), `gateway.responses_max_stored` in all (past it, the oldest of the
key holding the most goes: never a smaller key's for a bigger one's) and `gateway.responses_ttl_s`
seconds each, so neither a flood of requests nor time grows it without end, and one key's flood
cannot push out another key's conversations. Records are JSON text: cheap to pickle across the
actor call, and what GET returns.

A record holds the response object, the conversation that led to it (chat messages, without its
instructions) and the API key that made it: another key gets a 404, as if it did not exist.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from raylane.deployments.detached import NAMESPACE, detached_actor

__all__ = ["NAMESPACE", "ResponseStore", "response_store", "store_name"]


class ResponseStore:
    def __init__(self, max_entries: int, ttl_s: float, max_per_key: int | None = None) -> None:
        self.max_entries, self.ttl_s = max_entries, ttl_s
        self.max_per_key = max_entries if max_per_key is None else max_per_key
        # id -> (expiry, record JSON, key id): one TTL, so in expiry order
        self.entries: OrderedDict[str, tuple[float, str, str]] = OrderedDict()
        self.by_key: dict[str, OrderedDict[str, None]] = {}  # key id -> its response ids, oldest first

    def put(self, response_id: str, record: str, key: str = "") -> None:
        """Store `record` as `response_id`, made by API key `key` (its id, for the quota)."""
        self._expire()
        self._remove(response_id)
        self.entries[response_id] = (time.monotonic() + self.ttl_s, record, key)
        self.by_key.setdefault(key, OrderedDict())[response_id] = None
        own = self.by_key[key]
        while len(own) > self.max_per_key:
            self._remove(next(iter(own)))
        while len(self.entries) > self.max_entries:  # the oldest of the key that holds the most
            biggest = max(self.by_key.values(), key=len)
            self._remove(next(iter(biggest)))

    def get(self, response_id: str) -> str | None:
        self._expire()
        entry = self.entries.get(response_id)
        return entry[1] if entry is not None else None

    def delete(self, response_id: str) -> bool:
        return self._remove(response_id)

    def _remove(self, response_id: str) -> bool:
        entry = self.entries.pop(response_id, None)
        if entry is None:
            return False
        own = self.by_key[entry[2]]
        del own[response_id]
        if not own:
            del self.by_key[entry[2]]
        return True

    def size(self) -> int:
        self._expire()
        return len(self.entries)

    def _expire(self) -> None:
        """Entries are in insertion order, with one TTL: the expired ones are at the front."""
        now = time.monotonic()
        while self.entries:
            response_id, (expiry, _, _) = next(iter(self.entries.items()))
            if expiry > now:
                break
            self._remove(response_id)


def store_name(app_name: str) -> str:
    return f"raylane-responses-{app_name}"


def response_store(app_name: str, max_entries: int, ttl_s: float, max_per_key: int | None = None):
    """The app's store actor handle, created by the first replica that asks (the others get it)."""
    return detached_actor(ResponseStore, store_name(app_name), max_entries, ttl_s, max_per_key)
