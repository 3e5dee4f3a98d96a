"""A pool replica dies while requests stream through it.

App: pool `primary` (two replicas) falling back to `backup`. Sixteen greedy streams of 200 tokens run
once undisturbed, then again; in the second run one primary replica's actor is killed once every
stream has sent some text. No stream may be cut: the streams on the dead replica are resumed on the
live one (deployments/resumption.py) and each text must be token-identical to its undisturbed run,
with the same usage. Sixteen more requests start right after the kill and must all be served; Serve
must bring the replica back.
"""

import threading
import time

import httpx2
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.live_servers import wait_until
from tests.reliability.conftest import deployed, llama_pool

APP = "rel-replicas"
STREAMS, LATE, TOKENS = 16, 16, 200
KILL_AFTER_CHUNKS = 10  # every stream has sent this much text when the replica is killed
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def app(api_server, demo_models):
    # Room for all sixteen streams on one replica once the other is dead (no preemption needed).
    engine = {"max_num_seqs": STREAMS, "num_kv_blocks": 320}
    two = {"min_replicas": 2, "max_replicas": 2}
    config = {
        "gateway": {"num_cpus": 0.1, "pool_health_period_s": 0.5},
        "pools": [
            llama_pool(demo_models, "primary", replicas=two, engine=engine),
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


def resumptions(url: str) -> float:
    text = httpx2.get(f"{url}/metrics", timeout=60).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "raylane_stream_resumptions_total" and s.labels.get("pool") in ("primary", "backup")
    )


class Outcome:
    """What one request ended as: `ok` (whole answer), `error_event` (a stream cut with an error
    event), `status N` (an HTTP error) or `hang` (still running at the end); a stream's text, id,
    usage and how many chunks it has had so far."""

    def __init__(self) -> None:
        self.kind = "hang"
        self.chunks = 0
        self.text = ""
        self.ids: set[str] = set()
        self.usage = None
        self.fallback: str | None = None
        self.error: str | None = None
        self.times: list[float] = []  # when each chunk came
        self.progressed = threading.Event()  # set once KILL_AFTER_CHUNKS chunks have come


def prompt(i: int) -> list[dict]:
    return [{"role": "user", "content": f"tell me story number {i} about a {['cat', 'ship', 'tree'][i % 3]}"}]


def run_stream(client: openai.OpenAI, outcome: Outcome, i: int) -> None:
    try:
        with client.chat.completions.with_streaming_response.create(
            model="primary",
            messages=prompt(i),
            stream=True,
            max_tokens=TOKENS,
            temperature=0,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        ) as raw:
            outcome.fallback = raw.headers.get("x-raylane-fallback")
            finish = None
            for chunk in raw.parse():
                outcome.ids.add(chunk.id)
                if chunk.usage is not None:
                    outcome.usage = chunk.usage
                if chunk.choices:
                    outcome.text += chunk.choices[0].delta.content or ""
                    finish = chunk.choices[0].finish_reason or finish
                outcome.chunks += 1
                outcome.times.append(time.monotonic())
                if outcome.chunks >= KILL_AFTER_CHUNKS:
                    outcome.progressed.set()
            outcome.kind = "ok" if finish == "length" else f"truncated ({finish})"
    except openai.APIStatusError as e:
        outcome.kind = f"status {e.status_code}"
    except openai.APIError as e:  # an error event inside the stream
        outcome.kind = "error_event"
        outcome.error = str(e)
    except Exception as e:  # anything else is a finding too, not a silent thread death
        outcome.kind = f"{type(e).__name__}: {e}"
    finally:
        outcome.progressed.set()


def run_request(client: openai.OpenAI, outcome: Outcome) -> None:
    try:
        raw = client.chat.completions.with_raw_response.create(
            model="primary", messages=[{"role": "user", "content": "tell me a story"}], max_tokens=16
        )
        outcome.fallback = raw.headers.get("x-raylane-fallback")
        outcome.kind = "ok" if raw.parse().choices[0].message.content else "empty"
    except openai.APIStatusError as e:
        outcome.kind = f"status {e.status_code}"
    except Exception as e:
        outcome.kind = f"{type(e).__name__}: {e}"


def run_streams(client: openai.OpenAI) -> tuple[list[Outcome], list[threading.Thread]]:
    outcomes = [Outcome() for _ in range(STREAMS)]
    threads = [threading.Thread(target=run_stream, args=(client, o, i)) for i, o in enumerate(outcomes)]
    for t in threads:
        t.start()
    return outcomes, threads


def test_replica_death_cuts_no_stream_and_the_replica_comes_back(app, report):
    import ray

    client = openai.OpenAI(base_url=f"{app}/v1", api_key="x", max_retries=0, timeout=240)
    assert len(primary_replicas()) == 2
    undisturbed, threads = run_streams(client)
    for t in threads:
        t.join(timeout=300)
    assert [o.kind for o in undisturbed] == ["ok"] * STREAMS
    resumed_before = resumptions(app)

    streams, threads = run_streams(client)
    for o in streams:
        assert o.progressed.wait(180), "a stream did not get going"
    victim = primary_replicas()[0]
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    killed_at = time.monotonic()
    in_flight = sum(o.kind == "hang" for o in streams)

    late = [Outcome() for _ in range(LATE)]
    late_threads = [threading.Thread(target=run_request, args=(client, o)) for o in late]
    for t in late_threads:
        t.start()
    for t in threads + late_threads:
        t.join(timeout=300)

    kinds = [o.kind for o in streams]
    assert "hang" not in kinds + [o.kind for o in late]  # every request ended
    assert kinds == ["ok"] * STREAMS, [o.error for o in streams]  # no stream was cut
    resumed = resumptions(app) - resumed_before
    assert resumed >= 1  # some streams ran on the killed replica and went on elsewhere
    for i, (before, after) in enumerate(zip(undisturbed, streams, strict=True)):
        assert after.text == before.text, f"stream {i} differs from its undisturbed run"
        assert len(after.ids) == 1  # one response id from the first chunk to the last
        assert after.usage.completion_tokens == TOKENS
        assert after.usage.prompt_tokens == before.usage.prompt_tokens
    assert [o.kind for o in late] == ["ok"] * LATE  # nothing new was lost

    wait_until(
        lambda: running_primary_replicas() == 2 and victim not in primary_replicas(), 240, "replica back"
    )
    recovered_s = time.monotonic() - killed_at
    # From the kill to each stream's next chunk: the worst is a resumed stream's wait (bench/README.md).
    next_chunk_s = [
        next(t for t in o.times if t > killed_at) - killed_at for o in streams if o.times[-1] > killed_at
    ]
    served = client.chat.completions.with_raw_response.create(
        model="primary", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert served.headers["x-raylane-pool"] == "primary"
    report(
        "replica death",
        sent=STREAMS + LATE,
        lost=0,
        streams_in_flight=in_flight,
        streams_cut=kinds.count("error_event"),
        resumed=int(resumed),
        late_fallbacks=sum(1 for o in late if o.fallback),
        status_5xx=0,
        recovery_s=round(recovered_s, 1),
        kill_to_next_chunk_max_s=round(max(next_chunk_s), 2),
    )
