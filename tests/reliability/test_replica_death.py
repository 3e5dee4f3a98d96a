"""A pool replica dies while requests stream through it.

App: pool `primary` (two replicas) falling back to `backup`. Sixteen greedy streams of 200 tokens run
once undisturbed, then again; in the second run one primary replica's actor is killed once every
stream has sent some text. Beside them run a `json_schema` stream, a `tool_choice: "required"`
stream and a `/v1/responses` stream with a JSON schema, all three on the replica that is killed. No
stream may be cut: the streams on the dead replica are resumed on the live one
(deployments/gateway/resumption.py) and each text must be token-identical to its undisturbed run, with the
same usage; the constrained outputs must still validate. Sixteen more requests start right after the
kill and must all be served; Serve must bring the replica back.
"""

import json
import threading
import time

import jsonschema
import openai
import pytest

from tests.live_servers import wait_until
from tests.reliability.conftest import (
    deployed,
    llama_pool,
    ongoing,
    replica_names,
    resumptions,
    running_replicas,
)

APP = "rel-replicas"
STREAMS, LATE, TOKENS = 16, 16, 200
# Every stream has sent this many chunks when the replica is killed: the first token, then what ~50
# ms of steps made (the pool's stream_batching_interval_ms), so each is early in its answer.
KILL_AFTER_CHUNKS = 2
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def app(api_server, demo_models):
    # Room for all eighteen streams on one replica once the other is dead (no preemption needed).
    engine = {"max_num_seqs": STREAMS + len(STRUCTURED), "num_kv_blocks": 480}
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
    return replica_names(APP, "ModelPool:primary")


def running_primary_replicas() -> int:
    return running_replicas(APP, "ModelPool:primary")


class Outcome:
    """What one request ended as: `ok` (whole answer), `error_event` (a stream cut with an error
    event), `status N` (an HTTP error) or `hang` (still running at the end); a stream's text, id,
    usage and how many chunks it has had so far."""

    def __init__(self) -> None:
        self.kind = "hang"
        self.chunks = 0
        self.text = ""
        self.ids: set[str] = set()
        self.calls: dict[int, list[str]] = {}  # tool call index -> [name, arguments]
        self.finish: str | None = None
        self.sequence_numbers: list[int] = []  # a Responses stream's events'
        self.final_text: str | None = None  # a Responses stream's text as its `response.completed` has it
        self.usage = None
        self.fallback: str | None = None
        self.error: str | None = None
        self.times: list[float] = []  # when each chunk came
        self.progressed = threading.Event()  # set once KILL_AFTER_CHUNKS chunks have come

    def tick(self) -> None:
        """One more chunk (or event) came."""
        self.chunks += 1
        self.times.append(time.monotonic())
        if self.chunks >= KILL_AFTER_CHUNKS:
            self.progressed.set()


def story(i: int) -> dict:
    content = f"tell me story number {i} about a {['cat', 'ship', 'tree'][i % 3]}"
    return {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": TOKENS,
        "extra_body": {"ignore_eos": True},
    }


# Constrained outputs of about 250 and 300 tokens on the test checkpoint (a random-weight Llama),
# which the grammar alone ends: the resumed part must keep the JSON valid and closed.
FORECAST = {
    "type": "object",
    "properties": {
        "forecast": {
            "type": "array",
            "items": {"enum": ["sun", "rain", "snow", "fog"]},
            "minItems": 48,
            "maxItems": 48,
        }
    },
    "required": ["forecast"],
    "additionalProperties": False,
}
# One long system prompt shared by all three: the pool's prefix-aware router
# (deployments/gateway/request_router.py) sends the later ones to the replica that holds the first's prefix.
WEATHER_DESK = [{"role": "system", "content": "You are the weather desk of a coastal radio station. " * 10}]
FINISH = {"json_schema": "stop", "tool_required": "tool_calls", "responses_schema": "completed"}
STRUCTURED = {
    "json_schema": {
        "messages": [*WEATHER_DESK, {"role": "user", "content": "the week's forecast for Oslo, as JSON"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "forecast", "schema": FORECAST}},
        "max_tokens": 600,
    },
    "tool_required": {
        "messages": [*WEATHER_DESK, {"role": "user", "content": "record the forecast for Lima"}],
        "tools": [{"type": "function", "function": {"name": "record_forecast", "parameters": FORECAST}}],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": 600,
    },
    "responses_schema": {
        "input": [*WEATHER_DESK, {"role": "user", "content": "the week's forecast for Quito, as JSON"}],
        "text": {"format": {"type": "json_schema", "name": "forecast", "schema": FORECAST}},
        "max_output_tokens": 600,
        "store": False,
    },
}


def run_stream(client: openai.OpenAI, outcome: Outcome, request: dict, finish: str = "length") -> None:
    try:
        with client.chat.completions.with_streaming_response.create(
            model="primary", stream=True, temperature=0, stream_options={"include_usage": True}, **request
        ) as raw:
            outcome.fallback = raw.headers.get("x-raylane-fallback")
            for chunk in raw.parse():
                outcome.ids.add(chunk.id)
                if chunk.usage is not None:
                    outcome.usage = chunk.usage
                if chunk.choices:
                    delta = chunk.choices[0].delta
                    outcome.text += delta.content or ""
                    for call in delta.tool_calls or []:
                        name, arguments = outcome.calls.setdefault(call.index, ["", ""])
                        fn = call.function
                        outcome.calls[call.index] = [name + (fn.name or ""), arguments + (fn.arguments or "")]
                    outcome.finish = chunk.choices[0].finish_reason or outcome.finish
                outcome.tick()
            outcome.kind = "ok" if outcome.finish == finish else f"truncated ({outcome.finish})"
    except openai.APIStatusError as e:
        outcome.kind = f"status {e.status_code}"
    except openai.APIError as e:  # an error event inside the stream
        outcome.kind = "error_event"
        outcome.error = str(e)
    except Exception as e:  # anything else is a finding too, not a silent thread death
        outcome.kind = f"{type(e).__name__}: {e}"
    finally:
        outcome.progressed.set()


def run_response_stream(client: openai.OpenAI, outcome: Outcome, request: dict, finish: str) -> None:
    """A streamed /v1/responses request: its text deltas, the final response's text and usage, and
    every event's sequence number."""
    try:
        for event in client.responses.create(model="primary", stream=True, temperature=0, **request):
            outcome.sequence_numbers.append(event.sequence_number)
            if event.type in ("response.created", "response.completed"):
                outcome.ids.add(event.response.id)
            if event.type == "response.output_text.delta":
                outcome.text += event.delta
            elif event.type == "response.completed":
                outcome.finish, outcome.usage = "completed", event.response.usage
                outcome.final_text = event.response.output_text
            elif event.type in ("error", "response.failed"):
                outcome.kind, outcome.error = "error_event", str(event)
                return
            outcome.tick()
        outcome.kind = "ok" if outcome.finish == finish else f"truncated ({outcome.finish})"
    except openai.APIStatusError as e:
        outcome.kind = f"status {e.status_code}"
    except Exception as e:
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


def start(client: openai.OpenAI, requests: list[dict], finishes: list[str]) -> tuple[list[Outcome], list]:
    outcomes = [Outcome() for _ in requests]
    threads = [
        threading.Thread(target=run_stream, args=(client, o, r, f))
        for o, r, f in zip(outcomes, requests, finishes, strict=True)
    ]
    for t in threads:
        t.start()
    return outcomes, threads


def start_stories(client: openai.OpenAI) -> tuple[list[Outcome], list]:
    return start(client, [story(i) for i in range(STREAMS)], ["length"] * STREAMS)


def start_structured(client: openai.OpenAI) -> dict[str, tuple[Outcome, threading.Thread]]:
    """The constrained streams, one after the other: the later ones follow the first's prefix to its
    replica (in both runs, so the replica also holds each one's own prompt from the first)."""
    started = {}
    for name, request in STRUCTURED.items():
        outcome = Outcome()
        target = run_response_stream if name == "responses_schema" else run_stream
        thread = threading.Thread(target=target, args=(client, outcome, request, FINISH[name]))
        thread.start()
        started[name] = outcome, thread
        assert outcome.progressed.wait(60), f"{name} did not get going"
    return started


def check_structured(name: str, outcome: Outcome) -> None:
    """The constrained output a client gets validates against the schema."""
    if name == "tool_required":
        [(call, arguments)] = outcome.calls.values()
        assert call == "record_forecast"
        jsonschema.validate(json.loads(arguments), FORECAST)
    else:
        jsonschema.validate(json.loads(outcome.text), FORECAST)
    if name == "responses_schema":  # one event sequence, the final response holding what the deltas did
        assert outcome.sequence_numbers == list(range(len(outcome.sequence_numbers)))
        assert outcome.final_text == outcome.text


def completion_tokens(outcome: Outcome) -> int:
    usage = outcome.usage
    return usage.output_tokens if hasattr(usage, "output_tokens") else usage.completion_tokens


def test_replica_death_cuts_no_stream_and_the_replica_comes_back(app, report):
    import ray

    client = openai.OpenAI(base_url=f"{app}/v1", api_key="x", max_retries=0, timeout=240)
    assert len(primary_replicas()) == 2
    calm = start_structured(client)
    undisturbed, threads = start_stories(client)
    for t in threads + [t for _, t in calm.values()]:
        t.join(timeout=300)
    assert [o.kind for o in undisturbed] == ["ok"] * STREAMS
    for name, (outcome, _) in calm.items():
        assert outcome.kind == "ok", (name, outcome.kind, outcome.error)
        check_structured(name, outcome)
    resumed_before = resumptions(app)

    structured = start_structured(client)
    replicas = primary_replicas()
    wait_until(
        lambda: max(ongoing(r) for r in replicas) >= len(STRUCTURED),
        30,
        "the constrained streams on one replica",
    )
    victim = max(replicas, key=ongoing)
    streams, threads = start_stories(client)
    for o in streams:
        assert o.progressed.wait(180), "a stream did not get going"
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    killed_at = time.monotonic()
    in_flight = sum(o.kind == "hang" for o in streams)
    # The constrained streams were on the killed replica with output still to come.
    assert [o.kind for o, _ in structured.values()] == ["hang"] * len(STRUCTURED)

    late = [Outcome() for _ in range(LATE)]
    late_threads = [threading.Thread(target=run_request, args=(client, o)) for o in late]
    for t in late_threads:
        t.start()
    for t in threads + late_threads + [t for _, t in structured.values()]:
        t.join(timeout=300)

    kinds = [o.kind for o in streams]
    assert "hang" not in kinds + [o.kind for o in late]  # every request ended
    assert kinds == ["ok"] * STREAMS, [o.error for o in streams]  # no stream was cut
    resumed = resumptions(app) - resumed_before
    assert resumed >= len(STRUCTURED)  # at least the constrained streams went on elsewhere
    for i, (before, after) in enumerate(zip(undisturbed, streams, strict=True)):
        assert after.text == before.text, f"stream {i} differs from its undisturbed run"
        assert len(after.ids) == 1  # one response id from the first chunk to the last
        assert after.usage.completion_tokens == TOKENS
        assert after.usage.prompt_tokens == before.usage.prompt_tokens
    for name, (after, _) in structured.items():
        before = calm[name][0]
        assert after.kind == "ok", (name, after.kind, after.error)
        check_structured(name, after)  # the resumed output still validates
        assert (after.text, after.calls) == (before.text, before.calls), (
            f"{name} differs from its undisturbed run"
        )
        assert len(after.ids) == 1
        assert completion_tokens(after) == completion_tokens(before)
    assert [o.kind for o in late] == ["ok"] * LATE  # nothing new was lost

    wait_until(
        lambda: running_primary_replicas() == 2 and victim not in primary_replicas(), 240, "replica back"
    )
    recovered_s = time.monotonic() - killed_at
    # From the kill to each stream's next chunk: the worst is a resumed stream's wait (bench/README.md);
    # a constrained one's includes its grammar's first compile on the replica it resumed on.
    every = streams + [o for o, _ in structured.values()]

    def worst_wait_s(outcomes: list[Outcome]) -> float:
        waits = [
            next(t for t in o.times if t > killed_at) - killed_at for o in outcomes if o.times[-1] > killed_at
        ]
        return round(max(waits, default=0.0), 2)

    served = client.chat.completions.with_raw_response.create(
        model="primary", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert served.headers["x-raylane-pool"] == "primary"
    report(
        "replica death",
        sent=STREAMS + len(STRUCTURED) + LATE,
        lost=0,
        streams_in_flight=in_flight + len(STRUCTURED),
        streams_cut=[o.kind for o in every].count("error_event"),
        resumed=int(resumed),
        constrained_resumed_valid=len(STRUCTURED),
        late_fallbacks=sum(1 for o in late if o.fallback),
        status_5xx=0,
        recovery_s=round(recovered_s, 1),
        kill_to_next_chunk_max_s=worst_wait_s(streams),
        constrained_kill_to_next_chunk_max_s=worst_wait_s([o for o, _ in structured.values()]),
    )
