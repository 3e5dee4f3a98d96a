"""A replica's metrics under vLLM's names (`vllm:num_requests_running`, `vllm:kv_cache_usage_perc`,
`vllm:time_to_first_token_seconds`, ...), labelled `model_name` as vLLM labels them, for a router
that reads a vLLM server's `/metrics` (the simulated server, `raylane sim-server`).

The figures are `PoolMetrics`' own (one source): its request histograms and counters renamed at
scrape time, and the engine's gauges and cumulative counters from `engine_stats()`.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from raylane.deployments.metrics.pool import PoolMetrics

# raylane's family -> vLLM's names for it (the inter-token histogram is both of vLLM V1's: ITL and TPOT).
RENAMED = {
    "raylane_time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    "raylane_inter_token_latency_seconds": (
        "vllm:inter_token_latency_seconds",
        "vllm:time_per_output_token_seconds",
    ),
    "raylane_e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "raylane_prompt_tokens": ("vllm:prompt_tokens",),
    "raylane_generation_tokens": ("vllm:generation_tokens",),
    "raylane_request_success": ("vllm:request_success",),
}
# vLLM's gauge -> (help, key of engine_stats()); the KV gauge under V0's name and V1's.
GAUGES = {
    "vllm:num_requests_running": ("Requests in the running batch.", "num_requests_running"),
    "vllm:num_requests_waiting": ("Requests waiting to be scheduled.", "num_requests_waiting"),
    "vllm:gpu_cache_usage_perc": ("KV-cache usage (0-1); vLLM V0's name.", "kv_cache_usage"),
    "vllm:kv_cache_usage_perc": ("KV-cache usage (0-1).", "kv_cache_usage"),
}
COUNTERS = {
    "vllm:prefix_cache_queries": ("Prompt tokens looked up in the prefix cache.", "prefix_cache_queries"),
    "vllm:prefix_cache_hits": ("Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
    "vllm:num_preemptions": ("Requests preempted for lack of KV blocks.", "num_preemptions"),
}
DROPPED_LABELS = ("pool", "adapter", "replica")


class VllmNamesCollector:
    """A prometheus_client collector: register it in a registry that `/metrics` exposes; set the engine's
    stats (`metrics.set_engine_stats`) before each scrape."""

    def __init__(self, metrics: PoolMetrics, model_name: str) -> None:
        self.metrics, self.model_name = metrics, model_name

    def collect(self):
        for family in self.metrics.registry.collect():
            for name in RENAMED.get(family.name, ()):
                yield self._renamed(family, name)
        stats, labels = self.metrics._engine, {"model_name": self.model_name}
        for name, (doc, key) in GAUGES.items():
            if key in stats:
                gauge = GaugeMetricFamily(name, doc, labels=list(labels))
                gauge.add_metric(list(labels.values()), float(stats[key]))
                yield gauge
        for name, (doc, key) in COUNTERS.items():
            if key in stats:
                counter = CounterMetricFamily(name, doc, labels=list(labels))
                counter.add_metric(list(labels.values()), float(stats[key]))
                yield counter

    def _renamed(self, family: Metric, name: str) -> Metric:
        renamed = Metric(name, family.documentation, family.type)
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k not in DROPPED_LABELS}
            labels.pop("model", None)
            labels["model_name"] = self.model_name
            suffix = sample.name[len(family.name) :]
            renamed.add_sample(name + suffix, labels, sample.value, sample.timestamp, sample.exemplar)
        return renamed
