"""Every Python and shell example in docs/ and README.md runs against the session's live app
(`api_server`: demo models as the pools `chat` and `reasoning`, the MiniLM embeddings, LoRA adapters, open
mode), so the docs cannot drift from the code. How blocks are found, run and marked not runnable:
tests/docs_examples.py. What the examples print is the demo models' noise, so each is checked by
running to the end (exit 0), not by its output."""

import os
import signal
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


def run(command: list[str], cwd: Path, timeout_s: float) -> subprocess.CompletedProcess:
    """`command` in a session of its own; past `timeout_s` its whole process group is killed, so an
    example that starts a server (one a marker forgot) leaves nothing running."""
    with subprocess.Popen(
        command, cwd=cwd, env=environment(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    ) as proc:  # fmt: skip
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            stderr += f"\n(killed after {timeout_s:g} s)"
        return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


@pytest.mark.parametrize("page", PYTHON_PAGES)
def test_a_pages_python_examples_run(api_server, page, tmp_path):
    script, starts = python_script(
        [e for e in RUNNABLE if e.page == page and e.language == "python"], api_server.url
    )
    path = tmp_path / "examples.py"
    path.write_text(script)
    done = run([sys.executable, str(path)], tmp_path, 300)
    where = ", ".join(f"script line {s} = {page}:{p}" for s, p in starts)
    assert done.returncode == 0, (
        f"{page}'s Python examples failed ({where}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    )


@pytest.mark.parametrize("example", SHELL, ids=[f"{e.page}:{e.line}" for e in SHELL])
def test_a_shell_example_runs(api_server, example):
    done = run(["bash", "-e", "-c", SHELL_PRELUDE + at(example.code, api_server.url)], REPO, 120)
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
