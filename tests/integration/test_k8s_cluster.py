"""The k8s manifests' Serve config and the ops jobs, on a local Ray cluster shaped like the pods.

One Ray head (`ray start`, with the dashboard: it takes Serve's REST deploys and job submissions, as
on Kubernetes) advertises what the rendered worker groups advertise (each pool's pinning resource,
the gateway's) and gets the API keys through its environment, as the pods get them from the Secret.
It is separate from the session's in-process Ray, which runs without a dashboard.
"""

import collections
import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.live_servers import free_ports, stop_processes_mentioning, wait_until

REPO = Path(__file__).resolve().parents[2]
API_KEY = "sk-k8s-test"
pytestmark = pytest.mark.timeout(900)


def rendered_cpu_demo() -> dict:
    text = (REPO / "k8s" / "base" / "rayservice.yaml").read_text()
    return yaml.safe_load(text)


def rest(dashboard: str, method: str, path: str, body: dict | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(dashboard + path, data=data, method=method)
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            raw = r.read()
    except urllib.error.HTTPError as e:
        raise AssertionError(f"{method} {path}: {e.code}: {e.read().decode()[-2000:]}") from None
    return json.loads(raw) if raw.strip() else {}


class LocalCluster:
    def __init__(self, dashboard: str, http_port: int, env: dict, serve_config: dict):
        self.dashboard, self.http_port, self.env = dashboard, http_port, env
        self.serve_config = serve_config  # serveConfigV2 of the manifest, on a free local port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def deploy(self, serve_config: dict) -> None:
        """What KubeRay does with serveConfigV2: PUT it to the dashboard's Serve API."""
        rest(self.dashboard, "PUT", "/api/serve/applications/", serve_config)

    def app(self) -> dict:
        return rest(self.dashboard, "GET", "/api/serve/applications/")["applications"].get("raylane", {})

    def wait_replicas(self, replicas: dict[str, int], status: str | None = "RUNNING", timeout=300) -> dict:
        """Until the app has `status` (None: any) and these deployments these RUNNING replicas."""
        deadline = time.monotonic() + timeout
        while True:
            app = self.app()
            counts = {
                name: sum(r["state"] == "RUNNING" for r in d.get("replicas", []))
                for name, d in app.get("deployments", {}).items()
            }
            wanted = all(counts.get(k) == v for k, v in (replicas or {}).items())
            if status in (None, app.get("status")) and wanted:
                return app
            assert app.get("status") != "DEPLOY_FAILED", app.get("message")
            assert time.monotonic() < deadline, f"app not RUNNING: {app.get('status')} {counts}"
            time.sleep(1)

    def submit(self, entrypoint: str, timeout: float = 300) -> tuple[str, str]:
        from ray.job_submission import JobStatus, JobSubmissionClient

        client = JobSubmissionClient(self.dashboard)
        job = client.submit_job(entrypoint=entrypoint, runtime_env={"working_dir": str(REPO)})
        deadline = time.monotonic() + timeout
        while (status := client.get_job_status(job)) not in {JobStatus.SUCCEEDED, JobStatus.FAILED}:
            assert time.monotonic() < deadline, f"job {job} still {status}"
            time.sleep(1)
        return status.value, client.get_job_logs(job)


@pytest.fixture(scope="module")
def cluster(demo_models):
    service = rendered_cpu_demo()
    groups = service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    resources = {k: int(v) * g["replicas"] for g in groups for k, v in g["resources"].items()}
    names = ("gcs", "dashboard", "agent", "agent_grpc", "metrics", "client", "http")
    ports = dict(zip(names, free_ports(len(names)), strict=True))
    http_port = ports.pop("http")
    temp_dir = tempfile.mkdtemp(prefix="rlk8s", dir="/tmp")  # short: Ray's socket paths have a limit
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    bin_dir = str(Path(sys.executable).parent)
    env |= {
        "PATH": f"{bin_dir}:{env.get('PATH', '')}",
        "RAYLANE_API_KEYS": f"{API_KEY} premium",  # the cpu-demo config reads keys from this variable
        "RAYLANE_DEMO_DIR": str(next(iter(demo_models.values())).parent),  # written already
        "TOKENIZERS_PARALLELISM": "false",
        "RAY_AUTH_MODE": "disabled",  # a token in ~/.ray would turn dashboard auth on: not for this test
    }
    start = [
        str(Path(bin_dir) / "ray"), "start", "--head", "--disable-usage-stats",
        f"--port={ports['gcs']}", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
        f"--dashboard-port={ports['dashboard']}", f"--dashboard-agent-listen-port={ports['agent']}",
        f"--dashboard-agent-grpc-port={ports['agent_grpc']}", f"--metrics-export-port={ports['metrics']}",
        f"--ray-client-server-port={ports['client']}", f"--temp-dir={temp_dir}", "--num-cpus=6",
        f"--resources={json.dumps(resources)}",
    ]  # fmt: skip
    subprocess.run(start, env=env, check=True, capture_output=True, timeout=180)
    address = f"127.0.0.1:{ports['gcs']}"
    try:
        serve_config = yaml.safe_load(service["spec"]["serveConfigV2"])
        serve_config["http_options"] = {"host": "127.0.0.1", "port": http_port}  # the pod's 0.0.0.0:8000
        yield LocalCluster(
            f"http://127.0.0.1:{ports['dashboard']}", http_port, env | {"RAY_ADDRESS": address}, serve_config
        )
    finally:
        # Not `ray stop`: it kills every Ray on the machine, the test session's own included.
        stop_processes_mentioning(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def deployed(cluster):
    cluster.deploy(cluster.serve_config)
    cluster.wait_replicas({})
    return cluster


def chat_request(url: str, model: str, stream: bool = False, max_tokens: int = 8, **extra):
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Say hello."}]
    return client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, stream=stream, extra_body=extra or None
    )


def test_the_manifests_serve_config_serves_chat(deployed):
    """serveConfigV2 of the rendered cpu-demo RayService, deployed as KubeRay deploys it."""
    app = deployed.app()
    assert app["deployed_app_config"]["import_path"] == "raylane.deployments.app:build_app"
    assert set(app["deployments"]) == {"Gateway", "ModelPool:coding", "ModelPool:reasoning", "ModelPool:chat"}
    reply = chat_request(deployed.url, "chat")
    assert reply.usage.completion_tokens > 0 and reply.choices[0].message.content


def test_a_route_edit_reconfigures_the_gateway_and_restarts_no_pool(deployed):
    """An operator edits the routes in the cluster config and renders it again (`raylane k8s sync`),
    and KubeRay PUTs the new serveConfigV2: the gateway takes them in place, and every replica keeps
    running."""
    import openai

    from raylane.cluster import k8s
    from raylane.config import ClusterConfig

    client = openai.OpenAI(base_url=f"{deployed.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    coding = [{"role": "user", "content": "Write a Python function that parses a CSV file."}]

    def pool_of_auto() -> str:
        reply = client.chat.completions.with_raw_response.create(model="auto", messages=coding, max_tokens=1)
        return reply.headers["x-raylane-pool"]

    def replicas() -> dict[str, set[str]]:
        deployments = deployed.app()["deployments"]
        return {name: {r["replica_id"] for r in d["replicas"]} for name, d in deployments.items()}

    assert pool_of_auto() == "coding"
    before = replicas()
    config = yaml.safe_load((REPO / "k8s" / "configs" / "cpu-demo.yaml").read_text())
    config["router"] = {"routes": [{"name": "chat", "pool": "chat"}]}
    edited = k8s.serve_config(ClusterConfig.from_dict(config))
    edited["http_options"] = deployed.serve_config["http_options"]  # as the fixture's
    deployed.deploy(edited)
    try:
        wait_until(lambda: pool_of_auto() == "chat", 120, "auto routed by the edited routes")
        assert replicas() == before  # the pools' and the gateway's: reconfigured, not restarted
        assert deployed.app()["status"] == "RUNNING"
    finally:
        deployed.deploy(deployed.serve_config)
        wait_until(lambda: pool_of_auto() == "coding", 120, "auto routed by the manifest's routes")


def routes_supported(url: str) -> bool:
    """Whether the gateway routes `model: auto` yet (the router's wiring lands separately)."""
    import openai

    try:
        chat_request(url, "auto", max_tokens=1)
    except openai.NotFoundError:
        return False
    return True


def smoke(cluster: LocalCluster, *extra: str) -> tuple[str, str]:
    args = ["--url", cluster.url, "--api-key", API_KEY, *extra]
    return cluster.submit("python -m raylane.cluster.jobs.smoke " + " ".join(args))


def pool_status(url: str, pool: str) -> str | None:
    request = urllib.request.Request(f"{url}/health", headers={"Authorization": f"Bearer {API_KEY}"})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            body = json.load(r)
    except urllib.error.HTTPError as e:
        body = json.load(e)
    return body.get("pools", {}).get(pool, {}).get("status")


def test_smoke_job_passes_then_fails_on_a_broken_pool(deployed):
    no_routes = () if routes_supported(deployed.url) else ("--no-routes",)
    status, logs = smoke(deployed, *no_routes)
    assert status == "SUCCEEDED", logs
    for pool in ("coding", "reasoning", "chat"):
        assert f"ok    pool {pool}" in logs
    assert "ok    deployment ModelPool:chat" in logs  # the job sees Serve's state from inside the cluster

    # The chat pool hangs: its replica process stops answering (Serve replaces it only after its
    # health check times out, 30 s on).
    (replica,) = deployed.app()["deployments"]["ModelPool:chat"]["replicas"]
    os.kill(replica["pid"], signal.SIGSTOP)
    try:
        # /health answers from the gateway's last check: the smoke job runs once that has found it.
        wait_until(lambda: pool_status(deployed.url, "chat") == "unavailable", 120, "chat found hung")
        status, logs = smoke(deployed, "--timeout", "10", *no_routes)
        assert status == "FAILED", logs
        assert "FAIL  /health" in logs and "FAIL  pool chat" in logs
        assert "ok    pool coding" in logs and "ok    pool reasoning" in logs
    finally:
        with contextlib.suppress(ProcessLookupError):  # Serve may have replaced it already
            os.kill(replica["pid"], signal.SIGCONT)
        deployed.wait_replicas({"ModelPool:chat": 1})


def test_warmup_job_waits_for_replicas_and_prefills_system_prompts(deployed, tmp_path):
    prompts = tmp_path / "prompts.yaml"
    system = "You are raylane's support assistant. Answer briefly and cite the runbook. " * 8
    prompts.write_text(yaml.safe_dump({"*": [system], "coding": ["You write Python."]}))
    entrypoint = (
        f"python -m raylane.cluster.jobs.warmup --url {deployed.url} --api-key {API_KEY} "
        f"--system-prompts {prompts}"
    )
    status, logs = deployed.submit(entrypoint)
    assert status == "SUCCEEDED", logs
    assert "ok    replicas: coding 1, reasoning 1, chat 1" in logs
    assert (
        "ok    pool coding: 2 system prompt(s) x 2" in logs
        and "ok    pool chat: 1 system prompt(s) x 2" in logs
    )


def test_raylane_serve_redeploys_in_place_while_streams_run(deployed, tmp_path):
    """`raylane serve --config NEW` against a running cluster whose app it did not record (deployed
    from the manifest's serveConfigV2): the whole app is redeployed. Each deployment starts its new
    replica beside the old one, and the old one stops only once the new one runs (Serve's surge, one
    replica), so the streams in flight finish and requests sent meanwhile are answered (at worst a
    503 naming a pool that is not up yet); none is cut or hangs."""
    import openai

    config = yaml.safe_load((REPO / "k8s" / "configs" / "cpu-demo.yaml").read_text())
    config["http"] = {"host": "127.0.0.1", "port": deployed.http_port}
    for pool in config["pools"]:
        if pool["name"] == "chat":
            pool["served_model_name"] = "chat-v2"
            pool["engine"] = {**pool["engine"], "max_num_seqs": 16}  # the pool's replica is replaced
    (tmp_path / "new.yaml").write_text(yaml.safe_dump(config))

    results: list[str] = []
    ended: list[float] = []
    probes: list[tuple[float, float, str]] = []  # (sent at, seconds, outcome): requests meanwhile
    stopping: dict[str, float] = {}  # deployment -> when an old replica was first seen STOPPING or gone
    first_ids: dict[str, set[str]] = {}  # deployment -> its replicas when the watch began
    new_seen: dict[str, float] = {}  # deployment -> when a replica not among those was first seen
    redeployed = threading.Event()

    def stream(model: str) -> None:
        # Long enough to be running when the old replicas stop (Serve stops them first, then starts
        # the new ones), short enough to end inside their graceful shutdown (GRACEFUL_SHUTDOWN_TIMEOUT_S,
        # 120 s from the stop) on a slower machine: 1500 tokens outlasted it in CI; 800 take about 60 s here.
        try:
            chunks = chat_request(deployed.url, model, stream=True, max_tokens=800, ignore_eos=True)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            results.append("ok" if text else "empty")
            ended.append(time.monotonic())
        except openai.OpenAIError as e:
            results.append(f"{type(e).__name__}: {e}")

    def probe() -> None:
        while not redeployed.is_set():
            sent = time.monotonic()
            try:
                outcome = "ok" if chat_request(deployed.url, "coding").choices[0].message.content else "empty"
            except openai.APIStatusError as e:
                outcome = f"{e.status_code} {e.code}"
            except openai.OpenAIError as e:
                outcome = f"{type(e).__name__}: {e}"
            probes.append((sent, time.monotonic() - sent, outcome))
            time.sleep(1.0)

    def watch() -> None:
        while not redeployed.is_set():
            try:
                deployments = deployed.app().get("deployments", {})
            except (AssertionError, OSError):  # the dashboard is busy with the deploy: look again
                deployments = {}
            for name, d in deployments.items():
                replicas = d.get("replicas", [])
                ids = first_ids.setdefault(name, {r["replica_id"] for r in replicas})
                # An old replica with nothing in flight stops within a watch period: gone counts too.
                serving = {r["replica_id"] for r in replicas if r["state"] != "STOPPING"}
                if ids - serving:
                    stopping.setdefault(name, time.monotonic())
                if any(r["replica_id"] not in ids for r in replicas):
                    new_seen.setdefault(name, time.monotonic())
            time.sleep(0.5)

    threads = [threading.Thread(target=stream, args=(m,)) for m in ["chat", "chat", "coding", "reasoning"]]
    helpers = [threading.Thread(target=probe), threading.Thread(target=watch)]
    for t in threads + helpers:
        t.start()
    time.sleep(1.0)  # the streams are running
    raylane = str(Path(sys.executable).with_name("raylane"))
    redeploy_started = time.monotonic()
    try:
        done = subprocess.run(
            [raylane, "serve", "--config", str(tmp_path / "new.yaml")],
            env=deployed.env, capture_output=True, text=True, timeout=400,
        )  # fmt: skip
    finally:
        redeployed.set()
    redeploy_returned = time.monotonic()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "redeployed" in done.stdout
    for t in threads + helpers:
        t.join(timeout=300)
    assert results == ["ok"] * 4, results
    # The gateway's and chat's old replicas stopped only once their new ones had started beside them
    # (seconds of start-up: without the surge the old one stops as the new one is created).
    assert {"Gateway", "ModelPool:chat"} <= set(stopping), stopping
    for name in ("Gateway", "ModelPool:chat"):
        assert new_seen.get(name, math.inf) < stopping[name] - 1.0, (name, new_seen, stopping)
    replaced = max(stopping["Gateway"], stopping["ModelPool:chat"])
    # Requests sent while the new replicas start: an answer or a clean 503, never a cut connection.
    assert {o for *_, o in probes} <= {"ok", "503 pool_unavailable"}, probes
    assert any(sent > replaced for sent, *_ in probes), "no request was sent during the replacement"
    outcomes, slowest = collections.Counter(o for *_, o in probes), max(s for _, s, _ in probes)
    print(f"new replicas beside the old {[round(t - redeploy_started, 1) for t in new_seen.values()]} s and "
          f"old replicas stopping {replaced - redeploy_started:.1f} s after the redeploy began; streams "
          f"ended {[round(t - redeploy_started, 1) for t in ended]} s after; it returned after "
          f"{redeploy_returned - redeploy_started:.1f} s; requests meanwhile {dict(outcomes)}, the "
          f"slowest {slowest:.1f} s")  # fmt: skip
    models = [m.id for m in openai.OpenAI(base_url=f"{deployed.url}/v1", api_key=API_KEY).models.list()]
    assert "chat-v2" in models
    assert chat_request(deployed.url, "chat-v2").choices[0].message.content


def test_raylane_serve_will_not_change_the_ingress_in_place(deployed, tmp_path):
    """The ingress is fixed when Ray starts: asking a running cluster (the manifests', behind Serve's
    proxy) for HAProxy fails at once, naming the field, and leaves the app serving."""
    config = yaml.safe_load((REPO / "k8s" / "configs" / "cpu-demo.yaml").read_text())
    config["http"] = {"host": "127.0.0.1", "port": deployed.http_port, "ingress": "haproxy"}
    (tmp_path / "haproxy.yaml").write_text(yaml.safe_dump(config))
    raylane = str(Path(sys.executable).with_name("raylane"))
    done = subprocess.run(
        [raylane, "serve", "--config", str(tmp_path / "haproxy.yaml")],
        env=deployed.env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert "http.ingress haproxy differs from the running cluster's proxy" in done.stderr
    assert chat_request(deployed.url, "coding").choices[0].message.content
