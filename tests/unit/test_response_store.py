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
