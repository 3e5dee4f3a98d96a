"""Traces of requests, received over the network by a real OTLP/HTTP receiver (bench/otlp_receiver.py).

App: one pool of two replicas (each with its engine core process), API keys on, tracing to the
receiver. A streamed chat request's trace must reach from the gateway's root span, through the
gateway's call to the pool and the pool replica's span, to the engine core's spans, each a child of
the one before it across the process boundaries; a stream whose replica is killed mid-stream and
resumed on the other must show both replicas and the resumption; no span may hold the prompt's
text or the API key.
"""

import json
import sys

import pytest
import requests

from raylane.bench.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.live_servers import wait_healthy

APP = "trace-test"
KEY = "sk-tracing-test-key-7f3a"
SECRET_TEXT = "violet zebra umbrella"  # in every prompt: must not reach a span
MODEL = "primary"
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def receiver():
    receiver = OtlpReceiver()
    yield receiver
    receiver.close()


@pytest.fixture(scope="module")
def app(api_server, demo_models, receiver):
    import ray
    from ray import serve

    from raylane.config import ClusterConfig, PoolConfig
    from raylane.deployments.app import delete_app, gateway_deployment_options, pool_deployment_options
    from raylane.deployments.gateway.ingress import Gateway
    from tests.integration.stalling_pool import StallingPool

    port = int(api_server.url.rsplit(":", 1)[1])
    engine = {"max_num_seqs": 4, "num_kv_blocks": 128, "cpus_per_rank": 0.25, "seed": 0}
    pool = {"name": MODEL, "model": str(demo_models["raylane-llama-tiny"]), "engine": engine}
    config = ClusterConfig.from_dict(
        {
            "http": {"host": "127.0.0.1", "port": port},
            "gateway": {"num_cpus": 0.1, "pool_health_period_s": 0.5},
            "embeddings": {"enabled": False},
            "pools": [pool | {"replicas": {"min_replicas": 2, "max_replicas": 2}}],
            "router": {"routes": [{"name": "chat", "pool": MODEL}]},
            "api_keys": {"keys": {KEY: "premium"}},
            "observability": {"tracing": {"endpoint": receiver.endpoint, "export_delay_ms": 100}},
        }
    )
    tracing = config.observability.tracing
    ray.cloudpickle.register_pickle_by_value(sys.modules[StallingPool.__module__])
    pools = {
        p.name: serve.deployment(StallingPool, **pool_deployment_options(p)).bind(
            p, PoolConfig.engine_config, tracing
        )
        for p in config.pools
    }
    gateway = serve.deployment(Gateway, **gateway_deployment_options(config))
    serve.run(gateway.bind(config.with_key_digests(), pools), name=APP, route_prefix=f"/{APP}")
    url = f"{api_server.url}/{APP}"
    try:
        wait_healthy(f"{url}/health", 300)
        yield url
    finally:
        delete_app(APP)


def chat_body(content: str) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"{SECRET_TEXT}: {content}"}],
        "max_tokens": 24,
        "stream": True,
        "ignore_eos": True,
    }


def events_of(lines) -> list[str]:
    return [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]


def by_name(spans: list[ReceivedSpan], name: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.name == name]


def one(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    [span] = by_name(spans, name)
    return span


def children(spans: list[ReceivedSpan], parent: ReceivedSpan) -> list[ReceivedSpan]:
    return [s for s in spans if s.parent_span_id == parent.span_id]


def assert_nothing_secret(spans: list[ReceivedSpan]) -> None:
    """No prompt text, no API key: in names, attributes, events or resources."""
    text = json.dumps([[s.name, s.attributes, s.events, s.resource] for s in spans], default=str).lower()
    assert SECRET_TEXT not in text and "violet" not in text
    assert KEY.lower() not in text and "sk-tracing" not in text


def is_engine_done(spans: list[ReceivedSpan]) -> bool:
    """The gateway's root, a pool replica's server span and the engine's are in: three processes,
    each exporting its spans as they end, in no set order."""
    pools = [s for s in by_name(spans, f"chat {MODEL}") if s.instance.startswith(f"pool:{MODEL}:")]
    return (
        bool(by_name(spans, "engine.request"))
        and bool(by_name(spans, "POST /v1/chat/completions"))
        and bool(pools)
    )


def test_a_streamed_chat_request_is_one_trace_from_the_gateway_to_the_engine_core(app, receiver):
    headers = {"authorization": f"Bearer {KEY}"}
    url = f"{app}/v1/chat/completions"
    with requests.post(url, json=chat_body("a story"), headers=headers, timeout=120, stream=True) as r:
        assert r.status_code == 200
        trace_id = r.headers["x-raylane-trace-id"]
        assert r.headers["traceparent"].split("-")[1] == trace_id
        events = events_of(r.iter_lines(decode_unicode=True))
    assert events[-1] == "[DONE]" and not any('"error"' in e for e in events)
    spans = receiver.wait_for(trace_id, is_engine_done, what="the gateway's and the engine's spans")

    root = one(spans, "POST /v1/chat/completions")
    assert root.parent_span_id == "" and root.instance.startswith("gateway:")
    assert root.attributes["http.response.status_code"] == 200
    assert root.attributes["raylane.pool"] == MODEL and root.attributes["gen_ai.usage.output_tokens"] == 24
    steps = {s.name for s in children(spans, root)}
    assert {"gateway.authenticate", "gateway.read_body", "gateway.route", "gateway.admission"} <= steps
    assert one(spans, "gateway.authenticate").attributes["raylane.api_key.id"].startswith("key-")
    assert one(spans, "gateway.route").attributes["raylane.route"] == "chat"

    # gateway -> pool replica -> engine core: three processes, each span the child of the last.
    calls = [s for s in by_name(spans, f"chat {MODEL}") if s.instance.startswith("gateway:")]
    [call] = calls
    assert call.parent_span_id == root.span_id and call.attributes["gen_ai.operation.name"] == "chat"
    [served] = [s for s in children(spans, call) if s.instance.startswith(f"pool:{MODEL}:")]
    assert served.name == f"chat {MODEL}" and served.attributes["gen_ai.usage.output_tokens"] == 24
    assert served.attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert "pool.render" in {s.name for s in children(spans, served)}
    engine = one(spans, "engine.request")
    assert engine.parent_span_id == served.span_id
    assert engine.instance == f"{served.instance}/engine-core"
    assert engine.resource["process.pid"] != served.resource["process.pid"] != root.resource["process.pid"]
    assert engine.attributes["gen_ai.usage.output_tokens"] == 24
    phases = {s.name for s in children(spans, engine)}
    assert {"engine.queue", "engine.prefill", "engine.decode"} <= phases
    assert "first_token" in [name for name, _ in engine.events]
    assert one(spans, "gateway.stream").parent_span_id == root.span_id
    assert_nothing_secret(spans)


def test_a_stream_resumed_on_another_replica_shows_both_replicas(app, receiver):
    """The client sends its own `traceparent`: the gateway's root continues it."""
    import ray

    client_trace, client_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    headers = {"authorization": f"Bearer {KEY}", "traceparent": f"00-{client_trace}-{client_span}-01"}
    body = chat_body("HOLD this one")
    url = f"{app}/v1/chat/completions"
    with requests.post(url, json=body, headers=headers, timeout=120, stream=True) as r:
        assert r.status_code == 200 and r.headers["x-raylane-trace-id"] == client_trace
        lines = (line for line in r.iter_lines(decode_unicode=True) if line)
        first = [next(lines) for _ in range(2)]  # the held replica sent these, then holds the stream
        spans = receiver.wait_for(
            client_trace, lambda spans: by_name(spans, "pool.render"), what="the first replica's render"
        )
        render = one(spans, "pool.render")
        held = render.instance.rsplit(":", 1)[1]  # the replica's Serve id
        [victim] = [
            a["name"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"SERVE_REPLICA::{APP}#") and a["name"].endswith(f"#{held}")
        ]
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        events = events_of(first + list(lines))
    assert events[-1] == "[DONE]" and not any('"error"' in e for e in events)

    def survivor_done(spans: list[ReceivedSpan]) -> bool:
        """The survivor's engine span and its pool replica's span are in: each process exports its
        own spans when they end (the pool's after the stream, the engine core's maybe before)."""
        engines = [s for s in by_name(spans, "engine.request") if not s.instance.startswith(render.instance)]
        pools = [
            s
            for s in by_name(spans, f"chat {MODEL}")
            if s.instance.startswith(f"pool:{MODEL}:") and s.instance != render.instance
        ]
        return is_engine_done(spans) and bool(engines) and bool(pools)

    spans = receiver.wait_for(client_trace, survivor_done, what="the resumed stream's spans")

    root = one(spans, "POST /v1/chat/completions")
    assert root.parent_span_id == client_span and root.attributes["raylane.resumptions"] == 1
    calls = sorted(
        (s for s in by_name(spans, f"chat {MODEL}") if s.instance.startswith("gateway:")),
        key=lambda s: s.start_ns,
    )
    assert len(calls) == 2
    died, resumed = calls
    assert died.parent_span_id == root.span_id and died.attributes["raylane.failure"] == "died"
    resume = one(spans, "gateway.resume")
    assert resume.parent_span_id == one(spans, "gateway.stream").span_id
    assert resumed.parent_span_id == resume.span_id and resumed.attributes["raylane.resumed_tokens"] > 0
    [served] = [s for s in children(spans, resumed) if s.instance.startswith(f"pool:{MODEL}:")]
    assert served.attributes["raylane.resumed_tokens"] > 0
    [engine] = [s for s in by_name(spans, "engine.request") if s.instance == f"{served.instance}/engine-core"]
    assert engine.parent_span_id == served.span_id
    # Both replicas: the killed one's render (its own request span died with it; its engine core's
    # spans come if it finished its part before the kill), and the survivor's whole chain.
    replicas = {s.instance.removesuffix("/engine-core") for s in spans if s.instance.startswith("pool:")}
    assert replicas == {render.instance, served.instance} and render.instance != served.instance
    assert_nothing_secret(spans)


def test_a_batch_is_the_parent_of_its_lines_requests(app, receiver):
    """The batch actor's `batch` span, each line's request in the gateway under it, and that line's
    pool call down to the engine core: one trace per batch, across three kinds of process."""
    import time

    headers = {"authorization": f"Bearer {KEY}"}
    lines = [
        {"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions", "body": chat_body(f"{i}")}
        for i in range(2)
    ]
    for line in lines:
        line["body"] = {**line["body"], "stream": False, "max_tokens": 4}
    content = "".join(json.dumps(line) + "\n" for line in lines)
    upload = requests.post(
        f"{app}/v1/files", headers=headers, files={"file": ("in.jsonl", content)}, data={"purpose": "batch"}
    )
    assert upload.status_code == 200, upload.text
    body = {
        "input_file_id": upload.json()["id"],
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
    }
    batch = requests.post(f"{app}/v1/batches", headers=headers, json=body).json()
    deadline = time.monotonic() + 120
    while batch["status"] not in ("completed", "failed", "cancelled", "expired"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.5)
        batch = requests.get(f"{app}/v1/batches/{batch['id']}", headers=headers).json()
    assert batch["status"] == "completed" and batch["request_counts"]["completed"] == 2, batch

    deadline = time.monotonic() + 60
    while not (
        ours := [
            s for s in by_name(receiver.spans, "batch") if s.attributes["raylane.batch_id"] == batch["id"]
        ]
    ):
        assert time.monotonic() < deadline, "the batch's span was not received"
        time.sleep(0.2)
    [root] = ours
    assert root.parent_span_id == "" and root.instance.startswith("batch:")
    assert root.attributes["raylane.api_key.id"].startswith("key-")

    def lines_done(spans: list[ReceivedSpan]) -> bool:
        return (
            len(by_name(spans, "engine.request")) == 2
            and len(by_name(spans, "batch line /v1/chat/completions")) == 2
        )

    spans = receiver.wait_for(root.trace_id, lines_done, what="the batch lines' spans")
    for line in by_name(spans, "batch line /v1/chat/completions"):
        assert line.parent_span_id == root.span_id and line.instance.startswith("gateway:")
        assert line.attributes["http.response.status_code"] == 200
        [call] = [s for s in children(spans, line) if s.name == f"chat {MODEL}"]
        [served] = [s for s in children(spans, call) if s.instance.startswith(f"pool:{MODEL}:")]
        [engine] = [s for s in children(spans, served) if s.name == "engine.request"]
        assert engine.attributes["gen_ai.usage.output_tokens"] == 4
    assert_nothing_secret(spans)
