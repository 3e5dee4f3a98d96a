"""Poisoned requests cannot switch the service off: what the client got wrong is its own 4xx and
never touches a pool's circuit breaker; a request that fails the same way in two pools is answered
there, not walked down every pool.

The app is `router_server` (tests/live_servers.py): pools `coding` -> chat, `reasoning` -> chat,
`chat`; a circuit opens after 2 failures. Before this, 4 requests holding `"\\ud800"` opened every
circuit and every other client got 503 `circuit_open`.
"""

import json

import httpx2
import pytest

from tests.live_servers import ROUTER_KEYS, router_server_without_faults  # noqa: F401 (`server`)

TIMEOUT_S = 180
ATTACKS = 20


def post_raw(url: str, body: str, tier: str = "premium") -> httpx2.Response:
    """POST a JSON text as it is: a lone surrogate escape cannot come from encoding a Python str."""
    headers = {"Authorization": f"Bearer {ROUTER_KEYS[tier]}", "content-type": "application/json"}
    url = f"{url}/v1/chat/completions"
    return httpx2.post(url, content=body.encode(), headers=headers, timeout=TIMEOUT_S)


def with_escape(body: dict, escape: str = "\\ud800") -> str:
    """`body` as JSON text with each @@ replaced by a JSON escape (a lone surrogate by default)."""
    return json.dumps(body).replace("@@", escape)


def ordinary(url: str, tier: str = "standard", model: str = "coding") -> httpx2.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return post_raw(url, json.dumps(body), tier)


def assert_openai_error(r: httpx2.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def assert_all_circuits_closed(url: str) -> None:
    headers = {"Authorization": f"Bearer {ROUTER_KEYS['premium']}"}
    health = httpx2.get(f"{url}/health", headers=headers, timeout=60).json()
    circuits = {name: p["circuit"] for name, p in health["router"]["pools"].items()}
    assert set(circuits.values()) == {"closed"}, circuits
    assert health["status"] == "ok", health


@pytest.mark.parametrize("model", ["coding", "chat", "auto"])
def test_lone_surrogates_are_a_400_and_every_circuit_stays_closed(server, model, report):
    for i in range(ATTACKS):
        body = {"model": model, "messages": [{"role": "user", "content": "ok @@"}], "stream": i % 2 == 1}
        r = post_raw(server.url, with_escape(body, ("\\ud800", "\\udfff")[i % 2]), tier="free")
        error = assert_openai_error(r, 400)
        assert error["param"] == "messages[0].content" and error["code"] == "invalid_encoding", error
        assert error["type"] == "invalid_request_error"
    r = ordinary(server.url)  # another client, right after
    assert r.status_code == 200, r.text
    assert "x-raylane-fallback" not in r.headers
    assert_all_circuits_closed(server.url)
    report(f"lone surrogates via {model}", requests=ATTACKS, status_400=ATTACKS, circuits_opened=0)


def test_unencodable_text_anywhere_in_the_body_is_named(server):
    hi = [{"role": "user", "content": "hi"}]
    tool = {"type": "function", "function": {"name": "f", "description": "@@"}}
    cases = [
        ({"messages": hi, "stop": ["@@"]}, "stop[0]"),
        ({"messages": hi, "tools": [tool]}, "tools[0].function.description"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "@@"}]}]},
            "messages[0].content[0].text",
        ),
    ]
    for body, param in cases:
        error = assert_openai_error(post_raw(server.url, with_escape({"model": "chat", **body})), 400)
        assert error["param"] == param, error
    assert_all_circuits_closed(server.url)


def test_a_client_error_raised_in_a_pool_is_a_400_that_no_breaker_counts(server):
    server.set_fault("coding", "client_error")  # raised in the replica: crosses the Serve handle
    try:
        for _ in range(ATTACKS):
            r = ordinary(server.url, tier="premium")
            error = assert_openai_error(r, 400)
            assert error["param"] == "messages" and "injected fault" in error["message"], error
            assert r.headers["x-raylane-pool"] == "coding" and "x-raylane-fallback" not in r.headers
        assert_all_circuits_closed(server.url)
    finally:
        server.set_fault("coding", None)
    assert ordinary(server.url).status_code == 200


def test_a_request_that_fails_the_same_way_in_two_pools_stops_there(server, report):
    for pool in ("coding", "chat"):
        server.set_fault(pool, "poison")
    try:
        poison = {"model": "coding", "messages": [{"role": "user", "content": "POISON"}], "max_tokens": 4}
        for _ in range(ATTACKS):
            r = post_raw(server.url, json.dumps(poison), tier="free")
            error = assert_openai_error(r, 500)
            assert "'coding' and 'chat'" in error["message"] and "KeyError" in error["message"], error
            assert r.headers["x-raylane-fallback"] == "coding;reason=error"
        r = ordinary(server.url)  # another client, right after: served by coding itself
        assert r.status_code == 200, r.text
        assert r.headers["x-raylane-pool"] == "coding" and "x-raylane-fallback" not in r.headers
        assert_all_circuits_closed(server.url)
    finally:
        for pool in ("coding", "chat"):
            server.set_fault(pool, None)
    report("poisoned requests (2 pools)", requests=ATTACKS, status_500=ATTACKS, circuits_opened=0)
