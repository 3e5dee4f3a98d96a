"""`raylane bench decode-profile`: where a decode step's time goes, against what the machine allows.

The real model (SmolLM2-135M-Instruct from its packaged GGUF) in an in-process `LLM`, for each weight
form (`--quantization`, float32 = none) and each batch (`--streams`): that many requests are prefilled
to `--context` tokens, then `--steps` decode steps are timed, and as many again run under torch's
profiler. Each row sets the measured step beside two floors:

- **bandwidth floor**: bytes the step must read (every weight once, as the engine holds it, plus the
  K/V of every row's context) / the memory bandwidth a large tensor copy reaches here;
- **compute floor**: the step's multiply-adds (2 x weights x rows, plus attention over the context)
  / the float32 GEMM rate a large matmul reaches here.

A step cannot be faster than the larger floor; the profile says what the rest is. Op classes add the
profiler's self CPU time of each aten op by what it does (`OP_CLASSES`); under `--modes compiled`,
`compiled` is the time in inductor's fused kernels (a compiled graph's own time, less the aten ops it
calls, such as the matmuls); `python and other` is the step's wall time less every op's: the
interpreter between ops, the scheduler and sampling in Python, dynamo's guards, and waits.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import time
from pathlib import Path
from typing import Any

from raylane.bench.common import machine_info, print_table, timed, write_json

MODEL = "smollm2-135m-instruct"
# aten op name fragment -> class; the first match wins (so `linear` ops are counted as matmul).
OP_CLASSES = (
    ("compiled", ("compiledfxgraph",)),  # inductor's fused kernels (the self time of a compiled graph's call)
    (
        "matmul",
        ("linear", "addmm", "mm", "matmul", "int4pack", "int8pack", "gemv", "mkldnn", "onednn", "baddbmm"),
    ),
    ("attention", ("attention", "paged_decode", "softmax", "bmm")),
    ("norm", ("rms_norm", "layer_norm", "rsqrt", "pow", "mean")),
    ("gather/copy", ("index", "embedding", "gather", "copy_", "cat", "stack", "clone", "contiguous", "to")),
    ("elementwise", ("mul", "add", "sub", "div", "silu", "neg", "sigmoid", "exp", "where", "masked")),
    ("sampling", ("argmax", "topk", "sort", "multinomial", "max", "cumsum")),
)
CLASS_NAMES = [name for name, _ in OP_CLASSES] + ["other ops"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    arg = parser.add_argument
    arg("--quantization", default="none,int8,int4", help="weight forms, comma-separated (none = float32)")
    arg("--streams", default="1,16", help="decode batch sizes, comma-separated")
    arg("--context", type=int, default=128, help="prompt tokens of each request")
    arg("--steps", type=int, default=30, help="decode steps timed (as many again are profiled)")
    arg(
        "--modes",
        default="eager",
        help="comma-separated: eager, and/or compiled (torch_compile: true, plus cpu_batch_weight_copy: "
        "true for int8/int4)",
    )
    arg(
        "--attention",
        default="auto",
        help="comma-separated attention backends (engine.attention_backend): auto, torch, cpu_paged",
    )
    arg("--kv-cache-dtype", default="auto", help="comma-separated: auto (the model's dtype) and/or bfloat16")
    arg("--threads", type=int, help="torch threads (default: torch's, one per core)")
    arg("--out", type=Path, help="folder to write decode_profile.json into")


def op_class(name: str) -> str:
    lowered = name.lower().removeprefix("aten::")
    for cls, fragments in OP_CLASSES:
        if any(f in lowered for f in fragments):
            return cls
    return "other ops"


def memory_bandwidth_gbs(mib: int = 256, repeats: int = 5) -> float:
    """Bytes moved per second by copying a tensor far larger than the caches (read + write)."""
    import torch

    src = torch.ones(mib << 18)  # float32: 4 bytes each
    dst = torch.empty_like(src)
    seconds = min(timed(lambda: dst.copy_(src))[0] for _ in range(repeats))
    return 2 * src.nbytes / seconds / 1e9


def gemm_gflops(size: int = 1024, repeats: int = 5) -> float:
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    seconds = min(timed(lambda: a @ b)[0] for _ in range(repeats))
    return 2 * size**3 / seconds / 1e9


def model_figures(llm) -> dict[str, float]:
    """Bytes of the weights a decode step reads, as the engine holds them; the number of weights the
    linears and LM head multiply by; the shape numbers attention needs.

    Every tensor a module keeps (parameters, buffers, and the plain attributes where prepacked oneDNN
    weights live), less: the KV cache (counted per row of context), the embedding table (a step reads
    one row of it per token) unless the LM head multiplies by that same tensor, and an int4 weight's
    row-major codes where torch's int4 kernel has its packed copy (decode reads the packed one)."""
    import torch

    from raylane.parallel.int4 import Int4Weight
    from raylane.parallel.layers import ParallelLMHead, VocabParallelEmbedding

    model = llm.engine.runner.model

    def held(module) -> dict[str, torch.Tensor]:
        # A batch copy (`cpu_batch_weight_copy`) is read instead of the 4 or 8 bits, by batched steps
        # only: the floor stays the quantized weights'.
        values = {**module._parameters, **module._buffers, **vars(module)}
        skip = ("cache", "batch_weight")
        return {
            k: v for k, v in values.items() if isinstance(v, torch.Tensor) and not any(w in k for w in skip)
        }

    tensors: dict[int, torch.Tensor] = {}
    skipped: set[int] = set()
    table: set[int] = set()
    for m in model.modules():
        own = held(m)
        tensors |= {id(t): t for t in own.values()}
        if isinstance(m, Int4Weight) and m.kernel is not None:  # decode reads the kernel's tensors only
            skipped |= {id(m.scale), id(m.minimum)} | ({id(m.rows)} if m.kernel == "torch" else set())
        if type(m) is VocabParallelEmbedding:
            table |= {id(t) for t in own.values()}
    for m in model.modules():
        if isinstance(m, ParallelLMHead) and all(id(t) in table for t in held(m).values()):
            table -= {id(t) for t in held(m).values()}  # a tied head without a copy of its own
    weight_bytes = sum(t.numel() * t.element_size() for k, t in tensors.items() if k not in skipped | table)
    config = llm.engine.hf_config
    hidden, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    per_layer = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * inter
    return {
        "weight_bytes": weight_bytes,
        "matmul_weights": layers * per_layer + hidden * config.vocab_size,
        "layers": layers,
        "kv_width": 2 * kv_heads * head_dim,
        "q_width": heads * head_dim,
        "kv_element_bytes": llm.engine.runner.kv_dtype.itemsize,
    }


def decode_batch(llm, streams: int, context: int, steps: int, seed: int = 0) -> list[str]:
    """`streams` requests prefilled to `context` tokens, with room to decode `steps` more."""
    from raylane.engine import SamplingParams
    from raylane.engine.sampling_params import RequestOutputKind

    engine = llm.engine
    rng = random.Random(seed)
    params = SamplingParams(
        temperature=0, max_tokens=steps + 8, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
    )
    ids = [
        engine.add_request([rng.randrange(100, engine.vocab_size) for _ in range(context)], params)
        for _ in range(streams)
    ]
    scheduler = engine.scheduler
    while len(scheduler.waiting) or any(r.num_computed_tokens < context for r in scheduler.running):
        engine.step()
    return ids


def measure(llm, streams: int, args: argparse.Namespace, figures: dict, machine: dict) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    engine = llm.engine
    ids = decode_batch(llm, streams, args.context, 2 * args.steps + 4)
    try:
        for _ in range(2):  # warm-up
            engine.step()
        step_ms = [timed(engine.step)[0] * 1e3 for _ in range(args.steps)]
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            started = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            profiled_ms = (time.perf_counter() - started) * 1e3 / args.steps
    finally:
        for request_id in ids:
            engine.abort_request(request_id)
    classes = dict.fromkeys(CLASS_NAMES, 0.0)
    for event in prof.key_averages():
        if "::" in event.key or "CompiledFxGraph" in event.key:
            classes[op_class(event.key)] += event.self_cpu_time_total / 1e3 / args.steps
    ops_ms = sum(classes.values())
    context = args.context + args.steps  # mean over the timed steps, near enough
    kv_bytes = streams * context * figures["layers"] * figures["kv_width"] * figures["kv_element_bytes"]
    flops = 2 * figures["matmul_weights"] * streams
    flops += 4 * streams * context * figures["layers"] * figures["q_width"]  # scores and values
    return {
        "streams": streams,
        "step_ms": statistics.median(step_ms),
        "profiled_step_ms": profiled_ms,
        "bandwidth_floor_ms": (figures["weight_bytes"] + kv_bytes) / (machine["bandwidth_gbs"] * 1e9) * 1e3,
        "compute_floor_ms": flops / (machine["gemm_gflops"] * 1e9) * 1e3,
        "ops_ms": classes,
        "python_and_other_ms": max(0.0, profiled_ms - ops_ms),
        "tokens_per_s": streams / statistics.median(step_ms) * 1e3,
        "threads": torch.get_num_threads(),
    }


def run(args: argparse.Namespace) -> int:
    import torch

    from raylane.engine import LLM
    from raylane.models.packaged import packaged_model_path

    if args.threads:
        torch.set_num_threads(args.threads)
    path = str(packaged_model_path(MODEL))
    info = machine_info()
    machine = {"bandwidth_gbs": memory_bandwidth_gbs(), "gemm_gflops": gemm_gflops()}
    threads = torch.get_num_threads()
    print(f"machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']}, {threads} threads")
    print(
        f"measured here: copy bandwidth {machine['bandwidth_gbs']:.1f} GB/s, float32 GEMM "
        f"{machine['gemm_gflops']:.0f} GFLOP/s (1024^3)"
    )
    print(f"model: {MODEL} ({Path(path).name}), in-process LLM, context {args.context} tokens")
    streams = [int(s) for s in args.streams.split(",")]
    rows = []
    for quantization in args.quantization.split(","):
        q = None if quantization == "none" else quantization
        settings = itertools.product(
            args.modes.split(","), args.attention.split(","), args.kv_cache_dtype.split(",")
        )
        for mode, backend, kv_dtype in settings:
            compiled = mode == "compiled"
            with LLM(
                path,
                quantization=q,
                max_num_seqs=max(streams),
                num_kv_blocks=1024,
                max_model_len=2048,
                torch_compile=compiled,
                cpu_batch_weight_copy=compiled and q is not None,
                attention_backend=backend,
                kv_cache_dtype=kv_dtype,
            ) as llm:
                figures = model_figures(llm)
                for n in streams:
                    row = measure(llm, n, args, figures, machine)
                    row |= {
                        "weights": quantization if q else "float32",
                        "mode": mode,
                        "attention": llm.engine.runner.attention_backend,
                        "kv_cache": str(llm.engine.runner.kv_dtype).removeprefix("torch."),
                        "weight_mib": figures["weight_bytes"] / 2**20,
                    }
                    rows.append(row)
    headers = [
        "weights",
        "mode",
        "attention",
        "KV cache",
        "streams",
        "step ms",
        "tok/s",
        "bandwidth floor",
        "compute floor",
        *CLASS_NAMES,
    ]
    print_table(
        [*headers, "python and other"],
        [
            [
                r["weights"],
                r["mode"],
                r.get("attention", "torch"),
                r.get("kv_cache", "float32"),
                str(r["streams"]),
                f"{r['step_ms']:.1f}",
                f"{r['tokens_per_s']:.0f}",
                f"{r['bandwidth_floor_ms']:.1f}",
                f"{r['compute_floor_ms']:.1f}",
                *(f"{r['ops_ms'][c]:.1f}" for c in CLASS_NAMES),
                f"{r['python_and_other_ms']:.1f}",
            ]
            for r in rows
        ],
    )
    if args.out:
        write_json(
            args.out / "decode_profile.json", {"machine": info | machine, "model": MODEL, "rows": rows}
        )
        print(f"\nwrote {args.out / 'decode_profile.json'}")
    return 0
