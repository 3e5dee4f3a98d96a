"""`raylane bench NAME`: run one of the benchmarks in `bench/` and print its table."""

import argparse
import importlib

BENCHMARKS = {
    "engine": "bench.engine",
    "linears": "bench.linears",
    "serve": "bench.serve",
    "compare": "bench.compare",
    "parallel": "bench.parallel",
    "router": "bench.router",
    "speedups": "bench.speedups",
    "pool-settings": "bench.pool_settings",
    "gguf-open": "bench.gguf_open",
    "grammar-bound": "bench.grammar_bound",
    "overhead": "bench.overhead",
    "affinity": "bench.affinity",
    "gpu-check": "bench.gpu_check",
    "recovery": "bench.recovery",
    "report": "bench.report",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="benchmark", required=True)
    for name, module in BENCHMARKS.items():
        bench_parser = sub.add_parser(name)
        importlib.import_module(module).add_arguments(bench_parser)


def run(args: argparse.Namespace) -> int:
    return importlib.import_module(BENCHMARKS[args.benchmark]).run(args) or 0
