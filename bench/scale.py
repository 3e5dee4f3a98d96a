"""`raylane bench scale`: the routing layer at fleet scale, on simulated replicas (engine/sim/).

For each replica count, the same fleet of simulated engines (one hardware profile) is loaded through
each target in turn, point by point, the order rotating from one point to the next (where both
fleets do not fit in memory at once, as 64 replicas of each on a 24 GiB box, raylane's runs first and
the sim-servers' after it: `--phases`):
- `raylane`: Serve's proxy (or HAProxy with `--ingress haproxy`), the gateway, one pool of N
  simulated replicas with raylane's prefix-aware replica routing;
- `vllm-router:round_robin`, `vllm-router:cache_aware`: the Rust router in front of N
  `raylane sim-server` processes (the same engine, behind an HTTP server of its own);
- `direct`: the client spreads its streams over those servers itself: the engines' own latency.

A point is a closed loop of C streams (`--concurrency`) or Poisson arrivals (`--request-rate`) for
`--duration-s`, over a workload: `sharegpt` (ShareGPT's first turns, outputs capped at `--max-tokens`)
or `prefix` (many users behind a few long system prompts). Per point: output tokens/s, requests/s,
TTFT and TPOT p50/p99, the TTFT overhead above `direct`'s, the prefix-cache hit rate (cached prompt
tokens over prompt tokens, from the answers' usage), and the CPU each role spent per request and per
streamed token (Serve's proxy, the gateway, the pool replicas; vllm-router and the sim-servers; the
client). `--out DIR` writes scale.json and scale.png.

    raylane bench scale --replicas 1,4,16 --concurrency 16,64,256 --workload sharegpt,prefix --out results/
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from raylane.bench.common import client_result, print_table, pyplot, write_json
from raylane.bench.datasets import (
    BenchRequest,
    TokenCounter,
    prefix_requests,
    sharegpt_requests,
    unique_prompts,
)
from raylane.bench.fleet import (
    ROUTER_POLICIES,
    SimServers,
    VllmRouter,
    cpu_by_role,
    phases,
    raylane_config,
    role_cpu_since,
)
from raylane.bench.stream_load import Stream, Target, run_load

TARGETS = ("raylane", *(f"vllm-router:{p}" for p in ROUTER_POLICIES), "direct")
MODEL = "sim"  # what raylane's pool is called; the sim-servers answer to their profile's model id


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", default="llama-3.1-8b-l4", help="the simulated engine's profile")
    parser.add_argument(
        "--replicas", type=int_list, default=[1, 4, 16], help="replica counts to sweep (comma-separated)"
    )
    parser.add_argument(
        "--concurrency",
        type=int_list,
        default=[16, 64, 256],
        help="closed-loop streams to sweep (comma-separated)",
    )
    parser.add_argument(
        "--request-rate", type=lambda t: [float(x) for x in t.split(",") if x], default=[], help="Poisson"
    )
    parser.add_argument("--workload", default="sharegpt", help="sharegpt, prefix, or both (comma)")
    parser.add_argument("--targets", default=",".join(TARGETS), help=f"any of {', '.join(TARGETS)}")
    parser.add_argument("--duration-s", type=float, default=20.0, help="each point's sending window")
    parser.add_argument("--max-tokens", type=int, default=64, help="cap on each stream's output tokens")
    parser.add_argument("--num-prompts", type=int, default=2000, help="prompts drawn for each point")
    parser.add_argument("--system-prompts", type=int, default=8, help="the prefix workload's shared prompts")
    parser.add_argument(
        "--system-prompt-tokens",
        type=int,
        default=1000,
        help="tokens in each shared system prompt (prefix workload)",
    )
    parser.add_argument("--max-num-seqs", type=int, help="each engine's (default: the profile's)")
    parser.add_argument(
        "--ingress",
        choices=("proxy", "haproxy"),
        default="proxy",
        help="what raylane's fleet runs in front of the gateway",
    )
    parser.add_argument(
        "--phases",
        choices=("auto", "together", "apart"),
        default="auto",
        help="start raylane's fleet and the sim-servers' together (targets alternate point by point) "
        "or one after the other; auto: apart when both would not fit in this machine's memory",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the workload's sampling and Poisson arrivals"
    )
    parser.add_argument("--out", type=Path, help="folder for scale.json and scale.png")


def workload(name: str, args: argparse.Namespace, variant: int) -> list[BenchRequest]:
    """The workload's requests for one target at one point: every run gets prompts no fleet has seen
    (the sim-servers serve three targets in turn, and a cache warm from the last target's run would
    flatter the next): ShareGPT's first turns, each with a line naming the run and the request; or
    `--system-prompts` long system prompts of this run's own, each behind many users' questions."""
    counter = TokenCounter()
    if name == "sharegpt":
        requests = unique_prompts(sharegpt_requests(args.num_prompts, args.seed, counter), f"run {variant}")
    elif name == "prefix":
        per_prompt = max(1, args.num_prompts // args.system_prompts)
        seeds = range(variant * args.system_prompts, (variant + 1) * args.system_prompts)
        requests = [
            r
            for seed in seeds
            for r in prefix_requests(per_prompt, args.seed + seed, counter, args.system_prompt_tokens, 24, 0)
        ]
        random.Random(args.seed + variant).shuffle(requests)
    else:
        raise SystemExit(f"--workload: unknown {name!r} (sharegpt, prefix)")
    return [
        BenchRequest(r.messages, r.prompt_tokens, min(r.max_tokens or args.max_tokens, args.max_tokens))
        for r in requests
    ]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * (len(values) - 1) + 0.5))]


def summarize(streams: list[Stream], elapsed: float, cpu: dict[str, float]) -> dict[str, Any]:
    done = [s for s in streams if s.status == 200 and s.ttft is not None]
    tokens = sum(s.output_tokens for s in done)
    tpots = [(s.e2e - s.ttft) / (s.output_tokens - 1) for s in done if s.output_tokens > 1]
    ttfts = [s.ttft for s in done]
    statuses: dict[str, int] = {}
    for s in streams:
        statuses[str(s.status)] = statuses.get(str(s.status), 0) + 1
    prompt = sum(s.prompt_tokens for s in done)
    return {
        "requests": len(streams),
        "statuses": statuses,
        "output_tokens_per_s": tokens / elapsed,
        "requests_per_s": len(done) / elapsed,
        "ttft_p50_ms": 1000 * (percentile(ttfts, 0.5) or 0),
        "ttft_p99_ms": 1000 * (percentile(ttfts, 0.99) or 0),
        "tpot_p50_ms": 1000 * (percentile(tpots, 0.5) or 0),
        "tpot_p99_ms": 1000 * (percentile(tpots, 0.99) or 0),
        "prefix_hit_rate": sum(s.cached_tokens for s in done) / prompt if prompt else 0.0,
        "cpu_s": {k: round(v, 2) for k, v in cpu.items()},
        "cpu_ms_per_request": {k: round(1000 * v / max(1, len(done)), 2) for k, v in cpu.items()},
        "cpu_ms_per_token": {k: round(1000 * v / max(1, tokens), 3) for k, v in cpu.items()},
        "elapsed_s": round(elapsed, 2),
    }


def measure(
    target: Target, requests: list[BenchRequest], args, concurrency=None, rate=None
) -> dict[str, Any]:
    before = cpu_by_role()
    streams, elapsed = asyncio.run(
        run_load(target, requests, args.duration_s, concurrency=concurrency, rate=rate, seed=args.seed)
    )
    return summarize(streams, elapsed, role_cpu_since(before))


def fleet_targets(stack: ExitStack, args, replicas: int, wanted: list[str]) -> dict[str, Target]:
    """Start what `wanted` needs for `replicas` engines; name -> where to send."""
    from raylane.bench.apps import LocalServe
    from raylane.config import ClusterConfig

    targets: dict[str, Target] = {}
    if "raylane" in wanted:
        local = stack.enter_context(LocalServe(ingress=args.ingress))
        config = raylane_config(args.profile, replicas, args.max_num_seqs, args.ingress)
        url = local.deploy({f"scale{replicas}": ClusterConfig.from_dict(config)})[f"scale{replicas}"]
        targets["raylane"] = Target("raylane", (url,), MODEL)
    if any(t != "raylane" for t in wanted):
        servers = stack.enter_context(SimServers(args.profile, replicas, args.max_num_seqs))
        model = model_id(servers.urls[0])
        for policy in ROUTER_POLICIES:
            if f"vllm-router:{policy}" in wanted:
                router = stack.enter_context(VllmRouter(policy, servers.urls))
                targets[f"vllm-router:{policy}"] = Target(f"vllm-router:{policy}", (router.url,), model)
        if "direct" in wanted:
            targets["direct"] = Target("direct", tuple(servers.urls), model)
    return targets


def model_id(url: str) -> str:
    import httpx2

    return httpx2.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]


def run(args: argparse.Namespace) -> int:
    wanted = [t for t in args.targets.split(",") if t]
    if unknown := set(wanted) - set(TARGETS):
        raise SystemExit(f"--targets: unknown {sorted(unknown)}")
    workloads = [name for name in args.workload.split(",") if name]
    variant = itertools.count()
    points = [("concurrency", c) for c in args.concurrency] + [("rate", r) for r in args.request_rate]
    rows: dict[
        tuple, dict[str, dict[str, Any]]
    ] = {}  # (replicas, workload, kind, value) -> target -> summary
    for replicas in args.replicas:
        for group in phases(wanted, replicas, args.phases):
            with ExitStack() as stack:
                print(f"== {replicas} replicas: starting {', '.join(group)}", flush=True)
                targets = fleet_targets(stack, args, replicas, group)
                for name in workloads:
                    for i, (kind, value) in enumerate(points):
                        order = group[i % len(group) :] + group[: i % len(group)]  # rotates per point
                        row = rows.setdefault((replicas, name, kind, value), {})
                        for target in order:
                            load = {"concurrency": value} if kind == "concurrency" else {"rate": value}
                            requests = workload(name, args, next(variant))
                            row[target] = measure(targets[target], requests, args, **load)
                            print_point(replicas, name, kind, value, target, row[target])
    results = []
    for (replicas, name, kind, value), row in rows.items():
        add_overheads(row)
        results.append({"replicas": replicas, "workload": name, kind: value, "targets": row})
    print_summary(results)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        write_json(
            args.out / "scale.json",
            client_result("scale", args, points=results),
        )
        plot(results, args.out / "scale.png")
    return 0


def add_overheads(row: dict[str, dict[str, Any]]) -> None:
    """Each target's TTFT p50 and p99 above `direct`'s (the engines' own), where `direct` ran."""
    if "direct" not in row:
        return
    for summary in row.values():
        summary["ttft_p50_overhead_ms"] = summary["ttft_p50_ms"] - row["direct"]["ttft_p50_ms"]
        summary["ttft_p99_overhead_ms"] = summary["ttft_p99_ms"] - row["direct"]["ttft_p99_ms"]


def print_point(replicas, workload_name, kind, value, target, s) -> None:
    print(
        f"{replicas:>3} replicas {workload_name:<8} {kind} {value:<6} {target:<24} "
        f"{s['output_tokens_per_s']:>8.0f} tok/s  TTFT p50 {s['ttft_p50_ms']:>7.0f} ms "
        f"p99 {s['ttft_p99_ms']:>7.0f}  "
        f"TPOT p50 {s['tpot_p50_ms']:>6.1f} ms  hit {s['prefix_hit_rate']:.2f}  {s['statuses']}",
        flush=True,
    )


def print_summary(results: list[dict[str, Any]]) -> None:
    headers = [
        "replicas",
        "workload",
        "load",
        "target",
        "tok/s",
        "req/s",
        "TTFT p50",
        "p99",
        "over p50",
        "TPOT p50",
        "hit",
        "CPU ms/token (where)",
    ]
    rows = []
    for point in results:
        load = f"c={point['concurrency']}" if "concurrency" in point else f"r={point['rate']}/s"
        for target, s in point["targets"].items():
            where = " ".join(f"{k}={v:.2f}" for k, v in sorted(s["cpu_ms_per_token"].items()) if v >= 0.01)
            rows.append(
                [
                    str(point["replicas"]),
                    point["workload"],
                    load,
                    target,
                    f"{s['output_tokens_per_s']:.0f}",
                    f"{s['requests_per_s']:.1f}",
                    f"{s['ttft_p50_ms']:.0f}",
                    f"{s['ttft_p99_ms']:.0f}",
                    f"{s.get('ttft_p50_overhead_ms', float('nan')):.0f}",
                    f"{s['tpot_p50_ms']:.1f}",
                    f"{s['prefix_hit_rate']:.2f}",
                    where,
                ]
            )
    print_table(headers, rows)


def plot(results: list[dict[str, Any]], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    keys = sorted({(p["replicas"], p["workload"]) for p in results if "concurrency" in p})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for replicas, name in keys:
        points = [
            p for p in results if p["replicas"] == replicas and p["workload"] == name and "concurrency" in p
        ]
        for target in points[0]["targets"]:
            xs = [p["concurrency"] for p in points]
            label = f"{target}, {replicas} replicas, {name}"
            axes[0].plot(
                xs, [p["targets"][target]["output_tokens_per_s"] for p in points], marker="o", label=label
            )
            axes[1].plot(xs, [p["targets"][target]["ttft_p50_ms"] for p in points], marker="o", label=label)
    for ax, title in zip(axes, ("output tokens/s", "TTFT p50 (ms)"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_title(title)
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")
