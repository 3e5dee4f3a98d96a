"""The router in the live gateway: keys and tiers, `auto`, admission order, shedding, fallback and
circuit breakers, as a client sees them (status codes and `x-raylane-*` headers).

The app is `router_server` (tests/live_servers.py): pools `coding` -> chat, `reasoning`
(64-token context) -> chat, `chat` (one request at a time); tiers premium < standard < free (free is
sheddable with no queue). No test asserts a duration: waits poll the gateway's /health.
"""

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx2
import pytest

from tests.live_servers import LIMITED_KEY, ROUTER_KEYS, router_server_without_faults  # noqa: F401 (`server`)

HI = [{"role": "user", "content": "hi"}]
TIMEOUT_S = 180


def chat(server, model: str, tier: str | None = "premium", messages=HI, **body) -> httpx2.Response:
    headers = {"Authorization": f"Bearer {ROUTER_KEYS[tier]}"} if tier else {}
    body = {"model": model, "messages": messages, "max_tokens": 4} | body
    return httpx2.post(f"{server.base_url}/chat/completions", json=body, headers=headers, timeout=TIMEOUT_S)


def bearer(tier: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {ROUTER_KEYS[tier]}"}


def health(server) -> dict:
    """/health with a key: without one, a keyed app tells only its status."""
    return httpx2.get(f"{server.url}/health", headers=bearer("premium"), timeout=60).json()


def wait_for(condition, what: str, timeout_s: float = 120):
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return value


def load(server, pool: str) -> dict:
    return health(server)["router"]["pools"][pool]


def test_one_key_learns_nothing_from_anothers_cached_prompt(server):
    """Prefix-cache hits are scoped to the key by default (gateway.prefix_cache_sharing): a document
    only the premium key sent is cached for it (its second send hits), and the standard key's copy
    reports 0 cached tokens, as if nobody had sent it."""
    document = [{"role": "user", "content": "Summarise: " + "the quarterly numbers were fine. " * 12}]

    def cached(tier: str) -> int:
        r = chat(server, "coding", tier=tier, messages=document, max_tokens=1)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("premium") == 0
    assert cached("premium") > 0
    assert cached("standard") == 0


def test_keys_are_required_when_configured(server):
    for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"x-api-key": "nope"}):
        r = httpx2.post(
            f"{server.base_url}/chat/completions",
            json={"model": "chat", "messages": HI, "max_tokens": 4},
            headers=headers,
            timeout=TIMEOUT_S,
        )
        assert r.status_code == 401, r.text
        assert r.json()["error"]["type"] == "authentication_error"
    r = chat(server, "chat", tier="standard")
    assert r.status_code == 200, r.text
    assert r.headers["x-raylane-route"] == "chat" and r.headers["x-raylane-pool"] == "chat"
    assert r.headers["x-raylane-tier"] == "standard" and "x-raylane-fallback" not in r.headers


def test_auto_sends_a_coding_prompt_to_the_coding_pool(server):
    import openai

    client = openai.OpenAI(
        base_url=server.base_url, api_key=ROUTER_KEYS["premium"], max_retries=0, timeout=120
    )
    prompt = "Write a Python function that parses a CSV file and returns its rows as a list of dicts."
    for model in ("auto", "raylane-auto"):
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=4
        )
        assert raw.headers["x-raylane-route"] == "coding" and raw.headers["x-raylane-pool"] == "coding"
        assert raw.headers["x-raylane-tier"] == "premium"
        assert raw.parse().choices[0].message is not None
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-17", messages=HI, max_tokens=4)


def test_premium_queued_behind_standard_requests_starts_first(server):
    server.set_fault("chat", "hold")  # the first request holds chat's only slot until released
    finished: list[str] = []
    lock = threading.Lock()

    def send(name: str, tier: str) -> httpx2.Response:
        r = chat(server, "chat", tier=tier)
        with lock:
            finished.append(name)
        return r

    with ThreadPoolExecutor(4) as pool:
        try:
            futures = {"A": pool.submit(send, "A", "standard")}
            wait_for(lambda: load(server, "chat")["in_flight"] == 1, "A to take chat's slot")
            futures |= {name: pool.submit(send, name, "standard") for name in ("B1", "B2")}
            wait_for(lambda: load(server, "chat")["waiting"] == 2, "B1 and B2 to queue")
            futures["C"] = pool.submit(send, "C", "premium")
            wait_for(lambda: load(server, "chat")["waiting"] == 3, "C to queue")
        finally:
            server.set_fault("chat", None)
        responses = {name: f.result() for name, f in futures.items()}
    assert all(r.status_code == 200 for r in responses.values()), {n: r.text for n, r in responses.items()}
    assert finished.index("C") < finished.index("B1") and finished.index("C") < finished.index("B2"), finished
    assert responses["C"].headers["x-raylane-tier"] == "premium"


def test_sheddable_tier_past_its_budget_gets_429_while_premium_completes(server):
    server.set_fault("chat", "hold")
    with ThreadPoolExecutor(1) as pool:
        try:
            premium = pool.submit(chat, server, "chat", "premium")
            wait_for(lambda: load(server, "chat")["in_flight"] == 1, "premium to take chat's slot")
            r = chat(server, "chat", tier="free")
        finally:
            server.set_fault("chat", None)
        assert r.status_code == 429, r.text
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "overloaded"
        assert r.headers["x-raylane-tier"] == "free" and r.headers["x-raylane-route"] == "chat"
        assert premium.result().status_code == 200


def test_a_pool_that_stops_answering_sends_its_route_down_the_fallback_chain(server):
    server.set_fault("coding", "down")
    try:
        wait_for(lambda: health(server)["pools"]["coding"]["status"] == "unavailable", "coding to look down")
        r = chat(server, "coding")
        assert r.status_code == 200, r.text
        assert r.headers["x-raylane-route"] == "coding" and r.headers["x-raylane-pool"] == "chat"
        assert r.headers["x-raylane-fallback"] == "coding;reason=unhealthy"
    finally:
        server.set_fault("coding", None)
    wait_for(lambda: health(server)["pools"]["coding"]["status"] == "ok", "coding to answer again")
    r = chat(server, "coding")
    assert r.headers["x-raylane-pool"] == "coding" and "x-raylane-fallback" not in r.headers


def test_a_pool_too_busy_to_answer_its_probe_keeps_its_traffic(server):
    """Busy is not down: the probe waits behind the pool's streams past its bound, but Serve and Ray
    still have the replica, so requests go to it, not down the fallback chain, and /health stays 200."""
    server.set_fault("coding", "busy")
    try:
        wait_for(lambda: health(server)["pools"]["coding"]["status"] == "busy", "coding's probe to time out")
        r = chat(server, "coding")
        assert r.status_code == 200, r.text
        assert r.headers["x-raylane-pool"] == "coding" and "x-raylane-fallback" not in r.headers
        assert httpx2.get(f"{server.url}/health", headers=bearer("premium"), timeout=30).status_code == 200
    finally:
        server.set_fault("coding", None)
    wait_for(lambda: health(server)["pools"]["coding"]["status"] == "ok", "coding to answer again")


def test_errors_open_the_circuit_and_a_successful_probe_closes_it(server):
    server.set_fault("coding", "error")
    try:
        for _ in range(2):  # failure_threshold = 2
            r = chat(server, "coding")
            assert r.status_code == 200, r.text
            assert r.headers["x-raylane-pool"] == "chat"
            assert r.headers["x-raylane-fallback"] == "coding;reason=error"
        r = chat(server, "coding")
        assert r.headers["x-raylane-pool"] == "chat"
        assert r.headers["x-raylane-fallback"] == "coding;reason=circuit_open"
    finally:
        server.set_fault("coding", None)
    # After the cool-down one probe goes to coding; it succeeds, so the circuit closes.
    r = wait_for(
        lambda: (r := chat(server, "coding")).headers["x-raylane-pool"] == "coding" and r,
        "the probe to reach coding",
    )
    assert r.status_code == 200 and "x-raylane-fallback" not in r.headers
    assert load(server, "coding")["circuit"] == "closed"
    assert chat(server, "coding").headers["x-raylane-pool"] == "coding"


def test_a_prompt_too_long_for_a_pool_goes_to_one_with_a_longer_context(server):
    long_prompt = [{"role": "user", "content": " ".join(["tell me about the weather"] * 40)}]
    r = chat(server, "reasoning", messages=long_prompt)
    assert r.status_code == 200, r.text
    assert r.headers["x-raylane-route"] == "reasoning" and r.headers["x-raylane-pool"] == "chat"
    assert r.headers["x-raylane-fallback"] == "reasoning;reason=context_length"
    short = chat(server, "reasoning", max_tokens=2)
    assert short.status_code == 200, short.text
    assert short.headers["x-raylane-pool"] == "reasoning" and "x-raylane-fallback" not in short.headers


def test_a_response_ends_with_the_pools_last_item(server):
    """The gateway ends a response on the pool's last item (a stream's [DONE] event, a whole JSON
    body), not when the pool's stream closes after it. Here the pool holds each stream open until
    the fault is cleared: a client that reads the body to its end (curl, httpx, the async `openai`
    client) would wait for that close."""
    body = {"model": "coding", "messages": HI, "max_tokens": 6, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {ROUTER_KEYS['premium']}"}
    url = f"{server.base_url}/chat/completions"
    stream_body = body | {"stream": True, "stream_options": {"include_usage": True}}
    server.set_fault("coding", "linger")
    try:
        streamed = httpx2.post(url, json=stream_body, headers=headers, timeout=30)
        whole = httpx2.post(url, json=body, headers=headers, timeout=30)
        in_flight = load(server, "coding")["in_flight"]
    finally:
        server.set_fault("coding", None)
    assert streamed.status_code == 200 and whole.status_code == 200, (streamed.text, whole.text)
    events = [line[len("data: ") :] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["usage"]["completion_tokens"] == 6
    assert json.loads(events[-3])["choices"][0]["finish_reason"] == "length"
    assert whole.json()["usage"]["completion_tokens"] == 6
    assert in_flight == 0  # the pool's slots came back with the responses


def test_a_key_over_its_rate_limit_gets_429_before_its_body_is_parsed(server):
    """The rate limit is charged right after the body's bytes are read, before anything parses them:
    the key's one request a minute is spent on a body that is not JSON (400), and the same body again
    is a 429, not a 400: a key over its limit costs the gateway a bounded read and a look-up."""
    url, headers = f"{server.base_url}/chat/completions", {"Authorization": f"Bearer {LIMITED_KEY}"}
    first = httpx2.post(url, content=b'{"model": "chat", "messages": [', headers=headers, timeout=TIMEOUT_S)
    assert first.status_code == 400 and first.json()["error"]["code"] == "invalid_json", first.text
    again = httpx2.post(url, content=b'{"model": "chat", "messages": [', headers=headers, timeout=TIMEOUT_S)
    assert again.status_code == 429, again.text
    assert again.json()["error"]["code"] == "rate_limit_exceeded"
    assert "requests/min" in again.json()["error"]["message"]
    assert int(again.headers["retry-after"]) >= 1
