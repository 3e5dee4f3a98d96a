"""API keys under attack: a missing or wrong key is a 401 in OpenAI's shape on every /v1 endpoint,
keys are compared in constant time, a key's rate limit is a 429 with Retry-After, keys never reach a
log file or a metric, and nothing a client sends raises the tier (or priority) it is served with.

The app under test has three keyed tiers (premium priority 0, free priority 2, limited: 3 requests a
minute) and one real pool behind `RecordingPool`, which notes the priority each request reaches it
with. The keys are unique per run, so finding one in a log file means this run wrote it there.
"""

import hashlib
import json
import uuid
from http.client import HTTPConnection
from pathlib import Path
from urllib.parse import urlsplit

import httpx2
import pytest

from tests.reliability.test_untrusted_input import assert_openai_error

APP = "auth"
RUN = uuid.uuid4().hex[:12]
TIERS = ("premium", "free", "limited", "metered", "embedder", "counter", "sized", "invalid")
KEYS = {tier: f"sk-canary-{tier}-{RUN}" for tier in TIERS}
WRONG_KEY = f"sk-canary-wrong-{RUN}"
PRIORITY = {
    "premium": 0,
    "limited": 1,
    "metered": 1,
    "embedder": 1,
    "counter": 1,
    "sized": 1,
    "invalid": 1,
    "free": 2,
}
LIMITS = {
    "limited": {"requests_per_minute": 3},
    "metered": {"tokens_per_minute": 50},
    "embedder": {"tokens_per_minute": 100},
    "counter": {"tokens_per_minute": 100},
    "sized": {"tokens_per_minute": 1000},
    "invalid": {"tokens_per_minute": 1000},
}
HI = [{"role": "user", "content": "hi"}]


def app_config(demo_models, port: int):
    from raylane.config import ClusterConfig
    from tests.reliability.conftest import llama_pool

    tier = {"max_queue_depth": 16, "max_queue_wait_s": 60}
    return ClusterConfig.from_dict(
        {
            "http": {"host": "127.0.0.1", "port": port},
            "gateway": {"num_cpus": 0.1},  # /metrics asks for a key by default
            "pools": [llama_pool(demo_models, "chat", engine={"max_model_len": 64})],
            "tiers": [
                {"name": name, "priority": PRIORITY[name], **tier, **LIMITS.get(name, {})} for name in KEYS
            ],
            "api_keys": {"keys": {key: tier for tier, key in KEYS.items()}, "default_tier": "free"},
        }
    )


@pytest.fixture(scope="module")
def keyed(api_server, demo_models):
    """The app's URL (…/auth); its pool is a `RecordingPool`."""
    from ray import serve

    from raylane.deployments.app import delete_app
    from tests.live_servers import app_with_pools, wait_healthy
    from tests.reliability.recording_pool import RecordingPool

    config = app_config(demo_models, int(api_server.url.rsplit(":", 1)[1]))
    serve.run(app_with_pools(config, RecordingPool), name=APP, route_prefix=f"/{APP}")
    url = f"{api_server.url}/{APP}"
    try:
        wait_healthy(f"{url}/health", 300)
        yield url
    finally:
        delete_app(APP)


@pytest.fixture(scope="module")
def http(keyed):
    with httpx2.Client(base_url=keyed, timeout=120) as client:
        yield client


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def seen_by_pool(method: str, user: str) -> list:
    from ray import serve

    from raylane.deployments.app import pool_deployment_name

    handle = serve.get_deployment_handle(pool_deployment_name("chat"), app_name=APP)
    return getattr(handle, method).remote(user).result(timeout_s=30)


def priorities_seen(user: str) -> list[int]:
    return seen_by_pool("priorities", user)


ENDPOINTS = [
    ("POST", "/v1/chat/completions", {"model": "chat", "messages": HI, "max_tokens": 1}),
    ("POST", "/v1/completions", {"model": "chat", "prompt": "hi", "max_tokens": 1}),
    ("POST", "/v1/embeddings", {"model": "all-MiniLM-L6-v2", "input": "hi"}),
    ("GET", "/v1/models", None),
    ("GET", "/v1/models/chat", None),
]


@pytest.mark.parametrize(("method", "path", "body"), ENDPOINTS, ids=[f"{m} {p}" for m, p, _ in ENDPOINTS])
def test_a_missing_or_wrong_key_is_401(http, method, path, body):
    premium = KEYS["premium"]
    for headers in (
        {},
        bearer(WRONG_KEY),
        bearer(premium[:-1]),  # all but the last character of a real key
        bearer(premium + "x"),
        {"Authorization": f"Basic {premium}"},  # a real key, but not as a bearer token
        {"x-api-key": WRONG_KEY},
    ):
        r = http.request(method, path, json=body, headers=headers)
        error = assert_openai_error(r, 401)
        assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key", error
        assert premium not in r.text and WRONG_KEY not in r.text  # an error never echoes a key
    for headers in (bearer(premium), {"x-api-key": premium}):
        assert http.request(method, path, json=body, headers=headers).status_code == 200


def test_keys_are_compared_in_constant_time(monkeypatch):
    """Every request compares a SHA-256 digest of what it presents with the digest of every known key
    through hmac.compare_digest: the same work for a right key, a wrong one and one that shares all
    but its last character with a real key, so the time taken says nothing about how close it was."""
    import hmac

    import raylane.router.tiers as tiers
    from raylane.config import ApiKeysConfig, default_tiers

    known = {f"sk-{i}-{uuid.uuid4().hex}": "premium" for i in range(5)}
    auth = tiers.ApiKeyAuthenticator(ApiKeysConfig(keys=known), default_tiers())
    calls: list[tuple[bytes, bytes]] = []
    compare = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return compare(a, b)

    monkeypatch.setattr(tiers.hmac, "compare_digest", spy)
    real = next(iter(known))
    for presented in (real, real[:-1] + "x", real[:8], "sk-" + "z" * 4096, "x"):
        calls.clear()
        try:
            auth.authenticate({"authorization": f"Bearer {presented}"})
        except tiers.AuthenticationError:
            assert presented != real
        assert len(calls) == len(known), presented  # no early exit, match or not
        digest = hashlib.sha256(presented.encode()).digest()
        assert all(b == digest and len(a) == 32 for a, b in calls)  # digests only: no prefix to leak
        assert sorted(a for a, _ in calls) == sorted(hashlib.sha256(k.encode()).digest() for k in known)


def test_a_keys_rate_limit_is_429_with_retry_after(http):
    key = KEYS["limited"]  # 3 requests a minute
    body = {"model": "chat", "prompt": "hi", "max_tokens": 1}
    for _ in range(3):
        assert http.post("/v1/completions", json=body, headers=bearer(key)).status_code == 200
    for path, limited in (
        ("/v1/completions", body),
        ("/v1/chat/completions", {"model": "chat", "messages": HI, "max_tokens": 1}),
        ("/v1/embeddings", {"model": "all-MiniLM-L6-v2", "input": "hi"}),
    ):
        r = http.post(path, json=limited, headers=bearer(key))
        error = assert_openai_error(r, 429)
        assert error["code"] == "rate_limit_exceeded" and "limited" in error["message"], error
        assert 1 <= int(r.headers["retry-after"]) <= 60, r.headers  # one request's worth: 20 s
    # The limit is the key's: another key is served.
    assert http.post("/v1/completions", json=body, headers=bearer(KEYS["premium"])).status_code == 200


def test_a_streamed_answer_is_charged_its_tokens(http):
    """tokens/min counts a stream's prompt and generated tokens (not its SSE events, which may carry
    several tokens each): one 60-token stream puts the 50 tokens/min key over its limit."""
    body = {
        "model": "chat",
        "messages": [{"role": "user", "content": "one two three four five six seven eight nine ten"}],
        "max_tokens": 40,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with http.stream("POST", "/v1/chat/completions", json=body, headers=bearer(KEYS["metered"])) as r:
        assert r.status_code == 200
        usage = [json.loads(line[6:])["usage"] for line in r.iter_lines() if '"usage":{' in line]
    assert usage[-1]["total_tokens"] > 50 and usage[-1]["completion_tokens"] == 40
    hi = {"model": "chat", "messages": HI, "max_tokens": 1}
    r = http.post("/v1/chat/completions", json=hi, headers=bearer(KEYS["metered"]))
    assert assert_openai_error(r, 429)["code"] == "rate_limit_exceeded"
    assert "tokens/min" in r.json()["error"]["message"]


def test_a_body_the_key_cannot_afford_is_refused_before_it_is_sent(http, keyed):
    """A body is charged on its Content-Length before the gateway reads it: with part of its 1,000
    tokens a minute spent, a key announcing 40,000 bytes (~10,000 tokens) gets its 429 while it has
    sent only the headers, rather than once the gateway has taken in a body it was not going to
    serve. (Before, the gateway waited for the body: this request got no answer at all.)"""
    hi = {"model": "chat", "messages": HI, "max_tokens": 1}
    assert http.post("/v1/chat/completions", json=hi, headers=bearer(KEYS["sized"])).status_code == 200
    url = urlsplit(keyed)
    conn = HTTPConnection(url.hostname, url.port, timeout=30)
    try:
        conn.putrequest("POST", f"{url.path}/v1/chat/completions")
        for name, value in {**bearer(KEYS["sized"]), "Content-Type": "application/json"}.items():
            conn.putheader(name, value)
        conn.putheader("Content-Length", "40000")
        conn.endheaders()  # and no body
        response = conn.getresponse()
        error = json.loads(response.read())["error"]
    finally:
        conn.close()
    assert response.status == 429 and error["code"] == "rate_limit_exceeded", error
    assert "tokens/min" in error["message"] and int(response.getheader("retry-after")) >= 1


def test_an_invalid_body_is_charged_the_bytes_the_gateway_read(http):
    """A body the gateway reads and refuses (400) keeps its charge for those bytes: a key sending
    invalid 8 KB bodies (~2,000 tokens) meets its 1,000 tokens/min at the first, and what follows is
    a 429 that costs the gateway no read. (Refunded in full, invalid 200 KB bodies at 20 a second
    never met the limit: the gateway parsed every one, and another key's latency doubled.)"""
    invalid = {"model": "chat", "messages": "x" * 8000}
    r = http.post("/v1/chat/completions", json=invalid, headers=bearer(KEYS["invalid"]))
    assert assert_openai_error(r, 400)["param"] == "messages", r.text
    for body in (invalid, {"model": "chat", "messages": HI, "max_tokens": 1}):
        r = http.post("/v1/chat/completions", json=body, headers=bearer(KEYS["invalid"]))
        assert assert_openai_error(r, 429)["code"] == "rate_limit_exceeded"
        assert "tokens/min" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("path", "body", "tier"),
    [
        ("/v1/embeddings", {"model": "all-MiniLM-L6-v2", "input": "word " * 100}, "embedder"),
        ("/tokenize", {"model": "chat", "prompt": "word " * 100}, "counter"),
    ],
    ids=["embeddings", "tokenize"],
)
def test_embeddings_and_tokenize_are_charged_their_tokens(http, path, body, tier):
    """MiniLM and a pool's tokenizer work in proportion to the text: a key with 100 tokens a minute
    gets one 500-byte call (~125 tokens, charged before the body is parsed), not two."""
    first = http.post(path, json=body, headers=bearer(KEYS[tier]))
    assert first.status_code == 200, first.text
    r = http.post(path, json=body, headers=bearer(KEYS[tier]))
    assert assert_openai_error(r, 429)["code"] == "rate_limit_exceeded"
    assert "tokens/min" in r.json()["error"]["message"]


def test_a_client_cannot_raise_its_own_tier(http):
    spoofed = {
        "x-raylane-tier": "premium",
        "x-raylane-priority": "0",
        "x-tier": "premium",
        "priority": "u=0",  # HTTP's own priority header (RFC 9218)
        "x-api-key": KEYS["premium"],  # a second key: the bearer token is the one that counts
    }
    user = f"spoofer-{RUN}"
    body = {"model": "chat", "messages": HI, "max_tokens": 1, "user": user, "service_tier": "priority"}
    for stream in (False, True):
        r = http.post(
            "/v1/chat/completions", json=body | {"stream": stream}, headers=bearer(KEYS["free"]) | spoofed
        )
        assert r.status_code == 200, r.text
        assert r.headers["x-raylane-tier"] == "free"
    r = http.post(
        "/v1/completions",
        json={
            "model": "chat",
            "prompt": "hi",
            "max_tokens": 1,
            "user": user,
            "metadata": {"tier": "premium"},
        },
        headers=bearer(KEYS["free"]) | spoofed,
    )
    assert r.status_code == 200 and r.headers["x-raylane-tier"] == "free", r.text
    assert priorities_seen(user) == [PRIORITY["free"]] * 3  # what the engine was asked to schedule by
    # A priority in the body is not a parameter at all.
    r = http.post(
        "/v1/chat/completions", json={**body, "priority": 0, "tier": "premium"}, headers=bearer(KEYS["free"])
    )
    assert assert_openai_error(r, 400)["code"] == "unknown_parameter"
    # The control: the premium key itself is served as premium, at priority 0.
    r = http.post(
        "/v1/chat/completions", json=body | {"user": f"premium-{RUN}"}, headers=bearer(KEYS["premium"])
    )
    assert r.status_code == 200 and r.headers["x-raylane-tier"] == "premium"
    assert priorities_seen(f"premium-{RUN}") == [PRIORITY["premium"]]
    # The engine shares a priority's slots between the keys it was told of: each request is its
    # key's (an id, never the key), whatever `user` the body names.
    free, premium = seen_by_pool("tenants", user), seen_by_pool("tenants", f"premium-{RUN}")
    assert len(set(free)) == 1 and len(free) == 3 and free[0] != premium[0], (free, premium)
    assert all(t.startswith("key-") and KEYS["free"] not in t for t in free + premium)


def ray_log_files() -> list[Path]:
    """Every file under this test session's Ray log folder: the gateway and pool replicas' logs, their
    stdout/stderr, Serve's proxy and controller logs and the request logs (raylane_requests_*.jsonl)."""
    import ray

    logs = Path(ray._private.worker._global_node.get_logs_dir_path())  # no public API names it
    return [p for p in logs.rglob("*") if p.is_file()]


def test_keys_never_reach_logs_or_metrics(http):
    import time

    marker = f"marker-{RUN}"  # sent as the request id: proves the scan reads the request log
    premium, chat_body = KEYS["premium"], {"model": "chat", "messages": HI, "max_tokens": 1}
    sent = [
        http.post("/v1/chat/completions", json=chat_body, headers=bearer(premium) | {"x-request-id": marker}),
        http.post("/v1/chat/completions", json=chat_body | {"stream": True}, headers={"x-api-key": premium}),
        http.post(
            "/v1/embeddings", json={"model": "all-MiniLM-L6-v2", "input": "x"}, headers=bearer(premium)
        ),
        http.post("/v1/chat/completions", json=chat_body, headers=bearer(WRONG_KEY)),  # 401
        http.post("/v1/chat/completions", json=chat_body, headers={"x-api-key": WRONG_KEY}),  # 401
        http.post("/v1/chat/completions", json={**chat_body, "top_p": 7}, headers=bearer(premium)),  # 400
        http.post("/v1/completions", json={"model": "chat", "prompt": "x"}, headers=bearer(KEYS["limited"])),
    ]
    assert [r.status_code for r in sent][:6] == [200, 200, 200, 401, 401, 400]
    secrets = [*KEYS.values(), WRONG_KEY]
    metrics = http.get("/metrics", headers=bearer(KEYS["free"]))
    assert metrics.status_code == 200 and "raylane_" in metrics.text
    assert not [key for key in secrets if key in metrics.text]
    assert not [key for key in secrets if key in http.get("/health").text]

    deadline = time.monotonic() + 30
    while True:  # the request log line is written once the response is sent
        found: dict[str, list[str]] = {}
        for path in ray_log_files():
            data = path.read_bytes()
            for text in (marker, *secrets):
                if text.encode() in data:
                    found.setdefault(text, []).append(path.name)
        if marker in found or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert marker in found, "the scan did not see the gateway's request log"
    assert not {key: files for key, files in found.items() if key != marker}


def test_probes_tell_a_caller_without_a_key_only_the_status(http):
    """/health without a key says whether to send traffic, not which pools exist or how loaded they
    are; a key holder sees the pools. /metrics (`metrics_require_key`) is a 401 without a key."""
    anonymous = http.get("/health")
    assert anonymous.status_code == 200 and anonymous.json() == {"status": "ok"}
    for headers in ({}, bearer(WRONG_KEY)):
        assert http.get("/health", headers=headers).json() == {"status": "ok"}
    assert set(http.get("/health", headers=bearer(KEYS["free"])).json()["pools"]) == {"chat"}
    assert_openai_error(http.get("/metrics"), 401)
    assert http.get("/metrics", headers=bearer(KEYS["free"])).status_code == 200
