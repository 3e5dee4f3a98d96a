"""`raylane bench serving-cpu`: where a served token's CPU time goes, process by process.

On a machine whose cores the engine's threads fill (two cores, `cpus_per_rank: 2`), every other
process's CPU time comes out of the decode steps about one for one: a step's threads wait at each
parallel region for whichever of them lost its core. This benchmark deploys `--config` in an
in-process Ray + Serve (`LocalServe`), streams `--requests` chat completions of `--max-tokens` tokens
(greedy, `ignore_eos`) through the gateway at each concurrency of `--streams`, and reads every
process's CPU time from /proc before and after each point: this process (the client, and the Ray
driver), Ray's daemons, Serve's controller and proxy, the gateway and pool replicas, the engine core.
Each row is milliseconds of CPU per output token, beside the point's TPOT and output tokens/s.
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from raylane.bench.common import client_machine, print_table, process_tree_cpu_by_name, write_json

SHOWN = 10  # processes in the table; the rest are summed as "others"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    arg = parser.add_argument
    arg("--config", type=Path, required=True, help="raylane cluster config YAML (its first pool is used)")
    arg("--streams", default="1,16", help="concurrencies, comma-separated")
    arg("--requests", type=int, default=16, help="requests per concurrency")
    arg("--max-tokens", type=int, default=128, help="output tokens of each request")
    arg("--out", type=Path, help="folder to write serving_cpu.json into")


def run(args: argparse.Namespace) -> int:
    import openai

    from raylane.bench.apps import LocalServe
    from raylane.config import ClusterConfig

    config = ClusterConfig.from_yaml(args.config)
    model = config.pools[0].name
    machine = client_machine()
    print(f"machine: {machine['cpu']}, {machine['cores']} cores, torch {machine['torch']}")
    with LocalServe() as local:
        client = openai.OpenAI(base_url=local.deploy({"a": config})["a"] + "/v1", api_key="bench")

        def one(i: int) -> tuple[float, int]:
            """(TPOT in seconds, output tokens) of one streamed request."""
            stream = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": f"Tell me a story, number {i}."}],
                max_tokens=args.max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            arrivals, tokens = [], 0
            for chunk in stream:
                arrivals.append(time.perf_counter())
                if chunk.usage:
                    tokens = chunk.usage.completion_tokens
            return (arrivals[-1] - arrivals[0]) / max(tokens - 1, 1), tokens

        for i in range(2):  # warm-up: the first requests load what a run loads once
            one(i)
        points = []
        for streams in (int(s) for s in args.streams.split(",")):
            before, started = process_tree_cpu_by_name(), time.perf_counter()
            with ThreadPoolExecutor(streams) as pool:
                results = list(pool.map(one, range(100, 100 + args.requests)))
            wall, after = time.perf_counter() - started, process_tree_cpu_by_name()
            tokens = sum(n for _, n in results)
            cpu = {name: s - before.get(name, 0.0) for name, s in after.items()}
            points.append(
                {
                    "streams": streams,
                    "requests": args.requests,
                    "output_tokens": tokens,
                    "tpot_p50_ms": 1000 * statistics.median(t for t, _ in results),
                    "output_tokens_per_s": tokens / wall,
                    "cpu_ms_per_token": {name: 1000 * s / tokens for name, s in cpu.items() if s > 0},
                }
            )
    for point in points:
        print(
            f"\n{point['streams']} streams: TPOT p50 {point['tpot_p50_ms']:.1f} ms, "
            f"{point['output_tokens_per_s']:.1f} output tokens/s, {point['output_tokens']} tokens"
        )
        ranked = sorted(point["cpu_ms_per_token"].items(), key=lambda kv: -kv[1])
        rows = [[name, f"{ms:.3f}"] for name, ms in ranked[:SHOWN]]
        rows.append([f"others ({max(len(ranked) - SHOWN, 0)})", f"{sum(ms for _, ms in ranked[SHOWN:]):.3f}"])
        rows.append(["all", f"{sum(point['cpu_ms_per_token'].values()):.3f}"])
        print_table(["process", "CPU ms per output token"], rows)
    if args.out:
        write_json(
            args.out / "serving_cpu.json",
            {
                "benchmark": "serving-cpu",
                "config": str(args.config),
                "client_machine": machine,
                "points": points,
            },
        )
        print(f"\nwrote {args.out / 'serving_cpu.json'}")
    return 0
