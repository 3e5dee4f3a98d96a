"""Prometheus metrics of the cluster: what each replica records, and the one aggregate `/metrics` serves.

Names and meanings follow vLLM's with a `raylane_` prefix (../shared/DESIGN.md, Conventions).

**Recording.** Every pool replica wraps its `AsyncLLM` in `MeteredLLM`, which watches the output
stream the replica already iterates: TTFT and e2e latency from the engine's `RequestOutput.metrics`,
inter-token latency between streamed outputs (a non-streamed request adds its mean gap once per
token), prompt and generation tokens, and one `raylane_request_success_total` per finished choice
(vLLM V1 counts each of `n` samples as a request). Engine state is read between steps when the
replica reports: running/waiting requests, KV use, and the engine's own prefix-cache and preemption
counters. Gateway replicas count HTTP requests and the router's decisions, fallbacks and sheds
(`GatewayMetrics.observe`, from each finished request's `RequestRecord`).

**Aggregation.** Replicas report to one `MetricsAggregator` actor per app (named, detached, created
by whichever replica reports first) once a second (`RAYLANE_METRICS_INTERVAL_S`). Counters and
histograms travel as *increments* since the last acknowledged report, tagged with a sequence number
that the aggregator applies at most once; the aggregator adds them to totals it owns. So a replica
that restarts, scales down or dies takes nothing from the totals (it loses at most its last second
of increments), and the series carry no replica label: `rate()` never sees a drop. Only if the
aggregator itself is lost (its node dies; Ray restarts it) do totals start again from zero, which
Prometheus reads as an ordinary counter reset. Gauges are per replica (`replica` label) and vanish
`STALE_AFTER_S` after a replica stops reporting; the dashboard sums running/waiting and averages
KV use by pool.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Iterable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric

logger = logging.getLogger(__name__)

PREFIX = "raylane_"
REPORT_INTERVAL_S = float(os.environ.get("RAYLANE_METRICS_INTERVAL_S", "1.0"))
STALE_AFTER_S = 30.0  # a replica silent this long is gone: its gauges are dropped
AGGREGATOR_NAMESPACE = "raylane"
HISTORY_INTERVAL_S = 5.0  # totals kept every 5 s for `rates()` (raylane status)
HISTORY_LEN = 25

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
ROUTER_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]
HTTP_BUCKETS = [0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0]

# Gauges: (name, help, key in `engine_stats()`).
POOL_GAUGES = [
    ("raylane_num_requests_running", "Requests in the engine's running batch.", "num_requests_running"),
    ("raylane_num_requests_waiting", "Requests waiting to be scheduled.", "num_requests_waiting"),
    ("raylane_kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", "kv_cache_usage"),
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

Key = tuple[str, str, tuple[tuple[str, str], ...]]  # (family, sample name, sorted labels)


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
    }


def _key(family: str, sample: str, labels: dict[str, str]) -> Key:
    return family, sample, tuple(sorted(labels.items()))


class MetricSet:
    """A replica's own registry; `families()` and `counter_values()` feed `MetricsReporter`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)

    def families(self) -> dict[str, tuple[str, str]]:
        out = {m.name: (m.type, m.documentation) for m in self.registry.collect()}
        return out | self.extra_families()

    def extra_families(self) -> dict[str, tuple[str, str]]:
        return {}

    def counter_values(self) -> dict[Key, float]:
        """Cumulative values of every counter and histogram sample (no `_created`)."""
        values = {}
        for metric in self.registry.collect():
            for s in metric.samples:
                if not s.name.endswith("_created"):
                    values[_key(metric.name, s.name, s.labels)] = s.value
        return values


class PoolMetrics(MetricSet):
    def __init__(self, pool: str, model: str) -> None:
        super().__init__()
        self.labels = {"pool": pool, "model": model}
        names, r = ["pool", "model"], self.registry
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
        self.summaries: dict[str, RequestSummary] = {}  # engine request id -> finished summary

    def extra_families(self) -> dict[str, tuple[str, str]]:
        return {name: ("counter", doc) for name, doc, _ in ENGINE_COUNTERS}

    def set_engine_stats(self, stats: dict) -> None:
        self._engine = stats

    def counter_values(self) -> dict[Key, float]:
        values = super().counter_values()
        for name, _, stat in ENGINE_COUNTERS:
            if stat in self._engine:
                values[_key(name, f"{name}_total", self.labels)] = float(self._engine[stat])
        return values

    def gauge_values(self, replica: str) -> dict[Key, float]:
        labels = self.labels | {"replica": replica}
        return {
            _key(name, name, labels): float(self._engine[stat])
            for name, _, stat in POOL_GAUGES
            if stat in self._engine
        }

    def gauge_families(self) -> dict[str, tuple[str, str]]:
        return {name: ("gauge", doc) for name, doc, _ in POOL_GAUGES}

    def pop_summary(self, request_id: str) -> RequestSummary | None:
        """The merged summary of engine requests `request_id` and `request_id-k` (completions)."""
        keys = [k for k in self.summaries if k == request_id or k.startswith(request_id + "-")]
        parts = [self.summaries.pop(k) for k in keys]
        return RequestSummary.merge(parts) if parts else None


@dataclass(slots=True)
class RequestSummary:
    """What a pool tells the gateway after a request's last output (for the request log)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float | None = None
    finish_reasons: list[str] = field(default_factory=list)

    @property
    def finish_reason(self) -> str | None:
        return ",".join(dict.fromkeys(self.finish_reasons)) or None

    @staticmethod
    def merge(parts: list[RequestSummary]) -> RequestSummary:
        ttfts = [p.ttft_s for p in parts if p.ttft_s is not None]
        return RequestSummary(
            prompt_tokens=sum(p.prompt_tokens for p in parts),
            completion_tokens=sum(p.completion_tokens for p in parts),
            cached_tokens=sum(p.cached_tokens for p in parts),
            ttft_s=min(ttfts) if ttfts else None,
            finish_reasons=[r for p in parts for r in p.finish_reasons],
        )


@dataclass(slots=True)
class FinalItem:
    """A response's last item (a whole JSON body, or the SSE events ending in `[DONE]`) with its
    request's summary. The gateway ends the HTTP response on it: waiting for a separate summary and
    for the end of the pool's stream would add two messages to every request's latency."""

    item: str
    summary: RequestSummary | None = None


class RequestTracker:
    """Watches one engine request's outputs and records it in `PoolMetrics`."""

    def __init__(self, metrics: PoolMetrics, request_id: str, delta: bool, clock=time.monotonic) -> None:
        self.metrics, self.request_id, self.delta, self.clock = metrics, request_id, delta, clock
        self.tokens: dict[int, int] = {}  # choice -> tokens so far
        self.reasons: dict[int, str] = {}
        self.prompt_tokens: int | None = None
        self.cached_tokens = 0
        self.ttft: float | None = None
        self.last_token_at: float | None = None
        self.done = False

    def observe(self, out) -> None:
        m, labels = self.metrics, self.metrics.labels
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
                m.itl.labels(**labels).observe(now - self.last_token_at)
            self.last_token_at = now
        if out.finished:
            self._finish(out.metrics.get("e2e_latency"))

    def observe_abort(self, out) -> None:
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
        m, labels = self.metrics, self.metrics.labels
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
        m.summaries[self.request_id] = RequestSummary(
            prompt_tokens=self.prompt_tokens or 0,
            completion_tokens=sum(self.tokens.values()),
            cached_tokens=self.cached_tokens,
            ttft_s=self.ttft,
            finish_reasons=reasons,
        )


class MeteredLLM:
    """An `AsyncLLM` whose `generate` streams are recorded in `PoolMetrics`; everything else passes."""

    def __init__(self, llm, metrics: PoolMetrics) -> None:
        self._llm, self._metrics = llm, metrics

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm, name)

    async def generate(self, prompt, sampling_params=None, request_id=None, **kwargs) -> AsyncIterator:
        from engine import EngineDeadError, RequestOutputKind

        request_id = request_id or uuid.uuid4().hex
        delta = sampling_params is not None and sampling_params.output_kind == RequestOutputKind.DELTA
        tracker = RequestTracker(self._metrics, request_id, delta)
        reason = "abort"
        try:
            outputs = self._llm.generate(
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


class GatewayMetrics(MetricSet):
    def __init__(self) -> None:
        super().__init__()
        r = self.registry
        self.requests = Counter(
            "raylane_http_requests", "HTTP requests by endpoint and status code.",
            ["endpoint", "status_code"], registry=r,
        )  # fmt: skip
        self.duration = Histogram(
            "raylane_http_request_duration_seconds", "Gateway time per request, to the last byte.",
            ["endpoint"], buckets=HTTP_BUCKETS, registry=r,
        )  # fmt: skip
        self.route_decisions = Counter(
            "raylane_route_decisions", "Requests per route the router resolved.", ["route"], registry=r
        )
        self.fallbacks = Counter(
            "raylane_fallbacks", "Requests that left a pool for the next in their fallback chain.",
            ["from_pool", "to_pool", "reason"], registry=r,
        )  # fmt: skip
        self.shed = Counter(
            "raylane_shed", "Requests turned away (429) by load shedding.", ["tier"], registry=r
        )
        self.router_latency = Histogram(
            "raylane_router_latency_seconds", "Time the router took to resolve and admit a request.",
            buckets=ROUTER_BUCKETS, registry=r,
        )  # fmt: skip

    def observe(self, record) -> None:
        """Count one finished request (a `deployments.request_log.RequestRecord`)."""
        self.requests.labels(endpoint=record.endpoint, status_code=str(record.status)).inc()
        if record.latency_s is not None:
            self.duration.labels(endpoint=record.endpoint).observe(record.latency_s)
        if record.route:
            self.route_decisions.labels(route=record.route).inc()
        for from_pool, to_pool, reason in record.fallbacks():
            self.fallbacks.labels(from_pool=from_pool, to_pool=to_pool, reason=reason).inc()
        if record.shed:
            self.shed.labels(tier=record.tier or "unknown").inc()
        if record.router_latency_s is not None:
            self.router_latency.observe(record.router_latency_s)


# -- reporting to the aggregator -----------------------------------------------------------------


def aggregator_name(app_name: str | None = None) -> str:
    return f"raylane-metrics:{app_name or 'raylane'}"


def get_aggregator(app_name: str | None = None, create: bool = True):
    """The app's `MetricsAggregator` actor (created on first use: detached, so that no replica's
    restart takes the totals with it; `max_restarts` brings it back after a node loss)."""
    import ray

    name = aggregator_name(app_name)
    if not create:
        return ray.get_actor(name, namespace=AGGREGATOR_NAMESPACE)
    return (
        ray.remote(MetricsAggregator)
        .options(
            name=name,
            namespace=AGGREGATOR_NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
            max_restarts=-1,
            max_concurrency=1,
        )
        .remote()
    )


def replica_identity() -> tuple[str, str | None]:
    """(replica id, app name) inside a Serve replica; a fresh id elsewhere."""
    try:
        from ray import serve

        ctx = serve.get_replica_context()
        return ctx.replica_id.unique_id, ctx.app_name
    except Exception:
        return uuid.uuid4().hex[:8], None


class MetricsReporter:
    """Sends a `MetricSet`'s increments (at most once each) and gauges to the aggregator."""

    def __init__(self, metrics: MetricSet, gauges=None, interval_s: float = REPORT_INTERVAL_S) -> None:
        self.metrics = metrics
        self.gauges = gauges  # async () -> (families, gauge values), or None
        self.interval_s = interval_s
        self.replica, self.app_name = replica_identity()
        self.sent: dict[Key, float] = {}  # cumulative values covered by reports sent
        self.pending: tuple[int, dict[Key, float]] | None = None
        self.seq = 0
        self.handle = None
        self.task: asyncio.Task | None = None
        self.lock: asyncio.Lock | None = None

    def start(self) -> None:
        """Start the reporting loop on the running event loop (idempotent)."""
        if self.task is None:
            self.lock = asyncio.Lock()
            self.task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        # On a timer, not after each request: a report then would take its CPU (and, for a pool, an
        # engine stats call) from the next request, which at concurrency 1 is starting just then.
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.report()
            except Exception as e:  # the aggregator restarting: keep the increments, try again
                logger.debug("metrics report failed: %r", e)
                self.handle = None

    async def report(self) -> None:
        if self.lock is None:
            self.lock = asyncio.Lock()
        async with self.lock:
            families, gauges = self.metrics.families(), {}
            if self.gauges is not None:
                gauge_families, gauges = await self.gauges()
                families |= gauge_families
            if self.pending is None:  # a new batch of increments, only once the last one is acknowledged
                current = self.metrics.counter_values()
                deltas = {k: v - self.sent.get(k, 0.0) for k, v in current.items() if v != self.sent.get(k)}
                self.seq += 1
                self.pending, self.sent = (self.seq, deltas), current
            seq, deltas = self.pending
            if self.handle is None:
                self.handle = get_aggregator(self.app_name)
            await self.handle.report.remote(self.replica, seq, families, deltas, gauges)
            self.pending = None


# -- the aggregator ------------------------------------------------------------------------------


class MetricsAggregator:
    """Totals of every replica's counters and histograms, and each live replica's gauges.

    A plain class (tested without Ray); `get_aggregator` runs it as a named actor.
    """

    def __init__(self, clock=time.time, stale_after_s: float = STALE_AFTER_S) -> None:
        self.clock, self.stale_after_s = clock, stale_after_s
        self.started = clock()
        self.families: dict[str, tuple[str, str]] = {}
        self.totals: dict[Key, float] = {}
        self.applied: dict[str, int] = {}  # replica -> last sequence number added
        self.gauges: dict[str, tuple[float, dict[Key, float]]] = {}  # replica -> (when, values)
        self.history: deque[tuple[float, dict[Key, float]]] = deque(maxlen=HISTORY_LEN)

    def report(self, replica: str, seq: int, families: dict, deltas: dict, gauges: dict) -> bool:
        self.families.update(families)
        if seq > self.applied.get(replica, 0):
            for k, v in deltas.items():
                self.totals[k] = self.totals.get(k, 0.0) + v
            self.applied[replica] = seq
        now = self.clock()
        self.gauges[replica] = (now, gauges)
        if not self.history or now - self.history[-1][0] >= HISTORY_INTERVAL_S:
            self.history.append((now, dict(self.totals)))
        return True

    def live_gauges(self) -> dict[Key, float]:
        now = self.clock()
        for replica in [r for r, (seen, _) in self.gauges.items() if now - seen > self.stale_after_s]:
            del self.gauges[replica]
        out: dict[Key, float] = {}
        for _, values in self.gauges.values():
            out.update(values)
        return out

    def snapshot(self) -> dict:
        """Plain data for `raylane status`: totals, live gauges, and totals about a minute ago."""
        past = next((h for h in self.history if self.clock() - h[0] <= 75), None)
        return {
            "now": self.clock(),
            "totals": dict(self.totals),
            "gauges": self.live_gauges(),
            "past": past,
        }

    def render(self) -> bytes:
        """Prometheus text format of everything."""
        return render(self.families, {**self.totals, **self.live_gauges()})


def render(families: dict[str, tuple[str, str]], values: dict[Key, float]) -> bytes:
    metrics: dict[str, Metric] = {}
    for (family, sample, labels), value in sorted(values.items(), key=_sample_order):
        if family not in metrics:
            typ, doc = families.get(family, ("untyped", ""))
            metrics[family] = Metric(family, doc, typ)
        metrics[family].add_sample(sample, dict(labels), value)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(list(metrics.values())))
    return generate_latest(registry)


def _sample_order(item) -> tuple:
    (family, sample, labels), _ = item
    rest = tuple(kv for kv in labels if kv[0] != "le")
    le = dict(labels).get("le")
    suffix = 0 if sample.endswith("_bucket") else 1 if sample.endswith("_count") else 2
    return family, rest, suffix, float(le) if le is not None else 0.0, sample


class _Fixed:
    def __init__(self, metrics: Iterable[Metric]) -> None:
        self.metrics = list(metrics)

    def collect(self) -> Iterable[Metric]:
        return self.metrics


# -- the gateway replica's side ------------------------------------------------------------------

_gateway: tuple[GatewayMetrics, MetricsReporter] | None = None


def gateway_metrics() -> GatewayMetrics:
    """This process's `GatewayMetrics`; its reporter starts with the first request (needs Ray)."""
    global _gateway
    if _gateway is None:
        metrics = GatewayMetrics()
        _gateway = metrics, MetricsReporter(metrics)
    metrics, reporter = _gateway
    if reporter.task is None and _ray_ready():
        reporter.start()
    return metrics


async def render_cluster_metrics() -> bytes:
    """`/metrics`: report this gateway replica's latest counts, then render the app's aggregate."""
    gateway_metrics()
    _, reporter = _gateway
    try:
        await reporter.report()
    except Exception as e:
        logger.warning("metrics report before a scrape failed: %r", e)
        reporter.handle = None
    return await get_aggregator(reporter.app_name).render.remote()


def _ray_ready() -> bool:
    try:
        import ray

        asyncio.get_running_loop()
        return ray.is_initialized()
    except (ImportError, RuntimeError):
        return False
