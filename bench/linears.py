"""`raylane bench linears`: torch's CPU matmul (`F.linear`) against oneDNN on a prepacked weight
(`parallel/onednn.py`, what `engine.cpu_weight_prepack` turns on), for the linears of one layer of the
engine benchmark's model, at the token counts of decode and prefill steps.

Each row times the layer's four linears (qkv, o, gate_up, down) over `--layers` copies of the
weights, so the weights come from memory as in a model, not from cache; the two sides alternate.
"""

import argparse
import statistics
from pathlib import Path
from typing import Any

from bench.common import OtherLoad, machine_info, print_table, timed, write_json

# (in, out) of one layer of bench/engine.py's raylane-bench-llama-50m
SHAPES = [(512, 1024), (512, 512), (512, 3584), (1792, 512)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    arg = parser.add_argument
    arg("--tokens", default="1,4,16,64,256", help="rows of the activations (tokens in a step)")
    arg("--layers", type=int, default=12, help="copies of the layer's weights")
    arg("--dtype", choices=("float32", "bfloat16"), default="float32")
    arg("--repeats", type=int, default=20)
    arg("--threads", type=int, help="torch threads (default: torch's, one per core)")
    arg("--out", type=Path, help="folder to write linears.json into")


def run(args: argparse.Namespace) -> int:
    import torch
    import torch.nn.functional as F

    from parallel import onednn

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    if not onednn.available(dtype):
        print(f"oneDNN's packed linear is not available for {args.dtype} in this torch build")
        return 1
    machine = machine_info()
    print(
        f"machine: {machine['cpu']}, {machine['cores']} cores, torch {machine['torch']}, "
        f"{machine['torch_threads']} threads; {args.layers} layers of {SHAPES} (in, out), {args.dtype}"
    )
    g = torch.Generator().manual_seed(0)
    dense = [[torch.randn(n, k, generator=g).to(dtype) for k, n in SHAPES] for _ in range(args.layers)]
    packed = [[onednn.pack(w) for w in layer] for layer in dense]

    def torch_side(xs: list) -> None:
        for layer in dense:
            for x, w in zip(xs, layer, strict=True):
                F.linear(x, w)

    def onednn_side(xs: list) -> None:
        for layer in packed:
            for x, w in zip(xs, layer, strict=True):
                onednn.linear(x, w)

    rows: list[dict[str, Any]] = []
    with OtherLoad() as load:
        for m in (int(t) for t in args.tokens.split(",")):
            xs = [torch.randn(m, k, generator=g).to(dtype) for k, _ in SHAPES]
            ms: dict[str, list[float]] = {"torch": [], "onednn": []}
            for i in range(args.repeats + 2):  # two warm-up rounds
                for name, side in (("torch", torch_side), ("onednn", onednn_side)):
                    seconds = timed(lambda side=side, xs=xs: side(xs))[0]
                    if i >= 2:
                        ms[name].append(seconds * 1e3)
            rows.append({"tokens": m, **{f"{name}_ms": statistics.median(v) for name, v in ms.items()}})
    table = []
    for r in rows:
        speedup = r["torch_ms"] / r["onednn_ms"]
        table.append([r["tokens"], f"{r['torch_ms']:.2f}", f"{r['onednn_ms']:.2f}", f"{speedup:.1f}x"])
    print_table(["tokens", "torch F.linear ms", "oneDNN packed ms", "speedup"], table)
    print(f"other processes used {100 * (load.fraction or 0):.0f}% of the CPUs")
    if args.out:
        settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "func"}
        write_json(args.out / "linears.json", {"machine": machine, "args": settings, "rows": rows})
    return 0
