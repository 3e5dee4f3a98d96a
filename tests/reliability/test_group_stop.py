"""`raylane serve` stopped the way systemd, `timeout` and most supervisors stop a service: SIGTERM to
its whole process group. It must exit cleanly (code 0) within 30 s (the issue's bound: a supervisor
kills what is still running after its own timeout) and leave no Ray process behind."""

import os
import signal
import subprocess
import tempfile
from pathlib import Path

import openai
import pytest

from tests.integration.test_openai_api import alive, descendants, start_raylane_serve, wait_for
from tests.live_servers import free_port

pytestmark = pytest.mark.timeout(600)
STOP_BOUND_S = 30


def ray_processes_of(root: str) -> list[tuple[int, str]]:
    """Live processes whose command line names `root` (this serve's Ray temp dir: GCS, raylet,
    dashboard and workers all take their session dir under it), so other Rays on the machine
    (the test session's own) do not count."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if root in text and alive(int(cmdline.parent.name)):
            found.append((int(cmdline.parent.name), text[:120]))
    return found


def test_sigterm_to_the_process_group_stops_raylane_serve_cleanly(demo_models, tmp_path, monkeypatch):
    port = free_port()
    config = tmp_path / "small.yaml"
    config.write_text(
        f"http: {{port: {port}}}\n"
        "embeddings: {enabled: false}\n"
        "pools: [{name: chat, model: 'demo:raylane-llama-tiny', engine: {num_kv_blocks: 128}}]\n"
    )
    root = tempfile.mkdtemp(prefix="rl-grp-", dir="/tmp")  # short: Ray's socket paths live under it
    monkeypatch.setenv("RAY_TMPDIR", root)
    proc, lines, reader = start_raylane_serve(demo_models, "--config", str(config), timeout=300)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60)
        r = client.chat.completions.create(
            model="chat", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
        assert r.choices[0].message.content is not None
        started = descendants(proc.pid)
        assert ray_processes_of(root), "the Ray of this serve runs under its own temp dir"
        assert any("gcs_server" in text for _, text in ray_processes_of(root))
        # A plain ray.init() elsewhere on the machine must still start its own Ray, not join this one
        # through the address file that `ray start` writes in Ray's shared temp dir.
        assert not (Path(root) / "ray" / "ray_current_cluster").exists()

        os.killpg(proc.pid, signal.SIGTERM)  # what `systemctl stop`, `timeout` and `kill -TERM -PGID` do
        try:
            code = proc.wait(timeout=STOP_BOUND_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {STOP_BOUND_S} s after SIGTERM:\n" + "".join(lines[-30:]))
        assert code == 0, "".join(lines[-30:])
        left = wait_for(
            lambda: not [p for p in started if alive(p)] and not ray_processes_of(root), timeout=15
        )
        assert left, ([p for p in started if alive(p)], ray_processes_of(root))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for pid, _ in ray_processes_of(root):  # never leave a stray Ray to the rest of the session
            os.kill(pid, signal.SIGKILL)
    reader.join(timeout=5)
    assert "raylane: stopped" in "".join(lines)
