"""The Grafana dashboard loads as dashboard JSON, and every query names a metric `/metrics` exports."""

import json
import re
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

DASHBOARDS = Path(__file__).parents[2] / "k8s" / "dashboards"


def exported_sample_names() -> set[str]:
    """Sample names in the aggregate `/metrics` renders after one request of every kind."""
    from raylane.deployments.gateway.request_record import RequestRecord
    from raylane.deployments.metrics.aggregator import MetricsAggregator
    from raylane.deployments.metrics.gateway import GatewayMetrics
    from raylane.deployments.metrics.pool import PoolMetrics, RequestTracker
    from raylane.engine.outputs import CompletionOutput, RequestOutput

    pool = PoolMetrics("chat", "m")
    tracker = RequestTracker(pool, delta=True)
    for tokens, reason in (([1], None), ([2], "stop")):
        metrics = {"time_to_first_token": 0.1, "e2e_latency": 0.2}
        tracker.observe(
            RequestOutput(
                "r", None, [1, 2], [CompletionOutput(0, "", tokens, None, reason)], bool(reason), 0, metrics
            )
        )
    pool.set_engine_stats(
        {"num_requests_running": 0, "num_requests_waiting": 0, "kv_cache_usage": 0.0}
        | {
            "prefix_cache_queries": 2,
            "prefix_cache_hits": 0,
            "prefix_cache_hit_rate": 0.0,
            "num_preemptions": 0,
        }
    )
    gateway = GatewayMetrics()
    served = RequestRecord("a", "POST", "/v1/chat/completions", endpoint="/v1/chat/completions", status=200)
    served.route, served.pool, served.tier, served.fallback = "coding", "chat", "free", "coding;reason=error"
    served.latency_s, served.router_latency_s = 0.3, 0.001
    served.decision, served.resumptions = "sticky", [("chat", "replica_died")]
    shed = RequestRecord("b", "POST", "/v1/chat/completions", endpoint="/v1/chat/completions", status=429)
    shed.route, shed.tier, shed.shed = "chat", "free", True
    for record in (served, shed):
        gateway.observe(record)
    gateway.replica_routing.labels(pool="chat", reason="prefix_hit").inc()
    gateway.scale_events.labels(pool="chat", direction="up").inc()
    aggregator = MetricsAggregator()
    aggregator.report(
        "p", 1, pool.families() | pool.gauge_families(), pool.counter_values(), pool.gauge_values("p")
    )
    aggregator.report("g", 1, gateway.families(), gateway.counter_values(), {})
    text = aggregator.render().decode()
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def test_dashboard_is_grafana_json_with_unique_panels_and_prometheus_targets():
    dashboard = json.loads((DASHBOARDS / "raylane.json").read_text())
    assert dashboard["title"] and dashboard["uid"] and isinstance(dashboard["schemaVersion"], int)
    panels = dashboard["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    for panel in panels:
        assert {"x", "y", "w", "h"} <= set(panel["gridPos"]) and panel["gridPos"]["x"] + panel["gridPos"][
            "w"
        ] <= 24
        if panel["type"] != "row":
            assert panel["targets"], panel["title"]
            assert all(t["datasource"]["type"] == "prometheus" and t["expr"] for t in panel["targets"])
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "pool"} <= variables


def test_every_query_names_an_exported_metric():
    dashboard = json.loads((DASHBOARDS / "raylane.json").read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    queries += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    exported = exported_sample_names()
    named = {name for q in queries for name in re.findall(r"\braylane_[a-z0-9_]+", q)}
    assert named, "no raylane_ metric in the dashboard"
    assert named <= exported, f"not exported: {sorted(named - exported)}"
    wanted = {
        "raylane_time_to_first_token_seconds_bucket", "raylane_inter_token_latency_seconds_bucket",
        "raylane_generation_tokens_total", "raylane_num_requests_running", "raylane_num_requests_waiting",
        "raylane_kv_cache_usage_perc", "raylane_prefix_cache_hits_total", "raylane_route_decisions_total",
        "raylane_fallbacks_total", "raylane_shed_total", "raylane_http_requests_total",
        "raylane_replica_routing_decisions_total", "raylane_auto_routing_decisions_total",
        "raylane_prefix_cache_hit_rate", "raylane_scale_events_total", "raylane_stream_resumptions_total",
    }  # fmt: skip
    assert wanted <= named, f"the dashboard lacks {sorted(wanted - named)}"


def test_scrape_config_scrapes_raylane_once_and_every_ray_node():
    config = yaml.safe_load((DASHBOARDS / "prometheus-scrape.yaml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs["raylane"]["metrics_path"] == "/metrics"
    assert len(jobs["raylane"]["static_configs"][0]["targets"]) == 1
    assert jobs["ray"]["kubernetes_sd_configs"]
