"""The docs site's generated references (docs/_hooks/reference.py): every config field and every metric
the cluster serves has a description, since the reference pages print them as they are."""

import importlib.util
import sys
from pathlib import Path

import pytest

HOOK = Path(__file__).resolve().parents[2] / "docs" / "_hooks" / "reference.py"


@pytest.fixture(scope="module")
def reference():
    spec = importlib.util.spec_from_file_location("raylane_docs_reference", HOOK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_every_config_field_has_a_description(reference):
    sections = reference.config_sections()
    fields = [f for s in sections for f in s.fields]
    assert len(sections) >= 20 and len(fields) > 150  # the walk reaches the whole tree
    # a sample from deep in the tree: lists, dicts of models, optional sections
    paths = {f.path for f in fields}
    assert {"pools[].engine.max_num_seqs", "router.routes[].fallbacks", "tiers[].priority"} <= paths
    assert [f.path for f in fields if not f.description] == []
    assert [s.path or "ClusterConfig" for s in sections if not (s.model.__doc__ or "").strip()] == []


def test_every_metric_has_a_description_and_the_reference_lists_them(reference):
    metrics = {m.name: m for m in reference.metric_docs()}
    # one of each way a family is defined: a replica's metric set, the engine's counters and gauges,
    # and a family reported inline (by `raylane apply`, a gateway gauge, the batch actor's gauge)
    for name in (
        "raylane_time_to_first_token_seconds",
        "raylane_http_requests_total",
        "raylane_num_preemptions_total",
        "raylane_kv_cache_usage_perc",
        "raylane_config_applies_total",
        "raylane_config_generation",
        "raylane_batches",
    ):
        assert name in metrics
    assert metrics["raylane_request_success_total"].labels == ["pool", "model", "adapter", "finished_reason"]
    assert metrics["raylane_kv_cache_usage_perc"].labels == ["model", "pool", "replica"]
    assert [name for name, m in metrics.items() if not m.help.strip()] == []
    table = reference.metrics_markdown()
    assert all(f"`{name}`" in table for name in metrics)


def test_the_hook_fills_the_markers_and_leaves_other_pages_alone(reference):
    page = "# Observability\n\n<!-- generated: metrics -->\n"
    filled = reference.on_page_markdown(page)
    assert "<!-- generated" not in filled and "| `raylane_shed_total` | counter | `tier` |" in filled
    assert reference.on_page_markdown("# Quickstart\n") == "# Quickstart\n"
