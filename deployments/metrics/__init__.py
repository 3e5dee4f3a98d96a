"""Prometheus metrics of the cluster: what each replica records, and the one aggregate `/metrics` serves.

Names and meanings follow vLLM's with a `raylane_` prefix (../shared/DESIGN.md, Conventions).

**Recording.** Every pool replica wraps its `AsyncLLM` in `MeteredLLM` (`pool.py`), which watches
the output stream the replica already iterates: TTFT and e2e latency from the engine's
`RequestOutput.metrics`, inter-token latency between streamed outputs (a non-streamed request adds
its mean gap once per token), prompt and generation tokens, and one `raylane_request_success_total`
per finished choice (vLLM V1 counts each of `n` samples as a request). Engine state is read between
steps when the replica reports: running/waiting requests, KV use, and the engine's own prefix-cache
and preemption counters. Gateway replicas (`gateway.py`) count HTTP requests and the router's
decisions, fallbacks and sheds (`GatewayMetrics.observe`, from each finished request's
`RequestRecord`).

**Aggregation.** Replicas report (`reporter.py`) to one `MetricsAggregator` actor per app
(`aggregator.py`: named, detached, created by whichever replica reports first) once a second
(`RAYLANE_METRICS_INTERVAL_S`). Counters and histograms travel as *increments* since the last
acknowledged report, tagged with a sequence number that the aggregator applies at most once; the
aggregator adds them to totals it owns. So a replica that restarts, scales down or dies takes nothing
from the totals (it loses at most its last second of increments), and the series carry no replica
label: `rate()` never sees a drop. Only if the aggregator itself is lost (its node dies; Ray restarts
it) do totals start again from zero, which Prometheus reads as an ordinary counter reset. Gauges are
per replica (`replica` label) and vanish `STALE_AFTER_S` after a replica stops reporting; the
dashboard sums running/waiting and averages KV use by pool.
"""
