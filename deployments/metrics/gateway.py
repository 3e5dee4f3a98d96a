"""A gateway replica's metrics: HTTP requests and the router's decisions, fallbacks and sheds."""

from __future__ import annotations

import asyncio
import logging

from prometheus_client import Counter, Histogram

from raylane.deployments.metrics.aggregator import get_aggregator
from raylane.deployments.metrics.metric_set import MetricSet, sample_key
from raylane.deployments.metrics.reporter import MetricsReporter

logger = logging.getLogger(__name__)

ROUTER_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]
HTTP_BUCKETS = [0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0]


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
        self.auto_decisions = Counter(
            "raylane_auto_routing_decisions",
            "`auto` requests by how the pool was chosen (semantic, rule, default, sticky) and route.",
            ["route", "reason"], registry=r,
        )  # fmt: skip
        self.replica_routing = Counter(
            "raylane_replica_routing_decisions",
            "Requests sent to a pool replica, by why it was chosen (prefix_hit, least_loaded).",
            ["pool", "reason"], registry=r,
        )  # fmt: skip
        self.scale_events = Counter(
            "raylane_scale_events",
            "Changes in a pool's replica count, as each gateway replica's handle saw them (up, down).",
            ["pool", "direction"], registry=r,
        )  # fmt: skip
        self.fallbacks = Counter(
            "raylane_fallbacks", "Requests that left a pool for the next in their fallback chain.",
            ["from_pool", "to_pool", "reason"], registry=r,
        )  # fmt: skip
        self.shed = Counter(
            "raylane_shed", "Requests turned away (429) by load shedding.", ["tier"], registry=r
        )
        self.resumptions = Counter(
            "raylane_stream_resumptions",
            "Requests continued on a live replica after theirs failed, by pool resumed on and reason "
            "(replica_died, replica_unavailable, engine_dead, unavailable).",
            ["pool", "reason"], registry=r,
        )  # fmt: skip
        self.router_latency = Histogram(
            "raylane_router_latency_seconds", "Time the router took to resolve and admit a request.",
            buckets=ROUTER_BUCKETS, registry=r,
        )  # fmt: skip

    def observe(self, record) -> None:
        """Count one finished request (a `raylane.deployments.gateway.request_log.RequestRecord`)."""
        self.requests.labels(endpoint=record.endpoint, status_code=str(record.status)).inc()
        if record.latency_s is not None:
            self.duration.labels(endpoint=record.endpoint).observe(record.latency_s)
        if record.route:
            self.route_decisions.labels(route=record.route).inc()
        if record.route and record.decision:
            self.auto_decisions.labels(route=record.route, reason=record.decision).inc()
        for from_pool, to_pool, reason in record.fallbacks():
            self.fallbacks.labels(from_pool=from_pool, to_pool=to_pool, reason=reason).inc()
        if record.shed:
            self.shed.labels(tier=record.tier or "unknown").inc()
        if record.router_latency_s is not None:
            self.router_latency.observe(record.router_latency_s)
        for pool, reason in record.resumptions:
            self.resumptions.labels(pool=pool, reason=reason).inc()


_gateway: tuple[GatewayMetrics, MetricsReporter] | None = None
_config_generation: int | None = None  # the live config this replica serves (`raylane apply`)
CONFIG_GENERATION = "raylane_config_generation"


def set_config_generation(generation: int) -> None:
    global _config_generation
    _config_generation = generation


async def _gauges() -> tuple[dict, dict]:
    if _config_generation is None:
        return {}, {}
    _, reporter = _gateway
    families = {CONFIG_GENERATION: ("gauge", "Generation of the config each gateway replica serves.")}
    key = sample_key(CONFIG_GENERATION, CONFIG_GENERATION, {"replica": reporter.replica})
    return families, {key: float(_config_generation)}


def gateway_metrics() -> GatewayMetrics:
    """This process's `GatewayMetrics`; its reporter starts with the first request (needs Ray)."""
    global _gateway
    if _gateway is None:
        metrics = GatewayMetrics()
        _gateway = metrics, MetricsReporter(metrics, _gauges)
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
