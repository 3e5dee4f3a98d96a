"""`raylane bench linears`: torch's CPU matmul (`F.linear`) against oneDNN on a prepacked weight
(`parallel/onednn.py`, what `engine.cpu_weight_prepack` turns on), for the linears of one layer of the
engine benchmark's model, at the token counts of decode and prefill steps.

Each row times the layer's four linears (qkv, o, gate_up, down) over `--layers` copies of the
weights, so the weights come from memory as in a model, not from cache; the two sides alternate.

`--int4` instead compares, per linear shape of SmolLM2-135M (and its 49,152-row LM head) and per
token count, every weight form the engine can hold: oneDNN-prepacked float32 and bfloat16, int8
(`int8_linear`), and int4 both through its kernel (raylane's, or torch's where that cannot run)
and dequantized then multiplied (`parallel/int4.py`); the last column is the path `int4_linear`
takes at that size, so the table is what sets `DENSE_MIN_TOKENS`.
"""

import argparse
import statistics
from pathlib import Path
from typing import Any

from raylane.bench.common import OtherLoad, machine_info, print_table, timed, write_json

# (in, out) of one layer of bench/engine.py's raylane-bench-llama-50m
SHAPES = [(512, 1024), (512, 512), (512, 3584), (1792, 512)]
# (in, out) of SmolLM2-135M's linears (q and o; k and v; gate and up; down) and its tied LM head
SMOLLM2_SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152)]
INT4_SIDES = ("fp32", "bf16", "int8", "int4 kernel", "int4 dense")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    arg = parser.add_argument
    arg("--tokens", default="1,4,16,64,256", help="rows of the activations (tokens in a step)")
    arg("--layers", type=int, default=12, help="copies of the layer's weights")
    arg("--dtype", choices=("float32", "bfloat16"), default="float32", help="the weights' dtype")
    arg("--repeats", type=int, default=20, help="timed runs per shape")
    arg("--threads", type=int, help="torch threads (default: torch's, one per core)")
    arg("--out", type=Path, help="folder to write linears.json into")
    arg("--int4", action="store_true", help="SmolLM2's shapes: fp32, bf16, int8 and int4 per shape")
    arg(
        "--stat",
        choices=("median", "min"),
        default="median",
        help="per-call figure; min where other processes share the cores (it drops their stalls)",
    )


def run(args: argparse.Namespace) -> int:
    import torch
    import torch.nn.functional as F

    from raylane.parallel import onednn

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.int4:
        return run_int4(args)
    dtype = getattr(torch, args.dtype)
    if not onednn.available(dtype):
        print(f"oneDNN's packed linear is not available for {args.dtype} in this torch build")
        return 1
    machine = machine_info()
    print(
        f"machine: {machine['cpu']}, {machine['cores']} cores, torch {machine['torch']}, "
        f"{machine['torch_threads']} threads; {args.layers} layers of {SHAPES} (in, out), {args.dtype}; "
        f"ms for all {args.layers} layers, {args.stat} of {args.repeats}"
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
            stat = min if args.stat == "min" else statistics.median
            rows.append({"tokens": m, **{f"{name}_ms": stat(v) for name, v in ms.items()}})
    table = []
    for r in rows:
        speedup = r["torch_ms"] / r["onednn_ms"]
        table.append([r["tokens"], f"{r['torch_ms']:.2f}", f"{r['onednn_ms']:.2f}", f"{speedup:.1f}x"])
    print_table(["tokens", "torch F.linear ms", "oneDNN packed ms", "speedup"], table)
    print(f"other processes used {100 * (load.fraction or 0):.0f}% of the CPUs")
    if args.out:
        settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "func"}
        result = {"machine": machine, "args": settings, "other_load": load.fraction, "rows": rows}
        write_json(args.out / "linears.json", result)
    return 0


def int4_sides(in_features: int, out_features: int, copies: int, g) -> dict[str, Any]:
    """For each side, a function of x (float32) that runs one linear of this shape on every copy."""
    import torch

    from raylane.parallel import onednn
    from raylane.parallel.int4 import Int4Weight, int4_linear
    from raylane.parallel.quantization import int8_linear, quantize_int8

    dense = [torch.randn(out_features, in_features, generator=g) * 0.05 for _ in range(copies)]
    fp32 = [onednn.pack(w) for w in dense]
    bf16 = [onednn.pack(w.bfloat16()) for w in dense]
    int8 = [quantize_int8(w) for w in dense]
    int4 = [Int4Weight(w) for w in dense]
    del dense
    return {
        "fp32": lambda x: [onednn.linear(x, w) for w in fp32],
        "bf16": lambda x: [onednn.linear(x.bfloat16(), w).float() for w in bf16],
        "int8": lambda x: [int8_linear(x, q, s) for q, s in int8],
        "int4 kernel": lambda x: [int4_linear(x, w, dense_min_tokens=1 << 30) for w in int4],
        "int4 dense": lambda x: [int4_linear(x, w, dense_min_tokens=0) for w in int4],
    }


def run_int4(args: argparse.Namespace) -> int:
    import torch

    from raylane.parallel import onednn
    from raylane.parallel.int4 import DENSE_MIN_TOKENS, kernel_available

    if not (kernel_available() and onednn.available(torch.float32) and onednn.available(torch.bfloat16)):
        print("torch's CPU int4 kernel or oneDNN's packed linear is missing in this torch build")
        return 1
    machine = machine_info()
    print(
        f"machine: {machine['cpu']}, {machine['cores']} cores, torch {machine['torch']}, "
        f"{machine['torch_threads']} threads, CPU capability {torch.backends.cpu.get_cpu_capability()}; "
        f"ms per linear call, {args.stat} of {args.repeats}; {args.layers} copies of each weight "
        "(1 of the LM head), so weights come from memory"
    )
    g = torch.Generator().manual_seed(0)
    rows: list[dict[str, Any]] = []
    with OtherLoad() as load:
        for in_features, out_features in SMOLLM2_SHAPES:
            copies = 1 if out_features > 8192 else args.layers
            sides = int4_sides(in_features, out_features, copies, g)
            for m in (int(t) for t in args.tokens.split(",")):
                x = torch.randn(m, in_features, generator=g)
                ms: dict[str, list[float]] = {name: [] for name in sides}
                for i in range(args.repeats + 2):  # two warm-up rounds; sides alternate
                    for name, side in sides.items():
                        seconds = timed(lambda side=side, x=x: side(x))[0]
                        if i >= 2:
                            ms[name].append(seconds * 1e3 / copies)
                row = {"shape": f"{out_features}x{in_features}", "tokens": m}
                stat = min if args.stat == "min" else statistics.median
                rows.append(row | {name: stat(v) for name, v in ms.items()})
                print(f"{row['shape']} x {m} tokens done", flush=True)
            del sides
    table = []
    for r in rows:
        path = "int4 dense" if r["tokens"] >= DENSE_MIN_TOKENS else "int4 kernel"
        best = min(INT4_SIDES, key=lambda name: r[name])
        table.append([r["shape"], r["tokens"], *(f"{r[name]:.3f}" for name in INT4_SIDES), best, path])
    headers = ["out x in", "tokens", *(f"{name} ms" for name in INT4_SIDES), "fastest", "int4 takes"]
    print_table(headers, table)
    print(f"other processes used {100 * (load.fraction or 0):.0f}% of the CPUs")
    if args.out:
        settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "func"}
        result = {"machine": machine, "args": settings, "other_load": load.fraction, "rows": rows}
        write_json(args.out / "linears_int4.json", result)
    return 0
