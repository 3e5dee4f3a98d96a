"""A load step scales a pool from one replica to two and back (deployments/pool/autoscaling.py).

App: pool `elastic`, 1 to 2 replicas, scaling on requests waiting in the engines (one per replica),
its engine admitting two sequences at a time; its replicas are simulated (engine/sim/: the real
scheduler and its waiting queue, no weights, so a replica starts without torch). Eight clients
streaming back to back keep six requests waiting on one replica: the policy asks for more replicas
than the maximum, Serve starts the second, and requests reach it. When the load stops, the waiting
queue empties and the pool goes back to one replica. A light trickle of requests runs throughout:
none may fail while replicas come and go.

Bounds: Serve's replicas push their autoscaling metrics every 10 s
(RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S) and a replica takes seconds to start on two
cores, so the scale-up gets 90 s from the load step; the scale-down gets 120 s from its end
(look-back 12 s + downscale delay 5 s + a push interval + draining).
"""

import threading
import time

import httpx2
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.live_servers import wait_until
from tests.reliability.conftest import deployed, ongoing, replica_names, running_replicas, sim_pool

APP, POOL = "rel-autoscale", "ModelPool:elastic"
CLIENTS = 8
UP_WITHIN_S, DOWN_WITHIN_S = 90, 120
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def app(api_server):
    replicas = {
        "min_replicas": 1,
        "max_replicas": 2,
        "target_ongoing_requests": 100,  # in flight alone never asks for a second replica here
        "target_waiting_requests": 1,
        "target_kv_cache_usage": None,
        "look_back_period_s": 12,
        "upscale_delay_s": 1,
        "downscale_delay_s": 5,
    }
    config = {
        "pools": [sim_pool("elastic", replicas=replicas, engine={"max_num_seqs": 2})],
        "tiers": [{"name": "standard", "priority": 1}],  # no rate limit: the load reaches the pool
    }
    with deployed(api_server, APP, config) as url:
        yield url


def scale_events(url: str) -> dict[str, float]:
    text = httpx2.get(f"{url}/metrics", timeout=60).text
    return {
        s.labels["direction"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "raylane_scale_events_total" and s.labels.get("pool") == "elastic"
    }


class Load:
    """Clients sending requests back to back until stopped; every outcome kept."""

    def __init__(self, client: openai.OpenAI, clients: int, stream: bool) -> None:
        self.client, self.stream = client, stream
        self.stop = threading.Event()
        self.outcomes: list[str] = []
        self.threads = [threading.Thread(target=self._run) for _ in range(clients)]
        for t in self.threads:
            t.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            self.outcomes.append(self._one())

    def _one(self) -> str:
        messages = [{"role": "user", "content": "tell me a long story"}]
        try:
            if self.stream:
                chunks = self.client.chat.completions.create(
                    model="elastic",
                    messages=messages,
                    stream=True,
                    max_tokens=64,
                    extra_body={"ignore_eos": True},
                )
                finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            else:
                reply = self.client.chat.completions.create(
                    model="elastic", messages=messages, max_tokens=4, extra_body={"ignore_eos": True}
                )
                finish = reply.choices[0].finish_reason
            return "ok" if finish == "length" else f"finish {finish}"
        except openai.APIStatusError as e:
            return f"status {e.status_code}"
        except Exception as e:  # a cut stream or a dropped connection is a finding too
            return f"{type(e).__name__}: {e}"

    def finish(self) -> list[str]:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in self.threads), "a request hung"
        return self.outcomes


def test_a_load_step_scales_the_pool_up_and_back_down(app, report):
    client = openai.OpenAI(base_url=f"{app}/v1", api_key="x", max_retries=0, timeout=120)
    assert running_replicas(APP, POOL) == 1
    [first] = replica_names(APP, POOL)
    events_before = scale_events(app)
    trickle = Load(client, 1, stream=False)

    load = Load(client, CLIENTS, stream=True)
    started = time.monotonic()
    wait_until(lambda: running_replicas(APP, POOL) == 2, UP_WITHIN_S, "a second replica under load")
    up_s = time.monotonic() - started
    [second] = set(replica_names(APP, POOL)) - {first}
    wait_until(lambda: ongoing(second) > 0, 60, "requests on the new replica")
    peak = load.finish()

    stopped = time.monotonic()
    wait_until(
        lambda: running_replicas(APP, POOL) == 1 and len(replica_names(APP, POOL)) == 1,
        DOWN_WITHIN_S,
        "back to one replica",
    )
    down_s = time.monotonic() - stopped
    calm = trickle.finish()

    assert peak and set(peak) == {"ok"}, [o for o in peak if o != "ok"]  # none lost while scaling up
    assert calm and set(calm) == {"ok"}, [o for o in calm if o != "ok"]  # nor while scaling down
    events = scale_events(app)
    assert events.get("up", 0) > events_before.get("up", 0)
    assert events.get("down", 0) > events_before.get("down", 0)
    report(
        "autoscaling 1->2->1",
        sent=len(peak) + len(calm),
        lost=0,
        status_5xx=0,
        scale_up_s=round(up_s, 1),
        scale_down_s=round(down_s, 1),
    )
