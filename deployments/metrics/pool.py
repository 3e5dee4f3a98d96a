"""A pool replica's metrics: vLLM's per-request figures from the output stream, engine state as gauges.

`MeteredLLM` wraps the replica's `AsyncLLM`; each `generate` stream is a `MeteredStream` whose
`RequestTracker` records the request's outputs as they pass and, once the request has ended, holds
its `RequestSummary`, which the serving code sends to the gateway with the response's last item.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from prometheus_client import Counter, Histogram

from raylane.deployments.metrics.metric_set import Key, MetricSet, sample_key
from raylane.deployments.protocol.wire import RequestSummary
from raylane.engine import EngineDeadError, RequestOutput, RequestOutputKind

# vLLM's buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
]  # fmt: skip
ITL_BUCKETS = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
]  # fmt: skip
E2E_BUCKETS = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
]  # fmt: skip

# Gauges: (name, help, key in `engine_stats()`).
POOL_GAUGES = [
    ("raylane_num_requests_running", "Requests in the engine's running batch.", "num_requests_running"),
    ("raylane_num_requests_waiting", "Requests waiting to be scheduled.", "num_requests_waiting"),
    ("raylane_kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", "kv_cache_usage"),
    (
        "raylane_prefix_cache_hit_rate",
        "Share of this replica's prompt tokens found in its prefix cache since it started (0-1).",
        "prefix_cache_hit_rate",
    ),
]
# Engine-owned cumulative counters: (name without _total, help, key in `engine_stats()`).
ENGINE_COUNTERS = [
    ("raylane_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "prefix_cache_queries"),
    ("raylane_prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
    (
        "raylane_num_preemptions",
        "Requests preempted (recomputed later) for lack of KV blocks.",
        "num_preemptions",
    ),
]


def engine_stats(engine) -> dict:
    """Load and cache counters of an `LLMEngine`; run it on the engine thread (`run_in_engine`)."""
    blocks, scheduler = engine.block_manager, engine.scheduler
    return {
        "num_requests_running": len(scheduler.running),
        "num_requests_waiting": len(scheduler.waiting),
        "kv_cache_usage": blocks.usage,
        "num_kv_blocks": blocks.num_blocks,
        "num_free_kv_blocks": blocks.num_free_blocks,
        "num_preemptions": scheduler.num_preemptions,
        "prefix_cache_queries": getattr(blocks, "prefix_cache_queries", 0),
        "prefix_cache_hits": getattr(blocks, "prefix_cache_hits", 0),
        "prefix_cache_hit_rate": getattr(blocks, "prefix_cache_hits", 0)
        / max(1, getattr(blocks, "prefix_cache_queries", 0)),
        "lora_ids": scheduler.lora_slots.resident() if scheduler.lora_slots is not None else [],
    }


class PoolMetrics(MetricSet):
    def __init__(self, pool: str, model: str) -> None:
        super().__init__()
        self.labels = {"pool": pool, "model": model}
        # `adapter`: the LoRA adapter's served name, "" for the base model (adapters are the
        # operator's, so the label's values are few)
        names, r = ["pool", "model", "adapter"], self.registry
        self.ttft = Histogram(
            "raylane_time_to_first_token_seconds",
            "Time from arrival in the engine to the first generated token.",
            names, buckets=TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self.itl = Histogram(
            "raylane_inter_token_latency_seconds",
            "Time between consecutive token outputs of a request.",
            names, buckets=ITL_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            "raylane_e2e_request_latency_seconds",
            "Time from arrival in the engine to the last token.",
            names, buckets=E2E_BUCKETS, registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter("raylane_prompt_tokens", "Prefill tokens processed.", names, registry=r)
        self.generation_tokens = Counter("raylane_generation_tokens", "Generated tokens.", names, registry=r)
        self.success = Counter(
            "raylane_request_success",
            "Finished requests (one per choice), by finish reason: stop, length, abort, error.",
            [*names, "finished_reason"],
            registry=r,
        )
        self._engine: dict[str, float] = {}

    def extra_families(self) -> dict[str, tuple[str, str]]:
        return {name: ("counter", doc) for name, doc, _ in ENGINE_COUNTERS}

    def set_engine_stats(self, stats: dict) -> None:
        self._engine = stats

    def counter_values(self) -> dict[Key, float]:
        values = super().counter_values()
        for name, _, stat in ENGINE_COUNTERS:
            if stat in self._engine:
                values[sample_key(name, f"{name}_total", self.labels)] = float(self._engine[stat])
        return values

    def gauge_values(self, replica: str) -> dict[Key, float]:
        labels = self.labels | {"replica": replica}
        return {
            sample_key(name, name, labels): float(self._engine[stat])
            for name, _, stat in POOL_GAUGES
            if stat in self._engine
        }

    def gauge_families(self) -> dict[str, tuple[str, str]]:
        return {name: ("gauge", doc) for name, doc, _ in POOL_GAUGES}


class RequestTracker:
    """Watches one engine request's outputs, records it in `PoolMetrics` and, once it has ended,
    holds its `summary`."""

    def __init__(self, metrics: PoolMetrics, delta: bool, adapter: str = "", clock=time.monotonic) -> None:
        self.metrics, self.delta, self.clock = metrics, delta, clock
        self.labels = metrics.labels | {"adapter": adapter}
        self.tokens: dict[int, int] = {}  # choice -> tokens so far
        self.reasons: dict[int, str] = {}
        self.prompt_tokens: int | None = None
        self.cached_tokens = 0
        self.ttft: float | None = None
        self.last_token_at: float | None = None
        self.done = False
        self.summary: RequestSummary | None = None  # set when the request ends (if it was prefilled)

    def observe(self, out: RequestOutput) -> None:
        m, labels = self.metrics, self.labels
        now = self.clock()
        if self.prompt_tokens is None:  # the prompt has been prefilled
            self.prompt_tokens = len(out.prompt_token_ids)
            self.cached_tokens = out.num_cached_tokens
            m.prompt_tokens.labels(**labels).inc(self.prompt_tokens)
        if self.ttft is None and out.metrics.get("time_to_first_token") is not None:
            self.ttft = out.metrics["time_to_first_token"]
            m.ttft.labels(**labels).observe(self.ttft)
        new = 0
        for comp in out.outputs:
            before = self.tokens.get(comp.index, 0)
            count = before + len(comp.token_ids) if self.delta else len(comp.token_ids)
            new += count - before
            self.tokens[comp.index] = count
            if comp.finish_reason is not None:
                self.reasons[comp.index] = comp.finish_reason
        if new > 0:
            m.generation_tokens.labels(**labels).inc(new)
            if self.delta and self.last_token_at is not None:
                # An output may carry several tokens (merged for a slow reader, or batched by the
                # engine's stream_batching_interval_ms): its gap is spread over them, once per token.
                itl = m.itl.labels(**labels)
                for _ in range(new):
                    itl.observe((now - self.last_token_at) / new)
            self.last_token_at = now
        if out.finished:
            self._finish(out.metrics.get("e2e_latency"))

    def observe_abort(self, out: RequestOutput) -> None:
        """The engine's last output of a request its caller left. A request that had no output yet
        (a whole response, or one still in its prefill) is counted from here; its prompt only if it
        had begun generating (so its prefill was done)."""
        if self.done:
            return
        if self.prompt_tokens is None and not any(comp.token_ids for comp in out.outputs):
            self.prompt_tokens = 0  # nothing prefilled that we know of
        self.observe(dataclasses.replace(out, finished=False))  # an abort has no end-to-end latency
        self.close("abort")

    def close(self, reason: str = "abort") -> None:
        """The stream ended without a finished output (client gone, engine failure)."""
        if not self.done and self.prompt_tokens is not None:
            self._finish(None, default_reason=reason)

    def _finish(self, e2e: float | None, default_reason: str = "abort") -> None:
        self.done = True
        m, labels = self.metrics, self.labels
        if e2e is not None:
            m.e2e.labels(**labels).observe(e2e)
        if not self.delta and e2e is not None and self.ttft is not None:
            # Outputs came all at once: record each request's mean gap, once per token after the first.
            for count in self.tokens.values():
                for _ in range(count - 1):
                    m.itl.labels(**labels).observe((e2e - self.ttft) / (count - 1))
        reasons = [self.reasons.get(i, default_reason) for i in sorted(self.tokens)] or [default_reason]
        for reason in reasons:
            m.success.labels(**labels, finished_reason=reason).inc()
        self.summary = RequestSummary(
            prompt_tokens=self.prompt_tokens or 0,
            completion_tokens=sum(self.tokens.values()),
            cached_tokens=self.cached_tokens,
            ttft_s=self.ttft,
            finish_reasons=reasons,
        )


class MeteredStream:
    """One engine request's outputs, recorded as they pass; `summary` once the request has ended
    (the engine's failure included: the tracker closes before the caller sees the error)."""

    def __init__(self, llm, prompt, sampling_params, request_id: str, tracker: RequestTracker, **kwargs):
        self.tracker = tracker
        self._outputs = self._observe(llm, prompt, sampling_params, request_id, **kwargs)

    @property
    def summary(self) -> RequestSummary | None:
        return self.tracker.summary

    def __aiter__(self) -> MeteredStream:
        return self

    async def __anext__(self) -> RequestOutput:
        return await self._outputs.__anext__()

    async def aclose(self) -> None:
        await self._outputs.aclose()

    async def _observe(self, llm, prompt, sampling_params, request_id, **kwargs) -> AsyncIterator:
        tracker, reason = self.tracker, "abort"
        try:
            outputs = llm.generate(
                prompt, sampling_params, request_id, on_abort=tracker.observe_abort, **kwargs
            )
            async with aclosing(outputs) as gen:
                async for out in gen:
                    tracker.observe(out)
                    yield out
        except EngineDeadError:
            reason = "error"
            raise
        finally:
            tracker.close(reason)


class MeteredLLM:
    """An `AsyncLLM` whose `generate` streams are recorded in `PoolMetrics`; everything else passes."""

    def __init__(self, llm, metrics: PoolMetrics) -> None:
        self._llm, self._metrics = llm, metrics

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm, name)

    def generate(self, prompt, sampling_params=None, request_id=None, **kwargs) -> MeteredStream:
        delta = sampling_params is not None and sampling_params.output_kind == RequestOutputKind.DELTA
        lora = kwargs.get("lora_request")
        tracker = RequestTracker(self._metrics, delta, "" if lora is None else lora.lora_name)
        request_id = request_id or uuid.uuid4().hex
        return MeteredStream(self._llm, prompt, sampling_params, request_id, tracker, **kwargs)
