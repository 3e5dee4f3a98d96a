"""Every environment variable the project reads is in the docs' "Environment variables" table
(docs/operators/configuration.md): a knob that is not a config field is at least written down in one place."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("bench", "cluster", "deployments", "engine", "models", "parallel", "router", "tests")


def test_every_raylane_variable_is_in_the_docs_table():
    used = {
        name
        for folder in FOLDERS
        for path in (ROOT / folder).rglob("*.py")
        for name in re.findall(r"\bRAYLANE_[A-Z][A-Z0-9_]*", path.read_text())
    }
    page = (ROOT / "docs" / "operators" / "configuration.md").read_text()
    table = page.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"`(RAYLANE_[A-Z0-9_]+)`", table))
    assert used, "no RAYLANE_ variable found: the scan is broken"
    assert used <= documented, f"not in docs/operators/configuration.md's table: {sorted(used - documented)}"
