"""Graceful drain before shutdown. `raylane serve` itself is drained by Ctrl-C in
tests/integration/test_openai_api.py (a running stream finishes, new requests get 503 with
Retry-After); here, on an app of its own: the drain's timeout, and a drainer that dies."""

import threading
import time

import httpx2
import openai
import pytest

from tests.live_servers import wait_until
from tests.reliability.conftest import deployed, llama_pool

APP = "rel-drain"
HELLO = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def app(api_server, demo_models):
    with deployed(api_server, APP, {"pools": [llama_pool(demo_models, "chat")]}) as url:
        yield url


def test_drain_turns_new_requests_away_waits_for_streams_up_to_its_timeout(app, report):
    import ray

    from raylane.deployments.gateway.drain import NAMESPACE, coordinator_name, drain_app

    client = openai.OpenAI(base_url=f"{app}/v1", api_key="x", max_retries=0, timeout=300)
    streaming, finish = threading.Event(), []

    def stream() -> None:
        for chunk in client.chat.completions.create(
            **HELLO | {"max_tokens": 1500}, stream=True, extra_body={"ignore_eos": True}
        ):
            streaming.set()
            finish.extend(c.finish_reason for c in chunk.choices if c.finish_reason)

    streamer = threading.Thread(target=stream)
    streamer.start()
    assert streaming.wait(60)
    started = time.monotonic()
    left = drain_app(APP, timeout_s=2.0)
    waited = time.monotonic() - started
    assert list(left.values()) == [1]  # the timeout came first: one stream was still running
    rejected = httpx2.post(f"{app}/v1/chat/completions", json=HELLO, timeout=30)
    assert rejected.status_code == 503 and int(rejected.headers["retry-after"]) >= 1
    assert rejected.json()["error"]["code"] == "draining"
    health = httpx2.get(f"{app}/health", timeout=30)
    assert health.status_code == 503 and health.json()["status"] == "draining"

    # The drainer went away without deleting the app: the gateway takes requests again.
    ray.kill(ray.get_actor(coordinator_name(APP), namespace=NAMESPACE))
    wait_until(
        lambda: httpx2.post(f"{app}/v1/chat/completions", json=HELLO, timeout=30).status_code == 200,
        30,
        "requests served again",
    )
    streamer.join(timeout=300)
    assert finish == ["length"]  # the stream was never cut
    report("graceful drain (timeout)", drain_timeout_s=2, returned_after_s=round(waited, 1), cut=0)
