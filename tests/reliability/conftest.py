"""Reliability tests: each module deploys its own small app on the session's Serve (so killing a
replica or draining a gateway disturbs no other test) and records its figures with `report`; the
table is printed at the end of the run, and written as JSON to $RAYLANE_RELIABILITY_REPORT if set
(docs/reliability.md's table comes from there)."""

import json
import os
from contextlib import contextmanager

import pytest

RESULTS: dict[str, dict] = {}


@pytest.fixture
def report():
    """report(name, **figures): one row of the reliability table."""

    def record(name: str, **figures) -> None:
        RESULTS[name] = figures

    return record


def pytest_terminal_summary(terminalreporter):
    if not RESULTS:
        return
    terminalreporter.section("reliability figures")
    for name, figures in RESULTS.items():
        terminalreporter.write_line(f"{name}: " + ", ".join(f"{k}={v}" for k, v in figures.items()))
    if path := os.environ.get("RAYLANE_RELIABILITY_REPORT"):
        with open(path, "w") as f:
            json.dump(RESULTS, f, indent=2)


@contextmanager
def deployed(api_server, name: str, config: dict):
    """Deploy `config` (a ClusterConfig dict; http comes from the session's Serve) as app `name` under
    /name; yields its base URL (…/name) once /health answers 200; deletes the app afterwards. Unless
    the config says otherwise: a small gateway, no embeddings, one route `chat` to the first pool."""
    from ray import serve

    from raylane.config import ClusterConfig
    from raylane.deployments.app import build_app, delete_app
    from tests.live_servers import wait_healthy

    port = int(api_server.url.rsplit(":", 1)[1])
    defaults = {
        "gateway": {"num_cpus": 0.1},
        "embeddings": {"enabled": False},
        "router": {"routes": [{"name": "chat", "pool": config["pools"][0]["name"]}]},
    }
    cluster = ClusterConfig.from_dict({"http": {"host": "127.0.0.1", "port": port}, **defaults, **config})
    serve.run(build_app(cluster), name=name, route_prefix=f"/{name}")
    url = f"{api_server.url}/{name}"
    try:
        wait_healthy(f"{url}/health", 300)
        yield url
    finally:
        delete_app(name)


def replica_names(app: str, deployment: str) -> list[str]:
    """Names of the live replica actors of one deployment (`ModelPool:NAME`, `Gateway`) of `app`."""
    import ray

    prefix = f"SERVE_REPLICA::{app}#{deployment}#"
    return [
        a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)
    ]


def running_replicas(app: str, deployment: str) -> int:
    """Replicas Serve reports RUNNING for one deployment of `app`."""
    from ray import serve

    return serve.status().applications[app].deployments[deployment].replica_states.get("RUNNING", 0)


def ongoing(replica: str) -> int:
    """Requests in flight on one replica, as its actor counts them for Serve's router."""
    import ray

    return ray.get(ray.get_actor(replica, namespace="serve").get_num_ongoing_requests.remote())


def llama_pool(demo_models, name: str, **extra) -> dict:
    engine = {"max_num_seqs": 8, "num_kv_blocks": 128, "cpus_per_rank": 0.25, "seed": 0}
    return {
        "name": name,
        "model": str(demo_models["raylane-llama-tiny"]),
        "engine": engine | extra.pop("engine", {}),
        **extra,
    }


def sim_pool(name: str, profile: str = "llama-3.1-8b-h100", **extra) -> dict:
    """A pool of simulated replicas (engine/sim/): the real scheduler, KV blocks and output path, no
    weights and no torch; tokens are made up. For a test that needs a pool's behaviour, not a model's
    words: a replica starts in a fraction of a model's time, and its steps cost sleep, not CPU."""
    return {
        "name": name,
        "model": f"sim:{profile}",
        "engine": {"cpus_per_rank": 0.1} | extra.pop("engine", {}),
        **extra,
    }


def replica_rss_mb(app: str) -> dict[str, float]:
    """Resident memory of each Serve replica process of `app` (Ray titles them
    `ray::ServeReplica:APP:DEPLOYMENT`), in MiB, keyed by deployment."""
    from pathlib import Path

    marker = f"ray::ServeReplica:{app}:".encode()
    out: dict[str, float] = {}
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or not (proc / "cmdline").read_bytes().startswith(marker):
                continue
            title = (proc / "cmdline").read_bytes().split(b"\0")[0][len(marker) :].decode()
            name = title.split(".")[0]  # the title ends with the method running now, if any
            rss_kb = next(
                int(line.split()[1])
                for line in (proc / "status").read_text().splitlines()
                if line.startswith("VmRSS:")
            )
        except (OSError, StopIteration):
            continue
        out[name] = out.get(name, 0.0) + rss_kb / 1024
    return out


def replica_tree_pss_mb(app: str, shmem: bool = True) -> dict[str, float]:
    """Memory of each Serve replica of `app` with its child processes (bounded workers, a forkserver,
    an engine core), keyed by deployment, in MiB: the proportional set size, so that pages a forked
    worker shares with its forkserver count once between them, and a worker started mid-run adds
    what it holds of its own, not a second copy of its imports."""
    from raylane.bench.common import process_tree_pss_mib

    replica = f"ServeReplica:{app}:"
    tree = process_tree_pss_mib(root=1, shmem=shmem)  # every process on the machine
    out: dict[str, float] = {}
    for pid, (_, _, pss) in tree.items():
        node = pid
        while node in tree and not tree[node][1].startswith(replica):
            node = tree[node][0]
        if node in tree:
            deployment = tree[node][1][len(replica) :]
            out[deployment] = out.get(deployment, 0.0) + pss
    return out


def forked_workers(app: str, deployment: str) -> int:
    """Processes the replicas of one deployment of `app` run as bounded workers: the children of
    each replica's forkserver, so the grandchildren of the replica process."""
    from raylane.bench.common import process_tree_pss_mib

    tree = process_tree_pss_mib(root=1)
    replicas = {pid for pid, (_, name, _) in tree.items() if name == f"ServeReplica:{app}:{deployment}"}
    return sum(tree[ppid][0] in replicas for ppid, _, _ in tree.values() if ppid in tree)


def serve_cpu_s(app: str) -> dict[str, float]:
    """CPU seconds (user + system) spent so far by Serve's HTTP proxy and each replica process of
    `app`, keyed `proxy` or by deployment; a replica's child processes (an engine core) count
    with it. Beside them, from /proc/stat: `machine`, the busy CPU seconds of the whole machine
    (everything else on it is the difference), and `steal`, the time the VM's host gave its
    cores to other guests."""
    import os
    from pathlib import Path

    tick = os.sysconf("SC_CLK_TCK")
    replica = f"ray::ServeReplica:{app}:".encode()
    owner, parent, cpu = {}, {}, {}
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit():
                continue
            title = (proc / "cmdline").read_bytes().split(b"\0")[0]
            fields = (proc / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        pid = int(proc.name)
        parent[pid], cpu[pid] = int(fields[1]), (int(fields[11]) + int(fields[12])) / tick
        if title.startswith(b"ray::ProxyActor"):
            owner[pid] = "proxy"
        elif title.startswith(replica):
            owner[pid] = title[len(replica) :].decode().split(".")[0]
    out: dict[str, float] = {}
    for pid, seconds in cpu.items():
        node = pid
        while node in parent and node not in owner:
            node = parent[node]
        if node in owner:
            out[owner[node]] = out.get(owner[node], 0.0) + seconds
    # cpu  user nice system idle iowait irq softirq steal ...
    ticks = [int(t) for t in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    out["machine"] = (sum(ticks[:3]) + ticks[5] + ticks[6]) / tick
    out["steal"] = ticks[7] / tick
    return out


def resumptions(url: str, key: str | None = None) -> float:
    """Streams the app at `url` resumed on another replica or pool, from its /metrics (read with API
    key `key` where the app has keys)."""
    import httpx2
    from prometheus_client.parser import text_string_to_metric_families

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    text = httpx2.get(f"{url}/metrics", headers=headers, timeout=60).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "raylane_stream_resumptions_total"
    )
