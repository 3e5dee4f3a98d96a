"""`raylane bench parallel`: what a tensor- or expert-parallel worker group costs per step, and what
it saves in memory per rank.

For a dense and an MoE checkpoint (the demo models by default) it builds the batches the engine
sends for `--batch-size` requests: one prefill, then `--decode-steps` decode steps. Every layout
runs exactly those batches on its own executor (same tokens, positions, block tables), so the
layouts differ only in where the model runs. Per decode step it reports the driver's wall time,
the part spent in collectives (all-reduce / all-gather inside the ranks) and in the step
broadcast (the driver's time beyond rank 0's own `execute_model`: sending the batch, returning
logits), and per rank the parameter bytes, the anonymous memory that loading added and the
peak RSS. bench/PARALLEL.md explains
the numbers.
"""

import argparse
import datetime
import os
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raylane.bench.common import OtherLoad, machine_info, print_table, pyplot, write_json

MiB = 2**20
BLOCK_SIZE = 16


@dataclass(slots=True)
class Layout:
    label: str
    tp: int = 1
    ep: int = 1
    backend: str = "ray"  # "uni": in-process
    compiled_graph: bool = True

    @property
    def world(self) -> int:
        return self.tp * self.ep


def layouts(kind: str, tp: int, ep: int) -> list[Layout]:
    if kind == "dense":
        return [
            Layout("in-process", backend="uni"),
            Layout("TP=1, 1 Ray actor"),
            Layout(f"TP={tp}", tp=tp),
            Layout(f"TP={tp}, actor calls", tp=tp, compiled_graph=False),
        ]
    return [
        Layout("in-process", backend="uni"),
        Layout(f"EP={ep}", ep=ep),
        Layout(f"TP={tp}", tp=tp),
    ]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from raylane.models.demo import default_demo_dir

    parser.add_argument("--dense-model", help="dense checkpoint (default: the demo Llama, created if needed)")
    parser.add_argument("--moe-model", help="MoE checkpoint (default: the demo Qwen3-MoE, created if needed)")
    parser.add_argument(
        "--demo-dir", type=Path, default=default_demo_dir(), help="where the demo models live"
    )
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size compared with 1")
    parser.add_argument("--ep", type=int, default=2, help="expert-parallel size compared with 1")
    parser.add_argument("--batch-size", type=int, default=8, help="requests decoding together")
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--decode-steps", type=int, default=32, help="decode steps timed per repeat")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per setting")
    parser.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="where the ranks run (auto: CUDA when there is a GPU)",
    )
    parser.add_argument(
        "--cpus-per-rank", type=float, help="Ray CPUs (and CPU threads) per rank; default: cores / ranks"
    )
    parser.add_argument(
        "--skip-single",
        action="store_true",
        help="skip the one-rank layouts (a model that needs several GPUs)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompts")
    parser.add_argument("--out", type=Path, help="write parallel.json and parallel.png here")


def make_batches(vocab_size: int, args: argparse.Namespace) -> tuple[list, list, int]:
    """(prefill batches, decode batches, KV blocks needed): what the engine's scheduler would send for
    `batch_size` requests of `prompt_len` random tokens decoding together (one prefill step, then one
    token per request per step). Built directly: no single process has to hold the model to record them."""
    from raylane.engine.model_runner import ModelInput

    rng = random.Random(args.seed)
    n, length, block = args.batch_size, args.prompt_len, BLOCK_SIZE
    per_request = -(-(length + args.decode_steps + 1) // block)
    tables = [list(range(i * per_request, (i + 1) * per_request)) for i in range(n)]
    prefill = ModelInput(
        token_ids=[rng.randrange(3, vocab_size) for _ in range(n * length)],
        positions=list(range(length)) * n,
        block_tables=tables,
        context_lens=[length] * n,
        query_lens=[length] * n,
        sample_indices=[(i + 1) * length - 1 for i in range(n)],
    )
    decode = [
        ModelInput(
            token_ids=[rng.randrange(3, vocab_size) for _ in range(n)],
            positions=[length + k] * n,
            block_tables=tables,
            context_lens=[length + k + 1] * n,
            query_lens=[1] * n,
            sample_indices=list(range(n)),
        )
        for k in range(args.decode_steps)
    ]
    return [prefill], decode, n * per_request


def measure(model: str, layout: Layout, batches: tuple[list, list, int], args) -> dict:
    import torch

    from raylane.config import EngineConfig
    from raylane.engine.executor import UniProcExecutor
    from raylane.engine.executor.ray_distributed import RayDistributedExecutor

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    prefill, decode, num_kv_blocks = batches
    config = EngineConfig(
        model=model,
        block_size=BLOCK_SIZE,
        num_kv_blocks=num_kv_blocks,
        device=args.device,
        tensor_parallel_size=layout.tp,
        expert_parallel_size=layout.ep,
        distributed_executor_backend=layout.backend,
        cpus_per_rank=args.cpus_per_rank or max(1, cores // layout.world),
    )
    start = time.perf_counter()
    if layout.backend == "uni":
        torch.set_num_threads(max(1, int(config.cpus_per_rank)))  # as a CPU rank actor does
        executor = UniProcExecutor(config)
    else:
        executor = RayDistributedExecutor(config, compiled_graph=layout.compiled_graph)
    startup_s = time.perf_counter() - start
    try:
        step_s, rank_stats = [], []
        with OtherLoad() as load:
            for _ in range(args.repeats):
                for batch in prefill + decode[:3]:  # prefill, then warm-up decode steps
                    executor.execute_model(batch)
                if layout.backend == "ray":
                    executor.rank_stats(reset=True)
                for batch in decode[3:]:
                    t = time.perf_counter()
                    executor.execute_model(batch)
                    step_s.append(time.perf_counter() - t)
                if layout.backend == "ray":
                    rank_stats.append(sorted(executor.rank_stats(reset=True), key=lambda r: r["rank"]))
        memory = memory_per_rank(executor)
    finally:
        executor.shutdown()
    return summarize(layout, step_s, rank_stats, memory, startup_s, load.fraction or 0.0)


def memory_per_rank(executor) -> list[dict]:
    if hasattr(executor, "rank_info"):
        return [
            {k: info[k] for k in ("weight_bytes", "load_anon_bytes", "peak_rss_bytes")}
            for info in executor.rank_info
        ]
    return [{"weight_bytes": executor.runner.weight_bytes(), "load_anon_bytes": None, "peak_rss_bytes": None}]


def summarize(layout: Layout, step_s, rank_stats, memory, startup_s: float, other_load: float) -> dict:
    """Medians over steps; per step, collectives = the ranks' mean time in them, broadcast = the
    driver's wall time beyond rank 0's own execute_model (sending the batch, returning logits)."""
    collective_s = broadcast_s = [0.0] * len(step_s)
    if rank_stats:  # one list per repeat, each with one entry per rank, aligned with step_s
        rank0 = [t for repeat in rank_stats for t in repeat[0]["execute_s"]]
        per_rank = [
            [t for repeat in rank_stats for t in repeat[r]["collective_s"]] for r in range(layout.world)
        ]
        collective_s = [statistics.mean(ts) for ts in zip(*per_rank, strict=True)]
        broadcast_s = [d - r for d, r in zip(step_s, rank0, strict=True)]
    return {
        "layout": layout.label,
        "tp": layout.tp,
        "ep": layout.ep,
        "backend": layout.backend,
        "compiled_graph": layout.compiled_graph,
        "steps": len(step_s),
        "step_ms": 1e3 * statistics.median(step_s),
        "step_ms_mean": 1e3 * statistics.mean(step_s),
        "collective_ms": 1e3 * statistics.median(collective_s),
        "broadcast_ms": 1e3 * statistics.median(broadcast_s),
        "memory": memory,
        "startup_s": startup_s,
        "other_load": other_load,
    }


def mib(value) -> str:
    return "-" if value is None else f"{value / MiB:.1f}"


def print_report(result: dict[str, Any]) -> None:
    rows = []
    for name, model in result["models"].items():
        for r in model["layouts"]:
            step = r["step_ms"]
            worst = max(r["memory"], key=lambda m: m["weight_bytes"])
            rows.append(
                [
                    f"{name} {r['layout']}",
                    str(r["tp"] * r["ep"]),
                    f"{step:.2f}",
                    f"{r['collective_ms']:.2f} ({100 * r['collective_ms'] / step:.0f}%)",
                    f"{r['broadcast_ms']:.2f} ({100 * r['broadcast_ms'] / step:.0f}%)",
                    mib(worst["weight_bytes"]),
                    mib(worst["load_anon_bytes"]),
                    mib(worst["peak_rss_bytes"]),
                    f"{r['startup_s']:.1f}",
                    f"{100 * r['other_load']:.0f}%",
                ]
            )
    w = result["workload"]
    print(
        f"Decode step of {w['batch_size']} requests ({w['prompt_len']}-token prompts), median of "
        f"{w['timed_steps']} steps x {w['repeats']} repeats; memory: the largest rank"
    )
    print_table(
        [
            "model / layout",
            "ranks",
            "step ms",
            "collectives ms",
            "broadcast ms",
            "weights MiB/rank",
            "load anon MiB",
            "peak RSS MiB",
            "start s",
            "other load",
        ],
        rows,
    )
    load = max(r["other_load"] for m in result["models"].values() for r in m["layouts"])
    print(
        f"other processes used up to {100 * load:.0f}% of the CPUs during the runs"
        + (": numbers are unreliable, rerun on a quiet machine" if load > 0.1 else "")
    )


def write_plot(path: Path, result: dict[str, Any]) -> None:
    plt = pyplot()
    labels, compute, collectives, broadcast = [], [], [], []
    for name, model in result["models"].items():
        for r in model["layouts"]:
            labels.append(f"{name}\n{r['layout']}")
            collectives.append(r["collective_ms"])
            broadcast.append(r["broadcast_ms"])
            compute.append(r["step_ms"] - r["collective_ms"] - r["broadcast_ms"])
    fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(labels)), 4.5))
    x = range(len(labels))
    ax.bar(x, compute, label="compute (rest of rank 0's step)", color="#1f77b4")
    ax.bar(x, collectives, bottom=compute, label="collectives", color="#ff7f0e")
    tops = [c + k for c, k in zip(compute, collectives, strict=True)]
    ax.bar(x, broadcast, bottom=tops, label="step broadcast + logits return", color="#2ca02c")
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("ms per decode step")
    machine = result["machine"]
    ax.set_title(f"Per-step time by layout: {machine['cpu']}, {machine['cores']} cores")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    import ray
    from transformers import AutoConfig

    from raylane.models.demo import LLAMA, QWEN3_MOE, create_demo_models

    demo = create_demo_models(args.demo_dir) if not (args.dense_model and args.moe_model) else {}
    models = {
        "dense": args.dense_model or str(demo[LLAMA]),
        "moe": args.moe_model or str(demo[QWEN3_MOE]),
    }
    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    machine = machine_info()
    print(f"machine: {machine['cpu']}, {machine['cores']} cores, torch {machine['torch']}")
    result: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "machine": machine,
        "workload": {
            "batch_size": args.batch_size,
            "prompt_len": args.prompt_len,
            "timed_steps": max(0, args.decode_steps - 3),
            "repeats": args.repeats,
        },
        "models": {},
    }
    for kind, path in models.items():
        print(f"{kind}: {path}")
        batches = make_batches(AutoConfig.from_pretrained(path).vocab_size, args)
        chosen = [lo for lo in layouts(kind, args.tp, args.ep) if not (args.skip_single and lo.world == 1)]
        runs = [measure(path, layout, batches, args) for layout in chosen]
        result["models"][kind] = {"path": path, "layouts": runs}
    print()
    print_report(result)
    if args.out:
        write_json(args.out / "parallel.json", result)
        write_plot(args.out / "parallel.png", result)
        print(f"\nwrote {args.out / 'parallel.json'} and {args.out / 'parallel.png'}")
    return 0
