"""The response store's bounds, on the actor's class itself (its clock replaced, so no waiting)."""

import json

from deployments import response_store
from deployments.response_store import ResponseStore


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
