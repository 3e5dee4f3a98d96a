"""A pool replica dies while requests stream through it.

App: pool `primary` (two replicas) falling back to `backup`. Eight streams run; one primary replica's
actor is killed; sixteen more requests start right after. A stream that had begun on the dead
replica must end with an error event (the SDK raises), never hang; a request not yet answered must
be served by the other replica or by `backup`; Serve must bring the replica back.
"""

import threading
import time

import openai
import pytest

from tests.live_servers import wait_until
from tests.reliability.conftest import deployed, llama_pool

APP = "rel-replicas"
STREAMS, LATE = 8, 16
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def app(api_server, demo_models):
    config = {
        "gateway": {"num_cpus": 0.1, "pool_health_period_s": 0.5},
        "pools": [
            llama_pool(demo_models, "primary", replicas={"min_replicas": 2, "max_replicas": 2}),
            llama_pool(demo_models, "backup"),
        ],
        "router": {"routes": [{"name": "chat", "pool": "primary", "fallbacks": ["backup"]}]},
    }
    with deployed(api_server, APP, config) as url:
        yield url


def primary_replicas() -> list[str]:
    import ray

    return [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith("SERVE_REPLICA::") and f"{APP}#ModelPool:primary#" in a["name"]
    ]


def running_primary_replicas() -> int:
    from ray import serve

    deployment = serve.status().applications[APP].deployments["ModelPool:primary"]
    return deployment.replica_states.get("RUNNING", 0)


class Outcome:
    """What one request ended as: `ok` (whole answer), `error_event` (a stream cut with an error
    event), `status N` (an HTTP error) or `hang` (still running at the end)."""

    def __init__(self) -> None:
        self.kind = "hang"
        self.started_streaming = threading.Event()
        self.fallback: str | None = None


def run_request(client: openai.OpenAI, outcome: Outcome, stream: bool) -> None:
    body = {"model": "primary", "messages": [{"role": "user", "content": "tell me a story"}]}
    try:
        if stream:
            with client.chat.completions.with_streaming_response.create(
                **body, stream=True, max_tokens=400, extra_body={"ignore_eos": True}
            ) as raw:
                outcome.fallback = raw.headers.get("x-raylane-fallback")
                finish = None
                for chunk in raw.parse():
                    outcome.started_streaming.set()
                    if chunk.choices and chunk.choices[0].finish_reason:
                        finish = chunk.choices[0].finish_reason
                outcome.kind = "ok" if finish == "length" else f"truncated ({finish})"
        else:
            raw = client.chat.completions.with_raw_response.create(**body, max_tokens=16)
            outcome.fallback = raw.headers.get("x-raylane-fallback")
            outcome.kind = "ok" if raw.parse().choices[0].message.content else "empty"
    except openai.APIStatusError as e:
        outcome.kind = f"status {e.status_code}"
    except openai.APIError:  # an error event inside the stream
        outcome.kind = "error_event"
    except Exception as e:  # anything else is a finding too, not a silent thread death
        outcome.kind = f"{type(e).__name__}: {e}"


def test_replica_death_loses_no_request_and_the_replica_comes_back(app, report):
    import ray

    client = openai.OpenAI(base_url=f"{app}/v1", api_key="x", max_retries=0, timeout=180)
    assert len(primary_replicas()) == 2
    early = [Outcome() for _ in range(STREAMS)]
    threads = [threading.Thread(target=run_request, args=(client, o, True)) for o in early]
    for t in threads:
        t.start()
    for o in early:
        assert o.started_streaming.wait(120), "a stream did not start"
    victim = primary_replicas()[0]
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    killed_at = time.monotonic()

    late = [Outcome() for _ in range(LATE)]
    late_threads = [
        threading.Thread(target=run_request, args=(client, o, i % 2 == 0)) for i, o in enumerate(late)
    ]
    for t in late_threads:
        t.start()
    for t in threads + late_threads:
        t.join(timeout=240)

    early_kinds = [o.kind for o in early]
    late_kinds = [o.kind for o in late]
    assert "hang" not in early_kinds + late_kinds  # every request ended
    assert set(early_kinds) <= {"ok", "error_event"}, early_kinds
    assert "error_event" in early_kinds  # some streams ran on the killed replica and were told so
    assert late_kinds == ["ok"] * LATE, late_kinds  # nothing new was lost

    wait_until(
        lambda: running_primary_replicas() == 2 and victim not in primary_replicas(), 240, "replica back"
    )
    recovered_s = time.monotonic() - killed_at
    served = client.chat.completions.with_raw_response.create(
        model="primary", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert served.headers["x-raylane-pool"] == "primary"
    report(
        "replica death",
        sent=STREAMS + LATE,
        lost=0,
        cut_with_error_event=early_kinds.count("error_event"),
        late_fallbacks=sum(1 for o in late if o.fallback),
        status_5xx=0,
        recovery_s=round(recovered_s, 1),
    )
