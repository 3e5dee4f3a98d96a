"""A worker node that hosts a pool dies, and comes back.

A Ray cluster of two raylets on this machine (apart from the session's Ray): the head runs the
gateway and pool `backup`, the worker pool `primary`, each pinned by a resource only its node
advertises (as on KubeRay). Killing the worker's process group (raylet, workers, agents: the node
is gone at once) must move `primary`'s traffic to `backup`, with the fallback header; every request
is answered, and the streams running on `primary` at the kill are not cut: they resume on `backup`,
which serves the same checkpoint (deployments/gateway/resumption.py), each token-identical to its undisturbed
run. A new worker node joins; Serve places `primary` on it and traffic returns.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx2
import pytest

from raylane.cluster.k8s import GATEWAY_RESOURCE, pool_resource
from raylane.cluster.serve_env import SERVE_ENV
from tests.live_servers import free_ports, stop_processes_mentioning, wait_healthy, wait_until
from tests.reliability.conftest import llama_pool

pytestmark = pytest.mark.timeout(900)
RAY = str(Path(sys.executable).with_name("ray"))
HELLO = {"model": "primary", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
# As long as the tiny model's 512 positions allow: unloaded, a stream of 200 tokens took 0.6-0.8 s,
# so one that got going a moment before the other could finish before the kill.
STREAMS, TOKENS = 2, 480


class TwoNodeCluster:
    def __init__(self, demo_models):
        self.temp_dir = tempfile.mkdtemp(prefix="rlnode", dir="/tmp")  # short: socket paths have a limit
        # Every port the head and the app take, picked at once so no two are the same.
        self.port, self.http_port, *self.head_ports = free_ports(6)
        self.env = (
            {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
            | SERVE_ENV
            | {
                "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
                "RAY_AUTH_MODE": "disabled",
                "TOKENIZERS_PARALLELISM": "false",
                # Notice a dead node in a few seconds, not the default fifteen; not quicker: on two
                # busy cores a live raylet can miss a check by a second and be declared dead.
                "RAY_health_check_period_ms": "1000",
                "RAY_health_check_timeout_ms": "1000",
                "RAY_health_check_failure_threshold": "3",
            }
        )
        self.demo_models = demo_models
        self.worker: subprocess.Popen | None = None
        self.workers_started = 0
        self.worker_log = os.path.join(self.temp_dir, "workers.log")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def start_head(self) -> None:
        ports = self.head_ports
        command = [
            RAY, "start", "--head", "--disable-usage-stats", f"--port={self.port}",
            "--include-dashboard=false",
            f"--dashboard-agent-listen-port={ports[0]}", f"--dashboard-agent-grpc-port={ports[1]}",
            f"--metrics-export-port={ports[2]}", f"--ray-client-server-port={ports[3]}",
            f"--temp-dir={self.temp_dir}", "--num-cpus=4",
            f"--resources={json.dumps({pool_resource('backup'): 1, GATEWAY_RESOURCE: 1})}",
        ]  # fmt: skip
        subprocess.run(command, env=self.env, check=True, capture_output=True, timeout=180)

    def start_worker(self) -> None:
        """A worker node in its own process group, in the foreground (`--block`): killing the group
        takes the whole node down at once, as a lost machine would."""
        ports = free_ports(3, taken={self.port, self.http_port, *self.head_ports})
        command = [
            RAY, "start", f"--address=127.0.0.1:{self.port}", "--block", "--num-cpus=2",
            f"--resources={json.dumps({pool_resource('primary'): 1})}",
            f"--dashboard-agent-listen-port={ports[0]}", f"--dashboard-agent-grpc-port={ports[1]}",
            f"--metrics-export-port={ports[2]}",
        ]  # fmt: skip
        self.workers_started += 1
        with open(self.worker_log, "a") as log:
            print(f"-- worker node {self.workers_started}", file=log, flush=True)
            self.worker = subprocess.Popen(
                command, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def restart_a_dead_worker(self) -> None:
        """A worker declared dead by a missed health check under load (its `ray start --block`
        exits then) is replaced, as KubeRay replaces a worker pod."""
        if self.worker is not None and self.worker.poll() is not None:
            self.start_worker()

    def kill_worker(self) -> None:
        os.killpg(self.worker.pid, signal.SIGKILL)
        self.worker.wait(timeout=30)

    def deploy(self) -> None:
        config = {
            "http": {"host": "127.0.0.1", "port": self.http_port},
            "gateway": {"num_cpus": 0.1, "pool_health_period_s": 0.5},
            "embeddings": {"enabled": False},
            "pools": [llama_pool(self.demo_models, "primary"), llama_pool(self.demo_models, "backup")],
            "router": {"routes": [{"name": "chat", "pool": "primary", "fallbacks": ["backup"]}]},
        }
        command = [sys.executable, "-m", "tests.reliability.node_death_app", json.dumps(config)]
        env = self.env | {"RAY_ADDRESS": f"127.0.0.1:{self.port}"}
        with tempfile.TemporaryFile("w+") as log:
            deploy = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
            deadline = time.monotonic() + 400
            while deploy.poll() is None and time.monotonic() < deadline:
                # The worker may be declared dead before the test begins (a missed health check
                # under load): a new one joins, as in the test itself, and Serve places `primary`
                # there.
                self.restart_a_dead_worker()
                time.sleep(1)
            if deploy.poll() is None:
                deploy.kill()
            log.seek(0)
            assert deploy.wait() == 0, log.read()[-6000:]

    def stop(self) -> None:
        if self.worker is not None and self.worker.poll() is None:
            os.killpg(self.worker.pid, signal.SIGKILL)
        # Not `ray stop`: it would kill every Ray on the machine, the test session's own included.
        stop_processes_mentioning(self.temp_dir)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(demo_models):
    cluster = TwoNodeCluster(demo_models)
    try:
        cluster.start_head()
        cluster.start_worker()
        cluster.deploy()
        wait_healthy(f"{cluster.url}/health", 300)
        yield cluster
    finally:
        cluster.stop()


def chat(url: str) -> tuple[int, str, str | None]:
    """(status, pool, fallback header) of one request; status 0 when no HTTP answer came."""
    try:
        r = httpx2.post(f"{url}/v1/chat/completions", json=HELLO, timeout=120)
    except httpx2.HTTPError as e:
        return 0, type(e).__name__, None
    return r.status_code, r.headers.get("x-raylane-pool", ""), r.headers.get("x-raylane-fallback")


class Stream(threading.Thread):
    """One greedy stream of TOKENS tokens: its text, finish reason, usage and chunks so far."""

    def __init__(self, url: str, i: int) -> None:
        super().__init__()
        self.url, self.i = url, i
        self.text, self.finish, self.usage, self.chunks, self.error = "", None, None, 0, None
        self.going = threading.Event()

    def run(self) -> None:
        body = {
            "model": "primary",
            "messages": [{"role": "user", "content": f"story {self.i}"}],
            "max_tokens": TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        try:
            with httpx2.stream("POST", f"{self.url}/v1/chat/completions", json=body, timeout=240) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line.removeprefix("data: "))
                    if "error" in event:
                        self.error = event["error"]
                    self.usage = event.get("usage") or self.usage
                    for choice in event.get("choices", []):
                        self.text += choice["delta"].get("content") or ""
                        self.finish = choice["finish_reason"] or self.finish
                    self.chunks += 1
                    if self.chunks >= 2:  # the role, then the first token
                        self.going.set()
        except httpx2.HTTPError as e:
            self.error = repr(e)
        finally:
            self.going.set()


def streams(url: str) -> list[Stream]:
    started = [Stream(url, i) for i in range(STREAMS)]
    for s in started:
        s.start()
    return started


def test_traffic_moves_to_the_fallback_when_a_node_dies_and_returns_with_it(cluster, report):
    assert chat(cluster.url)[:2] == (200, "primary")
    undisturbed = streams(cluster.url)
    for s in undisturbed:
        s.join(timeout=240)
    assert [(s.finish, s.error) for s in undisturbed] == [("length", None)] * STREAMS
    answers: list[tuple[float, int, str, str | None]] = []
    stop = threading.Event()

    def steady_traffic() -> None:
        while not stop.is_set():
            answers.append((time.monotonic(), *chat(cluster.url)))
            time.sleep(0.1)

    sender = threading.Thread(target=steady_traffic)
    sender.start()
    in_flight: list[Stream] = []
    try:
        time.sleep(1)
        in_flight = streams(cluster.url)
        for s in in_flight:
            assert s.going.wait(120), "a stream did not get going"
        cluster.kill_worker()
        killed = time.monotonic()
        at_kill = [(s.finish, s.error, s.chunks) for s in in_flight]
        wait_until(lambda: any(t > killed and pool == "backup" for t, _, pool, _ in answers), 120, "fallback")
        fell_back = next(t for t, _, pool, _ in answers if t > killed and pool == "backup") - killed
        time.sleep(2)
        cluster.start_worker()
        rejoined = time.monotonic()

        def primary_back() -> bool:
            cluster.restart_a_dead_worker()
            return any(t > rejoined and pool == "primary" for t, _, pool, _ in answers)

        try:
            wait_until(primary_back, 400, "primary back")
        except TimeoutError as e:
            raise TimeoutError(
                f"{e}; the worker nodes' output:\n{Path(cluster.worker_log).read_text()[-4000:]}"
            ) from None
        recovered = next(t for t, _, pool, _ in answers if t > rejoined and pool == "primary") - rejoined
    finally:
        stop.set()
        sender.join(timeout=150)
        for s in in_flight:
            s.join(timeout=240)
    # Every stream was still running when the node died (neither finished nor failed).
    assert all(finish is None and error is None for finish, error, _ in at_kill), at_kill
    # No stream was cut: each went on (on `backup`) and is its undisturbed run, token for token.
    assert [s.error for s in in_flight] == [None] * STREAMS
    for before, after in zip(undisturbed, in_flight, strict=True):
        assert (after.finish, after.text) == ("length", before.text)
        assert after.usage["completion_tokens"] == TOKENS
    statuses = [status for _, status, _, _ in answers]
    assert 0 not in statuses  # every request got an HTTP answer: none lost or hung
    assert statuses.count(200) == len(statuses), answers  # the request in flight at the kill included
    # Requests sent after the kill: `primary` may answer a few while its replica process outlives the
    # raylet by a moment; from the first fallback on, every answer comes from `backup`, saying why.
    after_kill = [
        (round(t - killed, 2), pool, fallback) for t, _, pool, fallback in answers if killed < t < rejoined
    ]
    moved = next(i for i, (_, pool, _) in enumerate(after_kill) if pool == "backup")
    assert all(pool == "backup" and fallback for _, pool, fallback in after_kill[moved:]), after_kill
    assert after_kill[-1][2].startswith("primary")  # the header names the pool it fell back from
    report(
        "node death",
        sent=len(answers),
        lost=0,
        streams_in_flight=STREAMS,
        streams_cut=0,
        status_5xx=len(statuses) - statuses.count(200),
        first_fallback_after_s=round(fell_back, 1),
        primary_back_after_node_joined_s=round(recovered, 1),
        worker_nodes_started=cluster.workers_started,
    )
