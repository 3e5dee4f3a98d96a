"""The response store's bounds, on the actor's class itself (its clock replaced, so no waiting)."""

import json

from raylane.deployments.gateway import response_store
from raylane.deployments.gateway.response_store import ResponseStore


def test_oldest_responses_go_first_beyond_the_size_bound():
    store = ResponseStore(max_entries=2, ttl_s=60)
    for i in range(3):
        store.put(f"resp_{i}", json.dumps({"n": i}))
    assert store.get("resp_0") is None
    assert [json.loads(store.get(f"resp_{i}"))["n"] for i in (1, 2)] == [1, 2]
    assert store.size() == 2


def test_responses_expire_after_their_ttl(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(response_store.time, "monotonic", lambda: now[0])
    store = ResponseStore(max_entries=10, ttl_s=30)
    store.put("old", "{}")
    now[0] += 20
    store.put("new", "{}")
    now[0] += 15  # "old" is 35 s old, "new" 15 s
    assert store.get("old") is None and store.get("new") == "{}"
    assert store.size() == 1


def test_delete_says_whether_it_was_there():
    store = ResponseStore(max_entries=10, ttl_s=30)
    store.put("r", "{}")
    assert store.delete("r") is True
    assert store.delete("r") is False and store.get("r") is None


def test_a_key_past_its_quota_loses_its_own_oldest_not_anothers():
    """Key A floods the store; key B's one stored conversation survives it. Past the store's total
    bound the key holding the most loses its oldest, never the smaller key."""
    store = ResponseStore(max_entries=5, ttl_s=60, max_per_key=3)
    store.put("b_0", "{}", key="B")
    for i in range(10):
        store.put(f"a_{i}", "{}", key="A")
    assert store.get("b_0") == "{}"
    assert [i for i in range(10) if store.get(f"a_{i}")] == [7, 8, 9]  # A's own newest three
    store.put("c_0", "{}", key="C")
    store.put("c_1", "{}", key="C")  # six in all, one over: A holds the most and gives its oldest
    assert store.get("a_7") is None and store.get("b_0") == store.get("c_0") == "{}"
    assert store.size() == 5
    assert store.delete("a_9") and store.get("a_9") is None


def test_bytes_are_bounded_per_key_and_in_all():
    """Counts alone let a key keep 1,000 responses of any size: a key past its byte budget loses its
    own oldest; past the total, the key holding the most bytes does; a record larger than a key's
    whole budget is not stored at all."""
    store = ResponseStore(max_entries=100, ttl_s=60, max_bytes=3000, max_bytes_per_key=2000)
    store.put("b_0", "b" * 500, key="B")
    for i in range(5):
        assert store.put(f"a_{i}", "a" * 600, key="A")
    assert [i for i in range(5) if store.get(f"a_{i}")] == [2, 3, 4]  # 1,800 of A's 2,000 bytes
    assert store.get("b_0") is not None
    store.put("c_0", "c" * 900, key="C")  # 3,200 in all: A, holding the most, gives its oldest
    assert store.get("a_2") is None and store.get("b_0") and store.get("c_0")
    assert store.total_bytes == 500 + 1200 + 900
    assert not store.put("huge", "h" * 2001, key="B") and store.get("huge") is None
    store.delete("b_0")
    assert store.bytes_of == {"A": 1200, "C": 900}


def test_a_response_stored_in_open_mode_is_nobodys_once_keys_are_on():
    """Stored while the cluster had no keys (owner: none), a response is not readable by a key once
    keys are configured: it is dropped when one asks, and a 404 as if it never existed."""
    import asyncio
    from types import SimpleNamespace

    import pytest

    from raylane.config import default_tiers
    from raylane.deployments.gateway.responses_api import StoredResponses
    from raylane.deployments.protocol.errors import OpenAIError
    from raylane.router import Principal

    actor = ResponseStore(max_entries=10, ttl_s=60)

    async def call(method, *args):
        return getattr(actor, method)(*args)

    handle = SimpleNamespace(
        **{m: SimpleNamespace(remote=lambda *a, m=m: call(m, *a)) for m in ("get", "put", "delete")}
    )
    stored = StoredResponses(handle)
    tier = default_tiers()[1]
    anonymous, keyed = Principal("anonymous:127.0.0.1", tier), Principal("key-abc", tier)
    asyncio.run(stored._save({"id": "resp_1", "output": []}, [], anonymous))
    assert asyncio.run(stored.record("resp_1", anonymous))["owner"] is None  # open mode reads it
    with pytest.raises(OpenAIError) as refused:
        asyncio.run(stored.record("resp_1", keyed))
    assert refused.value.status == 404 and actor.get("resp_1") is None  # and it is gone
