"""`raylane bench autoscale`: a step of load on a pool of simulated replicas that autoscales, from
`--min-replicas` to `--max-replicas`. The pool (`sim:` replicas: the real scheduler and waiting
queue, no weights, bench/fleet.py) scales on the requests waiting in its engines
(deployments/pool/autoscaling.py). At t=0, `--concurrency` streams start back to back (a closed
loop) and run for `--duration-s`. Every second the bench reads Serve's replica states; afterwards it
bins each stream's finish into the output rate over time.

Reported: when Serve started the first new replica (the autoscaler's decision), when it ran and when
all of them did (time to capacity), when the
output rate first reached 90% of its plateau (the median of the last third of the run), and every
stream that failed or came back short: none may be lost while replicas start.

    raylane bench autoscale --min-replicas 2 --max-replicas 32 --out bench/results/autoscale
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from raylane.bench.common import client_result, print_table, write_json
from raylane.bench.datasets import BenchRequest
from raylane.bench.fleet import raylane_config
from raylane.bench.stream_load import Stream, Target, run_load

APP, POOL = "autoscale", "ModelPool:sim"
BIN_S = 5.0  # the output rate's resolution


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", default="llama-3.1-8b-l4", help="the simulated engine's profile")
    parser.add_argument("--min-replicas", type=int, default=2, help="replicas before the step")
    parser.add_argument(
        "--max-replicas", type=int, default=32, help="the most replicas the pool may scale to"
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=2,
        help="each engine's batch: small, so few streams need many replicas",
    )
    parser.add_argument(
        "--concurrency", type=int, help="streams in the step (default: max replicas x max num seqs)"
    )
    parser.add_argument(
        "--duration-s", type=float, default=240.0, help="how long the step's streams are sent"
    )
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens of each stream")
    parser.add_argument("--out", type=Path, help="folder for autoscale.json and autoscale.png")


def pool_config(args: argparse.Namespace) -> dict[str, Any]:
    config = raylane_config(args.profile, args.min_replicas, args.max_num_seqs, "proxy")
    config["pools"][0]["replicas"] |= {
        "min_replicas": args.min_replicas,
        "max_replicas": args.max_replicas,
        # A full replica holds max_num_seqs streams: in flight alone keeps a full fleet where it is,
        # requests waiting in the engines ask for more.
        "target_ongoing_requests": args.max_num_seqs,
        "target_waiting_requests": 1,
        "target_kv_cache_usage": None,
        "look_back_period_s": 10,
        "upscale_delay_s": 1,
        "downscale_delay_s": 3600,  # the step lasts the run: no scaling down inside it
    }
    return config


def replica_states() -> tuple[int, int]:
    """The pool's (running, starting) replicas, as Serve counts them."""
    from ray import serve

    from raylane.bench.apps import APP_PREFIX

    app = serve.status().applications.get(APP_PREFIX + APP)
    deployment = app.deployments.get(POOL) if app else None
    states = deployment.replica_states if deployment else {}
    return states.get("RUNNING", 0), states.get("STARTING", 0)


def step(target: Target, args: argparse.Namespace) -> tuple[list[Stream], list[tuple[float, int, int]]]:
    """The streams of the step and (seconds since it began, running, starting replicas) once a second."""
    requests = [
        BenchRequest(
            messages=[{"role": "user", "content": f"Tell a long story, number {i}."}],
            prompt_tokens=8,
            max_tokens=args.max_tokens,
        )
        for i in range(256)
    ]
    replicas: list[tuple[float, int, int]] = []
    done = threading.Event()
    started = time.monotonic()

    def sample() -> None:
        while not done.is_set():
            replicas.append((time.monotonic() - started, *replica_states()))
            done.wait(1.0)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        concurrency = args.concurrency or args.max_replicas * args.max_num_seqs
        streams, _ = asyncio.run(run_load(target, requests, args.duration_s, concurrency=concurrency))
    finally:
        done.set()
        sampler.join()
    for s in streams:
        s.sent -= started  # seconds since the step began
    return streams, replicas


def summarize(streams: list[Stream], replicas: list[tuple[float, int, int]], args) -> dict[str, Any]:
    rate: dict[int, int] = {}
    for s in streams:
        if s.e2e is not None:
            rate[int((s.sent + s.e2e) // BIN_S)] = (
                rate.get(int((s.sent + s.e2e) // BIN_S), 0) + s.output_tokens
            )
    bins = [rate.get(b, 0) / BIN_S for b in range(int(args.duration_s // BIN_S))]
    plateau = statistics.median(bins[len(bins) * 2 // 3 :]) if bins else 0.0
    at_90 = next((i * BIN_S for i, r in enumerate(bins) if plateau and r >= 0.9 * plateau), None)
    asked = next((t for t, n, starting in replicas if n + starting > args.min_replicas), None)
    first_new = next((t for t, n, _ in replicas if n > args.min_replicas), None)
    all_up = next((t for t, n, _ in replicas if n >= args.max_replicas), None)
    lost = [s for s in streams if s.status != 200 or s.output_tokens != args.max_tokens]
    return {
        "streams": len(streams),
        "lost": len(lost),
        "lost_examples": [
            {"status": s.status, "error": s.error, "tokens": s.output_tokens} for s in lost[:5]
        ],
        "first_replica_starting_s": asked,
        "first_new_replica_s": first_new,
        "all_replicas_s": all_up,
        "most_replicas": max((n for _, n, _ in replicas), default=0),
        "output_tokens_per_s_plateau": plateau,
        "rate_at_90pct_of_plateau_s": at_90,
        "output_tokens_per_s": bins,
        "replicas": replicas,
    }


def run(args: argparse.Namespace) -> int:
    from raylane.bench.apps import LocalServe
    from raylane.config import ClusterConfig

    with LocalServe() as local:
        url = local.deploy({APP: ClusterConfig.from_dict(pool_config(args))})[APP]
        deadline = time.monotonic() + 300
        while replica_states()[0] < args.min_replicas:
            if time.monotonic() > deadline:
                raise SystemExit(f"the pool did not run {args.min_replicas} replicas within 300 s")
            time.sleep(1)
        streams, replicas = step(Target("raylane", (url,), "sim"), args)
    result = summarize(streams, replicas, args)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        write_json(
            args.out / "autoscale.json",
            client_result("autoscale", args, **result),
        )
        plot(result, args.out / "autoscale.png")
    print_result(result, args)
    return 0


def print_result(result: dict[str, Any], args: argparse.Namespace) -> None:
    print_table(
        [
            "replicas",
            "streams",
            "first starting",
            "first running",
            "all running",
            "90% of plateau",
            "plateau tok/s",
            "lost",
        ],
        [
            [
                f"{args.min_replicas} -> {args.max_replicas} (most {result['most_replicas']})",
                str(result["streams"]),
                seconds(result["first_replica_starting_s"]),
                seconds(result["first_new_replica_s"]),
                seconds(result["all_replicas_s"]),
                seconds(result["rate_at_90pct_of_plateau_s"]),
                f"{result['output_tokens_per_s_plateau']:.0f}",
                str(result["lost"]),
            ]
        ],
    )


def seconds(value: float | None) -> str:
    return "never" if value is None else f"{value:.0f} s"


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, left = plt.subplots(figsize=(8, 4))
    samples = result["replicas"]
    times = [t for t, _, _ in samples]
    left.step(times, [n for _, n, _ in samples], where="post", color="tab:blue", label="running replicas")
    left.step(
        times,
        [n + s for _, n, s in samples],
        where="post",
        color="tab:blue",
        linestyle=":",
        label="with starting",
    )
    left.set_xlabel("seconds since the step")
    left.set_ylabel("running replicas")
    right = left.twinx()
    rates = result["output_tokens_per_s"]
    right.plot(
        [(i + 0.5) * BIN_S for i in range(len(rates))], rates, color="tab:orange", label="output tokens/s"
    )
    right.set_ylabel("output tokens/s")
    fig.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
