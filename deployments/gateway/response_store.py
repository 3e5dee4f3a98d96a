"""Stored responses (`store: true`), so a conversation continues by `previous_response_id`.

The store is one **detached named Ray actor** per app (`ResponseStore`), which every gateway
replica finds by name. Why an actor and not the gateway's memory: a conversation's next request may
reach another gateway replica, or a replica Serve started after the first one died, and both must
find the response; a detached actor outlives any replica (only deleting it, or Ray itself, ends it).
Why not an external database: raylane runs on Ray alone, and a response is needed for minutes, not
forever. It is bounded by count and by bytes: `gateway.responses_max_stored_per_key` responses and
`responses_max_bytes_per_key` bytes per API key (a key past either loses its own oldest),
`gateway.responses_max_stored` and `responses_max_bytes` in all (past either, the oldest of the key
holding the most goes: never a smaller key's for a bigger one's) and `gateway.responses_ttl_s`
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
    def __init__(
        self,
        max_entries: int,
        ttl_s: float,
        max_per_key: int | None = None,
        max_bytes: int | None = None,
        max_bytes_per_key: int | None = None,
    ) -> None:
        self.max_entries, self.ttl_s = max_entries, ttl_s
        self.max_per_key = max_entries if max_per_key is None else max_per_key
        self.max_bytes = max_bytes if max_bytes is not None else float("inf")
        self.max_bytes_per_key = max_bytes_per_key if max_bytes_per_key is not None else self.max_bytes
        # id -> (expiry, record JSON, key id): one TTL, so in expiry order
        self.entries: OrderedDict[str, tuple[float, str, str]] = OrderedDict()
        self.by_key: dict[str, OrderedDict[str, None]] = {}  # key id -> its response ids, oldest first
        self.bytes_of: dict[str, int] = {}  # key id -> the bytes of its records
        self.total_bytes = 0

    def put(self, response_id: str, record: str, key: str = "") -> bool:
        """Store `record` as `response_id`, made by API key `key` (its id, for the quotas); False when
        the record alone is past the key's byte budget (not stored)."""
        self._expire()
        self._remove(response_id)
        if len(record) > self.max_bytes_per_key:
            return False
        self.entries[response_id] = (time.monotonic() + self.ttl_s, record, key)
        self.by_key.setdefault(key, OrderedDict())[response_id] = None
        self.bytes_of[key] = self.bytes_of.get(key, 0) + len(record)
        self.total_bytes += len(record)
        own = self.by_key[key]
        while len(own) > self.max_per_key or self.bytes_of[key] > self.max_bytes_per_key:
            self._remove(next(iter(own)))
        while len(self.entries) > self.max_entries:  # the oldest of the key that holds the most
            self._remove(next(iter(max(self.by_key.values(), key=len))))
        while self.total_bytes > self.max_bytes:  # the oldest of the key that holds the most bytes
            self._remove(next(iter(self.by_key[max(self.by_key, key=self.bytes_of.__getitem__)])))
        return True

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
        key, size = entry[2], len(entry[1])
        own = self.by_key[key]
        del own[response_id]
        self.bytes_of[key] -= size
        self.total_bytes -= size
        if not own:
            del self.by_key[key], self.bytes_of[key]
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


def response_store(app_name: str, *bounds):
    """The app's store actor handle, created by the first replica that asks (the others get it);
    `bounds` are `ResponseStore`'s."""
    return detached_actor(ResponseStore, store_name(app_name), *bounds)
