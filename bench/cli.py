"""`raylane bench NAME`: run one of the benchmarks in `bench/` and print its table."""

import argparse
import importlib

BENCHMARKS = {
    "engine": "raylane.bench.engine",
    "linears": "raylane.bench.linears",
    "serve": "raylane.bench.serve",
    "compare": "raylane.bench.compare",
    "parallel": "raylane.bench.parallel",
    "router": "raylane.bench.router",
    "speedups": "raylane.bench.speedups",
    "pool-settings": "raylane.bench.pool_settings",
    "gguf-open": "raylane.bench.gguf_open",
    "grammar-bound": "raylane.bench.grammar_bound",
    "overhead": "raylane.bench.overhead",
    "affinity": "raylane.bench.affinity",
    "batch": "raylane.bench.batch",
    "gpu-check": "raylane.bench.gpu_check",
    "recovery": "raylane.bench.recovery",
    "report": "raylane.bench.report",
    "decode-profile": "raylane.bench.decode_profile",
    "lora": "raylane.bench.lora",
    "accuracy": "raylane.bench.accuracy",
    "serving-cpu": "raylane.bench.serving_cpu",
    "scale": "raylane.bench.scale",
    "autoscale": "raylane.bench.autoscale",
    "cold-path": "raylane.bench.cold_path",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="benchmark", required=True)
    for name, module in BENCHMARKS.items():
        bench_parser = sub.add_parser(name)
        importlib.import_module(module).add_arguments(bench_parser)


def run(args: argparse.Namespace) -> int:
    return importlib.import_module(BENCHMARKS[args.benchmark]).run(args) or 0
