"""The benchmark results checked in under bench/results/: each says what machine produced it, and each
is named by the page whose table it backs, so a reader can tell where a table's figures came from."""

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RESULTS = sorted((REPO / "bench" / "results").glob("*.json"))
DOCS = ("docs/performance.md", "bench/README.md", "bench/PARALLEL.md", "CHANGELOG.md")


def test_results_are_kept():
    assert RESULTS, "bench/results/ holds no JSON"


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_every_result_names_its_machine(path: Path):
    data = json.loads(path.read_text())
    # Benchmarks that run a model in-process write `machine`; HTTP clients (serve, compare) `client_machine`.
    machine = data.get("machine") or data.get("client_machine")
    assert machine, f"{path.name} has no machine line"
    # The CPU's name with its family/model and vector extensions: figures move with them.
    assert "AVX" in machine["cpu"], machine["cpu"]
    assert isinstance(machine["cores"], int) and machine["cores"] > 0
    assert machine.get("torch"), f"{path.name}: no torch version"


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_every_result_is_named_by_a_doc_page(path: Path):
    relative = f"bench/results/{path.name}"
    assert any(relative in (REPO / doc).read_text() for doc in DOCS), f"no doc page names {relative}"
