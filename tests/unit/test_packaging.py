"""What `pip install raylane` puts on sys.path: one root, `raylane`, and no bare `engine` or `models`
that would shadow (or be shadowed by) another distribution's package of that common name."""

import subprocess
import sys
import tomllib
from pathlib import Path

from tests.unit.test_import_graph import PACKAGES

ROOT = Path(__file__).resolve().parents[2]


def test_pyproject_lists_every_package_under_the_raylane_root():
    """A subpackage left out of pyproject's list would be missing from a wheel (an editable install
    finds it anyway, so only a non-editable install would show it)."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {
        ".".join([name, *init.parent.relative_to(ROOT / folder).parts])
        for folder, name in PACKAGES.items()
        if folder != "tests"
        for init in (ROOT / folder).rglob("__init__.py")
    }
    assert set(setuptools["packages"]) == on_disk
    top = {k: v for k, v in setuptools["package-dir"].items() if k.count(".") == 1}
    assert top == {name: folder for folder, name in PACKAGES.items() if folder not in ("tests", "raylane")}


def test_only_the_raylane_root_is_importable_outside_the_checkout(tmp_path):
    probe = (
        "import importlib.util as u, raylane.engine, raylane.config, raylane.cluster.cli; "
        f"print([f for f in {sorted(PACKAGES)!r} if f not in ('tests', 'raylane') and u.find_spec(f)])"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout
