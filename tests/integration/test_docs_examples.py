"""Every Python and shell example in docs/ and README.md runs against the session's live app
(`api_server`: demo models as the pools `chat` and `reasoning`, the MiniLM embeddings, LoRA adapters, open
mode), so the docs cannot drift from the code. How blocks are found, run and marked not runnable:
tests/docs_examples.py. What the examples print is the demo models' noise, so each is checked by
running to the end (exit 0), not by its output."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs_examples import REPO, SHELL_PRELUDE, all_examples, at, python_script

EXAMPLES = [e for e in all_examples() if e.language in ("python", "shell")]  # YAML: a unit test
RUNNABLE = [e for e in EXAMPLES if e.not_tested is None]
PYTHON_PAGES = sorted({e.page for e in RUNNABLE if e.language == "python"})
SHELL = [e for e in RUNNABLE if e.language == "shell"]


def environment() -> dict:
    bin_dir = str(Path(sys.executable).parent)  # `raylane`, `python3` and `pip` of this environment
    return os.environ | {"PATH": f"{bin_dir}:{os.environ.get('PATH', '')}", "PYTHONUNBUFFERED": "1"}


@pytest.mark.parametrize("page", PYTHON_PAGES)
def test_a_pages_python_examples_run(api_server, page, tmp_path):
    script, starts = python_script(
        [e for e in RUNNABLE if e.page == page and e.language == "python"], api_server.url
    )
    path = tmp_path / "examples.py"
    path.write_text(script)
    done = subprocess.run(
        [sys.executable, str(path)],
        cwd=tmp_path,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    where = ", ".join(f"script line {s} = {page}:{p}" for s, p in starts)
    assert done.returncode == 0, (
        f"{page}'s Python examples failed ({where}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    )


@pytest.mark.parametrize("example", SHELL, ids=[f"{e.page}:{e.line}" for e in SHELL])
def test_a_shell_example_runs(api_server, example):
    done = subprocess.run(
        ["bash", "-e", "-c", SHELL_PRELUDE + at(example.code, api_server.url)],
        cwd=REPO, env=environment(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, (
        f"{example.page}:{example.line} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    )


def test_every_example_runs_or_says_why_not():
    """A block that does not run names its reason; at least the quickstart's request and the guides run."""
    assert all(e.not_tested.strip() for e in EXAMPLES if e.not_tested is not None)
    assert "docs/quickstart.md" in PYTHON_PAGES and "README.md" in PYTHON_PAGES
    assert {e.page for e in RUNNABLE} >= {
        "docs/guides/api.md",
        "docs/guides/batches.md",
        "docs/guides/errors.md",
    }
    print(f"\ndocs examples: {len(RUNNABLE)} run, {len(EXAMPLES) - len(RUNNABLE)} marked not tested")
