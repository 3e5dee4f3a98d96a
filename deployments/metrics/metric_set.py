"""A replica's own Prometheus registry, read as plain values for the aggregator."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

Key = tuple[str, str, tuple[tuple[str, str], ...]]  # (family, sample name, sorted labels)


def sample_key(family: str, sample: str, labels: dict[str, str]) -> Key:
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
                    values[sample_key(metric.name, s.name, s.labels)] = s.value
        return values
