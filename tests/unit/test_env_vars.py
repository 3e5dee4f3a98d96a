"""Every environment variable the project reads is in README.md's "Environment variables" table: a knob
that is not a config field is at least written down in one place."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("bench", "cluster", "deployments", "engine", "models", "parallel", "router", "tests")


def test_every_raylane_variable_is_in_the_readme_table():
    used = {
        name
        for folder in FOLDERS
        for path in (ROOT / folder).rglob("*.py")
        for name in re.findall(r"\bRAYLANE_[A-Z][A-Z0-9_]*", path.read_text())
    }
    readme = (ROOT / "README.md").read_text()
    table = readme.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"`(RAYLANE_[A-Z0-9_]+)`", table))
    assert used, "no RAYLANE_ variable found: the scan is broken"
    assert used <= documented, f"not in README.md's table: {sorted(used - documented)}"
