"""A replica's side of aggregation: its increments (each at most once) and gauges, on a timer."""

from __future__ import annotations

import asyncio
import logging
import os
import uuid

from raylane.deployments.metrics.aggregator import get_aggregator
from raylane.deployments.metrics.metric_set import Key, MetricSet

logger = logging.getLogger(__name__)

REPORT_INTERVAL_S = float(os.environ.get("RAYLANE_METRICS_INTERVAL_S", "1.0"))


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
