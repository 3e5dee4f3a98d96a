"""Tracing (raylane/tracing.py, engine/request_trace.py): off by default and then free; on, the engine's
spans of a request continue the carrier it was given, with its queue wait, prefill chunks, first
token, decode and preemptions."""

import pytest
import torch
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from raylane import tracing
from raylane.config import ClusterConfig, EngineConfig, TracingConfig
from raylane.engine import SamplingParams
from raylane.engine.llm_engine import LLMEngine

OTEL_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_SDK_DISABLED")


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture
def exported():
    """Tracing on in this process, into memory; off again afterwards."""
    memory = InMemorySpanExporter()
    assert tracing.configure({"export_delay_ms": 1}, "test", exporter=memory)

    def spans():
        tracing.flush()
        return list(memory.get_finished_spans())

    yield spans
    tracing.shutdown()


@pytest.fixture(scope="module")
def llama(checkpoint) -> str:
    return checkpoint("llama")


def test_tracing_is_off_by_default_and_makes_nothing(monkeypatch, llama):
    for name in OTEL_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    config = ClusterConfig.from_dict({"pools": [{"name": "chat", "model": "demo-llama-tiny"}]})
    assert config.observability.tracing == TracingConfig()
    assert not tracing.configure(config.observability.tracing.model_dump(), "test")
    assert tracing.start("x") is None and tracing.carrier() is None
    with tracing.span("gateway.authenticate") as span:
        assert span is None
    engine = LLMEngine(EngineConfig(model=llama, num_kv_blocks=32))
    engine.add_request(
        prompt(8, 1),
        greedy(3),
        request_id="r",
        trace={"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"},
    )
    [request] = engine.scheduler.waiting
    assert request.trace is None  # nothing recorded per step for it
    while engine.has_unfinished_requests():
        engine.step()


def test_the_otel_endpoint_variable_turns_tracing_on(monkeypatch):
    for name in OTEL_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9/")
    try:
        assert tracing.configure(TracingConfig().model_dump(), "test")
        assert tracing.settings()["endpoint"] == "http://127.0.0.1:9/v1/traces"
        monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
        tracing.shutdown()
        assert not tracing.configure(TracingConfig().model_dump(), "test")
    finally:
        tracing.shutdown()


def test_engine_spans_continue_the_carrier_with_queue_prefill_chunks_and_decode(exported, llama):
    """A 40-token prompt in 16-token chunks: three prefill spans, then the decode, all children of
    one `engine.request` that is the child of the caller's span."""
    parent = tracing.start("pool")
    engine = LLMEngine(EngineConfig(model=llama, num_kv_blocks=32, max_num_batched_tokens=16))
    engine.add_request(prompt(40, 2), greedy(5), request_id="r", trace=tracing.carrier(parent))
    while engine.has_unfinished_requests():
        engine.step()
    tracing.end(parent)
    spans = {s.name: s for s in exported()}
    chunks = [s for s in exported() if s.name == "engine.prefill"]
    request = spans["engine.request"]
    assert request.parent.span_id == parent.get_span_context().span_id
    assert request.context.trace_id == parent.get_span_context().trace_id
    assert {s.parent.span_id for s in [*chunks, spans["engine.queue"], spans["engine.decode"]]} == {
        request.context.span_id
    }
    assert sorted(s.attributes["raylane.tokens"] for s in chunks) == [8, 16, 16]
    assert request.attributes["gen_ai.usage.input_tokens"] == 40
    assert request.attributes["gen_ai.usage.output_tokens"] == 5
    assert request.attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert [e.name for e in request.events] == ["first_token"]
    assert request.start_time <= spans["engine.queue"].end_time <= chunks[0].start_time + 1
    assert spans["engine.decode"].attributes["gen_ai.usage.output_tokens"] == 5


def test_a_preempted_request_has_an_event_per_preemption_and_a_recompute_chunk(exported, llama):
    engine = LLMEngine(EngineConfig(model=llama, num_kv_blocks=64, max_num_seqs=1))
    parent = tracing.start("pool")
    engine.add_request(
        prompt(8, 50), greedy(20), request_id="batch", priority=3, trace=tracing.carrier(parent)
    )
    for _ in range(3):
        engine.step()
    engine.add_request(prompt(8, 51), greedy(4), request_id="urgent", priority=0)  # untraced
    while engine.has_unfinished_requests():
        engine.step()
    tracing.end(parent)
    [request] = [s for s in exported() if s.name == "engine.request"]
    assert [e.name for e in request.events].count("preempted") == 1
    assert request.attributes["raylane.preemptions"] == 1
    # The prompt, then the prompt and the tokens made before the preemption, computed again.
    chunks = sorted((s for s in exported() if s.name == "engine.prefill"), key=lambda s: s.start_time)
    assert [s.attributes["raylane.tokens"] for s in chunks] == [8, 8 + 3]
    assert engine._num_traced == 0
