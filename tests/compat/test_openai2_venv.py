"""instructor and llama-index in their own environment, against this run's server.

Both cap `openai` below 3 (llama-index-llms-openai: openai<3; instructor: jiter<0.15, which openai
3.10 and later exclude), while openai-agents and pydantic-ai need openai 3: so `make compat` puts them
in .venv-compat-openai2, and each of their files here runs there under pytest, with
RAYLANE_COMPAT_URL naming this run's server."""

import os
import subprocess
import sys

import pytest

from tests.compat.conftest import REPO

OPENAI2_PYTHON = REPO / ".venv-compat-openai2" / "bin" / "python"


@pytest.mark.parametrize("module", ["test_instructor.py", "test_llama_index.py"])
def test_in_the_openai2_environment(server, module):
    if not OPENAI2_PYTHON.exists():
        pytest.fail(f"{OPENAI2_PYTHON} is missing: `make compat` makes it")
    command = [str(OPENAI2_PYTHON), "-m", "pytest", "-c", "tests/compat/pytest.ini", "-p", "no:cacheprovider"]
    command += ["-q", "-rA", "--tb=short", f"tests/compat/openai2/{module}"]
    env = os.environ | {"RAYLANE_COMPAT_URL": server.url}
    run = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    sys.stdout.write(run.stdout)  # each test's outcome, in this run's report (-rA)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
