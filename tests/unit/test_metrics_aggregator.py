"""The aggregate that `/metrics` serves: totals that never go backwards when replicas come and go,
reports applied at most once, gauges per live replica, and vLLM-style per-request recording."""

import pytest

from raylane.deployments.metrics.aggregator import MetricsAggregator, render
from raylane.deployments.metrics.pool import MeteredLLM, PoolMetrics, RequestTracker
from raylane.engine.outputs import CompletionOutput, RequestOutput


def output(tokens, reason=None, ttft=0.1, e2e=None, prompt=(1, 2, 3), index=0):
    metrics = {"time_to_first_token": ttft} | ({"e2e_latency": e2e} if e2e is not None else {})
    comp = CompletionOutput(index, "", list(tokens), None, reason)
    return RequestOutput("r", None, list(prompt), [comp], reason is not None, 0, metrics)


def total(aggregator, family, sample=None, **labels):
    return sum(
        v
        for (f, s, ls), v in aggregator.totals.items()
        if f == family and (sample is None or s == sample) and set(labels.items()) <= set(ls)
    )


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_a_replica_that_goes_away_keeps_its_counts_in_the_totals():
    clock = Clock()
    aggregator = MetricsAggregator(clock=clock, stale_after_s=30)
    key = ("raylane_prompt_tokens", "raylane_prompt_tokens_total", (("pool", "chat"),))
    gauge = (
        "raylane_num_requests_running",
        "raylane_num_requests_running",
        (("pool", "chat"), ("replica", "a")),
    )
    families = {"raylane_prompt_tokens": ("counter", ""), "raylane_num_requests_running": ("gauge", "")}
    aggregator.report("a", 1, families, {key: 10.0}, {gauge: 2.0})
    aggregator.report("a", 1, families, {key: 10.0}, {gauge: 2.0})  # a retried report: once only
    assert aggregator.totals[key] == 10.0
    clock.now += 60  # replica a died; its replacement b starts from zero
    aggregator.report("b", 1, families, {key: 3.0}, {})
    assert aggregator.totals[key] == 13.0
    text = aggregator.render().decode()
    assert 'raylane_prompt_tokens_total{pool="chat"} 13.0' in text
    assert "raylane_num_requests_running" not in text  # a's gauge went with it


def test_a_streamed_request_is_recorded_like_vllm():
    metrics, clock = PoolMetrics("chat", "m"), Clock()
    tracker = RequestTracker(metrics, delta=True, clock=clock)
    tracker.observe(output([5]))
    clock.now += 0.06
    tracker.observe(output([6, 7]))  # two steps' tokens in one output (batched, or a slow reader)
    clock.now += 0.03
    tracker.observe(output([8], reason="stop", e2e=0.5))
    tracker.close()  # after the finished output: nothing more
    aggregator = MetricsAggregator()
    aggregator.report("a", 1, metrics.families(), metrics.counter_values(), {})
    assert total(aggregator, "raylane_prompt_tokens") == 3
    assert total(aggregator, "raylane_generation_tokens") == 4
    assert total(aggregator, "raylane_request_success", finished_reason="stop") == 1
    ttft = "raylane_time_to_first_token_seconds"
    assert total(aggregator, ttft, f"{ttft}_count") == 1
    itl = "raylane_inter_token_latency_seconds"
    # One gap per token after the first, as vLLM records a step's: the merged output's 60 ms is two
    # 30 ms gaps, not one 60 ms gap.
    assert total(aggregator, itl, f"{itl}_count") == 3
    assert total(aggregator, itl, f"{itl}_sum") == pytest.approx(0.09)
    assert total(aggregator, itl, f"{itl}_bucket", le="0.05") == 3
    summary = tracker.summary  # what the pool sends the gateway with the last item
    assert (summary.prompt_tokens, summary.completion_tokens, summary.finish_reason) == (3, 4, "stop")


def test_a_request_left_early_counts_as_aborted():
    metrics = PoolMetrics("chat", "m")
    tracker = RequestTracker(metrics, delta=True)
    tracker.observe(output([5]))
    tracker.close("abort")
    values = metrics.counter_values()
    assert (
        values[("raylane_request_success", "raylane_request_success_total", _labels(finished_reason="abort"))]
        == 1
    )


def test_a_requests_tokens_are_counted_under_its_lora_adapter():
    metrics = PoolMetrics("chat", "m")
    for adapter, tokens in (("", [5]), ("team-a", [6, 7]), ("team-a", [8])):
        tracker = RequestTracker(metrics, delta=True, adapter=adapter)
        tracker.observe(output(tokens, reason="stop", e2e=0.5))
    values = metrics.counter_values()
    generated = ("raylane_generation_tokens", "raylane_generation_tokens_total")
    assert values[(*generated, _labels())] == 1
    assert values[(*generated, _labels(adapter="team-a"))] == 3
    success = ("raylane_request_success", "raylane_request_success_total")
    assert values[(*success, _labels(adapter="team-a", finished_reason="stop"))] == 2


def test_metered_llm_passes_everything_but_generate_through():
    class Fake:
        tokenizer = "tok"

    assert MeteredLLM(Fake(), PoolMetrics("p", "m")).tokenizer == "tok"


def test_histogram_buckets_render_in_order():
    values = {
        ("h", "h_bucket", (("le", "+Inf"),)): 2.0,
        ("h", "h_bucket", (("le", "0.5"),)): 1.0,
        ("h", "h_count", ()): 2.0,
        ("h", "h_sum", ()): 0.7,
    }
    text = render({"h": ("histogram", "a histogram")}, values).decode()
    assert text.index('le="0.5"') < text.index('le="+Inf"') < text.index("h_count")


def _labels(**extra):
    return tuple(sorted(({"pool": "chat", "model": "m", "adapter": ""} | extra).items()))
