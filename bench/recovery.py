"""`raylane bench recovery`: where the time goes when a pool replica dies and Serve brings it back.

One pool (by default the embedded default's `coding`: SmolLM2-135M-Instruct from its GGUF) in a Ray
and Serve this command starts. Each round kills the replica's process (SIGKILL, as the OOM killer
or a crash does) and times, from the kill:
- detected:   Serve's controller no longer counts the replica RUNNING (it learns of a death at its
              next health check of the replica: `health_check_period_s`);
- process:    the new replica's process exists (Ray started a worker for it);
- init:       the pool's constructor begins (the worker, Ray and Serve started, raylane imported);
- engine:     the engine is ready (engine core process started, checkpoint loaded, KV cache made);
- ready:      the constructor returned (tokenizer, serving objects, grammar forkserver started);
- running:    Serve reports the replica RUNNING;
- served:     a request through the gateway is answered by the new replica.

    raylane bench recovery [--pool coding] [--rounds 3] [--config FILE] [--out DIR]
"""

import argparse
import os
import signal
import statistics
import sys
import time
from pathlib import Path

from raylane.bench.common import machine_info, print_table, write_json

PHASES = ("detected", "process", "init", "engine", "ready", "running", "served")
POLL_S = 0.02


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="cluster config (default: the embedded default)")
    parser.add_argument("--pool", default="coding", help="the pool whose replica is killed")
    parser.add_argument("--rounds", type=int, default=3, help="kills per scenario")
    parser.add_argument("--out", type=Path, help="folder to write recovery.json into")


def run(args: argparse.Namespace) -> int:
    from raylane.bench.apps import LocalServe
    from raylane.config import ClusterConfig, default_config

    base = ClusterConfig.from_yaml(args.config) if args.config else default_config()
    pool = base.pool(args.pool)
    config = ClusterConfig.from_dict(
        {
            "pools": [pool.model_dump(mode="json", exclude_defaults=True)],
            "router": {"routes": [{"name": pool.name, "pool": pool.name}], "default_route": pool.name},
            "embeddings": {"enabled": False},
        }
    )
    rounds = []
    with LocalServe() as local:
        url = local.deploy({"recovery": config})["recovery"]
        app = "raylane-bench-recovery"
        serve_request(url, pool.name, time.monotonic() + 300)  # warm: the first request pays imports
        for i in range(args.rounds):
            rounds.append(kill_and_time(app, url, pool.name))
            print(
                f"round {i + 1}: " + ", ".join(f"{p} {rounds[-1][p]:.2f}s" for p in PHASES), file=sys.stderr
            )
    report(rounds, pool.name, pool.health_check_period_s, args.out)
    return 0


def kill_and_time(app: str, url: str, pool: str) -> dict[str, float]:
    """Kill the pool's replica; seconds from the kill to each phase of its replacement."""
    import psutil
    from ray import serve

    from raylane.deployments.gateway.pool_health import pool_deployment_name

    handle = serve.get_deployment_handle(pool_deployment_name(pool), app_name=app)
    old = handle.startup_times.remote().result(timeout_s=60)
    killed = time.time()
    os.kill(old["pid"], signal.SIGKILL)
    detected = wait_for(lambda: running(app, pool) == 0, 120)
    new = wait_for_value(lambda: _new_startup(handle, old["pid"]), 600)
    running_at = wait_for(lambda: running(app, pool) == 1, 600)
    served = serve_request(url, pool, time.monotonic() + 300)
    return {
        "detected": detected - killed,
        "process": psutil.Process(new["pid"]).create_time() - killed,
        "init": new["init"] - killed,
        "engine": new["engine_ready"] - killed,
        "ready": new["ready"] - killed,
        "running": running_at - killed,
        "served": served - killed,
    }


def _new_startup(handle, old_pid: int) -> dict | None:
    """The replacement replica's start-up times, once Serve routes to it."""
    try:
        new = handle.startup_times.remote().result(timeout_s=5)
    except Exception:
        return None
    return new if new["pid"] != old_pid else None


def running(app: str, pool: str) -> int:
    from ray import serve

    from raylane.deployments.gateway.pool_health import pool_deployment_name

    status = serve.status().applications[app].deployments[pool_deployment_name(pool)]
    return status.replica_states.get("RUNNING", 0)


def wait_for(condition, timeout_s: float) -> float:
    """`time.time()` when `condition()` first held."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the replica did not come back")
        time.sleep(POLL_S)
    return time.time()


def wait_for_value(get, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while (value := get()) is None:
        if time.monotonic() > deadline:
            raise TimeoutError("the replica did not come back")
        time.sleep(POLL_S)
    return value


def serve_request(url: str, pool: str, deadline: float) -> float:
    """`time.time()` when a short chat request through the gateway was first answered 200."""
    import httpx2

    body = {"model": pool, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    while True:
        try:
            if httpx2.post(f"{url}/v1/chat/completions", json=body, timeout=30).status_code == 200:
                return time.time()
        except httpx2.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError("no request was served")
        time.sleep(POLL_S)


def report(rounds: list[dict[str, float]], pool: str, health_period_s: float, out: Path | None) -> None:
    machine = machine_info()
    print(f"\nMachine: {machine['cpu']}, {machine['cores']} cores; pool {pool}, health_check_period_s "
          f"{health_period_s:g}; {len(rounds)} kills; seconds from the kill (median, max):")  # fmt: skip
    rows, previous = [], 0.0
    for phase in PHASES:
        values = [r[phase] for r in rounds]
        median = statistics.median(values)
        rows.append([phase, f"{median:.2f}", f"{max(values):.2f}", f"+{median - previous:.2f}"])
        previous = median
    print_table(["phase", "median s", "max s", "phase took (median)"], rows)
    if out is not None:
        write_json(out / "recovery.json", {"machine": machine, "pool": pool, "rounds": rounds})
