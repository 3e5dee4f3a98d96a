"""One live raylane for the whole compatibility run, driven by the real client libraries.

The libraries live in their own virtual environments (`make compat`; pyproject's `compat` and
`compat-openai2` extras say why), so this file imports nothing of raylane: the server is
`raylane serve --config tests/compat/cluster.yaml` run from raylane's own `.venv`, on a free port,
and stopped with SIGTERM (which drains the app and stops the Ray it started). A run that sets
RAYLANE_COMPAT_URL uses that server instead: `test_openai2_venv.py` runs the second environment's
tests that way, against the server of the first.

Nothing is downloaded: the Hugging Face libraries are offline, and tiktoken reads the encodings that
litellm ships (cl100k_base, o200k_base)."""

import importlib.util
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SERVER_VENV = Path(os.environ.get("RAYLANE_COMPAT_SERVER_VENV", REPO / ".venv"))
CLUSTER_YAML = Path(__file__).with_name("cluster.yaml")
MODEL = "smollm2-135m-instruct"
EMBEDDING_MODEL = "all-MiniLM-L6-v2"
START_TIMEOUT_S = 420.0

OFFLINE = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # litellm fetches its price list at import otherwise
    "OPENAI_AGENTS_DISABLE_TRACING": "1",
    "LANGSMITH_TRACING": "false",
    "DO_NOT_TRACK": "1",
    "OPENAI_API_KEY": "unused",  # open mode: the libraries insist on some key
}
os.environ.update(OFFLINE)


def _tiktoken_cache() -> str | None:
    """litellm's copies of tiktoken's files, named as tiktoken's cache names them (sha1 of the URL)."""
    if "TIKTOKEN_CACHE_DIR" in os.environ:
        return os.environ["TIKTOKEN_CACHE_DIR"]
    spec = importlib.util.find_spec("litellm")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(spec.submodule_search_locations[0]) / "litellm_core_utils" / "tokenizers"
    return str(folder) if folder.is_dir() else None


if cache := _tiktoken_cache():
    os.environ["TIKTOKEN_CACHE_DIR"] = cache

# The second environment's tests (instructor, llama-index) run there, not here.
collect_ignore = [] if importlib.util.find_spec("instructor") else ["openai2"]


# What the run measured (lm-eval's differences, the benchmarks' figures), printed at its end.
FIGURES: dict[str, str] = {}


def pytest_terminal_summary(terminalreporter):
    if FIGURES:
        terminalreporter.section("compatibility figures")
        for name, line in FIGURES.items():
            terminalreporter.write_line(f"{name}: {line}")


@dataclass
class Server:
    url: str  # http://127.0.0.1:PORT
    log: Path | None = None

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


READY_LINE = "raylane: OpenAI API at"  # printed once every replica is up


def _ready(url: str, log: Path) -> bool:
    """Every replica up (the CLI says so) and /health 200 (the gateway has seen the pool)."""
    if READY_LINE not in log.read_text(errors="replace"):
        return False
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.fixture(scope="session")
def server():
    if url := os.environ.get("RAYLANE_COMPAT_URL"):
        yield Server(url)
        return
    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="raylane-compat-")) / "server.log"
    command = [
        str(SERVER_VENV / "bin" / "raylane"),
        "serve",
        "--config",
        str(CLUSTER_YAML),
        "--port",
        str(port),
    ]
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _ready(url, log):
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"raylane serve did not start; its log ({log}):\n{log.read_text()[-4000:]}")
            time.sleep(1)
        yield Server(url, log)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(90)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="session")
def model_files() -> dict:
    """The served GGUF file and its tokenizer folder, as raylane's venv finds them:
    {"gguf": path, "dir": its folder, "name": its file name, "tokenizer": the converted tokenizer}."""
    code = (
        "import json; from raylane.models.packaged import packaged_model_path as p;"
        "from raylane.models.gguf import gguf_sidecar as s; g = p('smollm2-135m-instruct');"
        "print(json.dumps({'gguf': str(g), 'dir': str(g.parent), 'name': g.name, 'tokenizer': str(s(g))}))"
    )
    out = subprocess.run(
        [str(SERVER_VENV / "bin" / "python"), "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env=os.environ,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture
def openai_client(server):
    import openai

    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
