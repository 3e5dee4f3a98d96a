"""The batch actor's metrics: lines and tokens finished, batches by status (deployments/batch/)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import Counter

from raylane.deployments.metrics.metric_set import MetricSet, sample_key
from raylane.deployments.metrics.reporter import MetricsReporter

BATCHES = "raylane_batches"


class BatchMetrics(MetricSet):
    def __init__(self) -> None:
        super().__init__()
        self.lines = Counter(
            "raylane_batch_lines", "Batch lines finished, by endpoint and result (completed, failed).",
            ["endpoint", "result"], registry=self.registry,
        )  # fmt: skip
        self.tokens = Counter(
            "raylane_batch_tokens", "Tokens of finished batch lines (input, output): their rate is the "
            "batch throughput.", ["kind"], registry=self.registry,
        )  # fmt: skip


def batch_reporter(
    metrics: BatchMetrics, app_name: str, by_status: Callable[[], dict[str, int]]
) -> MetricsReporter:
    """A reporter of `metrics` to the app's aggregator (the actor is no Serve replica, so the app is
    named here), with a gauge of the app's batches per status from `by_status()`."""

    async def gauges() -> tuple[dict, dict]:
        families = {BATCHES: ("gauge", "Batches of the app by status.")}
        values = {sample_key(BATCHES, BATCHES, {"status": s}): float(n) for s, n in by_status().items()}
        return families, values

    reporter = MetricsReporter(metrics, gauges)
    reporter.app_name = app_name
    return reporter
