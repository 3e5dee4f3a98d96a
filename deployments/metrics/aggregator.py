"""The app's one `MetricsAggregator`: totals of every replica's increments, live replicas' gauges.

What `/metrics` serves and `raylane status` reads (`get_aggregator`); replicas feed it through
`raylane.deployments.metrics.reporter`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric

from raylane.deployments.detached import NAMESPACE, detached_actor
from raylane.deployments.metrics.metric_set import Key

STALE_AFTER_S = 30.0  # a replica silent this long is gone: its gauges are dropped
AGGREGATOR_NAMESPACE = NAMESPACE
HISTORY_INTERVAL_S = 5.0  # totals kept every 5 s for `rates()` (raylane status)
HISTORY_LEN = 25


def aggregator_name(app_name: str | None = None) -> str:
    return f"raylane-metrics:{app_name or 'raylane'}"


def get_aggregator(app_name: str | None = None, create: bool = True):
    """The app's `MetricsAggregator` actor (created on first use: detached, so that no replica's
    restart takes the totals with it; `max_restarts` brings it back after a node loss)."""
    import ray

    name = aggregator_name(app_name)
    if not create:
        return ray.get_actor(name, namespace=AGGREGATOR_NAMESPACE)
    return detached_actor(MetricsAggregator, name, max_concurrency=1)


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
