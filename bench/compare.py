"""`raylane bench compare`: the same sweep against two endpoints, alternated, and the ratios B/A.

Run one after the other, two benchmarks on a shared machine each see different noise; alternated in
one run (A B, then B A, ... per sweep point, so drift hits both sides alike) the noise mostly cancels
in the ratio. Each side's records are pooled over the repeats; the ratio column divides the pooled
numbers and the range column shows the ratio of each repeat's A/B pair, a direct read of the noise.

    raylane bench compare --base-url-a http://127.0.0.1:8000/v1 --base-url-b http://127.0.0.1:8001/v1 \\
        --model chat --dataset random --concurrency 1,8 --repeats 2 --out results/

Either side may instead be a raylane cluster config that this command starts itself:

    raylane bench compare --config-a cache-off.yaml --config-b cache-on.yaml --dataset prefix \\
        --concurrency 1 --repeats 2

Both configs are deployed in one in-process Ray + Serve (bench/apps.py), each as its own app under
/a and /b on one HTTP port (the configs' `http` sections are not used), and deleted on exit. The
model defaults to each config's first pool. Where the endpoints come from is `endpoint_sources`;
another kind of endpoint is another `EndpointSource`.

A side may also be llama.cpp's `llama-server` on a GGUF file, the CPU anchor (bench/llama_server.py
builds it once into a cache and starts it on a free port with `-np 16 -t 2`, stopped on exit):

    raylane bench compare --llama-server-a smollm2-135m-instruct \\
        --config-b bench/configs/smollm2-compare.yaml --label-b raylane --dataset sharegpt \\
        --sharegpt-output-len 128 --sharegpt-max-len 512 --num-prompts 8 --repeats 2 --concurrency 1,4,16

Both sides get the same messages and `max_tokens`; with `--ignore-eos` (the default) both run every
answer to exactly `max_tokens` (raylane and vLLM read `ignore_eos`; llama-server reads the same field
and takes `max_tokens` as its `n_predict`). The usage counts prove it: the run prints, per side and
point, how many answers had exactly the tokens asked for. A side this command starts (a config or
llama-server) also has its memory read after every run (`memory_mib`).
"""

import argparse
import asyncio
import contextlib
import datetime
import math
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from raylane.bench.apps import APP_PREFIX, LocalServe, LocalServeError
from raylane.bench.client import Endpoint, make_client
from raylane.bench.common import client_machine, print_table, process_tree_pss_mib, write_json
from raylane.bench.datasets import BenchRequest, DatasetUnavailable, add_dataset_arguments, requests_from_args
from raylane.bench.llama_server import LlamaServer, LlamaServerError
from raylane.bench.metrics import RequestRecord, summarize
from raylane.bench.serve import (
    BenchError,
    SweepPoint,
    SweepSettings,
    add_api_key_argument,
    add_sweep_arguments,
    json_safe,
    measure_point,
    settings_from_args,
    sweep_points,
    warm_up,
)
from raylane.config import ClusterConfig, ConfigError

# (label, path into a summary, True when higher is better)
COMPARED = (
    ("req/s", ("request_throughput",), True),
    ("output tok/s", ("output_throughput",), True),
    ("TTFT mean", ("ttft", "mean"), False),
    ("TTFT p50", ("ttft", "p50"), False),
    ("TTFT p99", ("ttft", "p99"), False),
    ("TPOT p50", ("tpot", "p50"), False),
    ("TPOT p99", ("tpot", "p99"), False),
    ("ITL p50", ("itl", "p50"), False),
    ("E2E p50", ("e2e", "p50"), False),
    ("E2E p99", ("e2e", "p99"), False),
    ("goodput", ("goodput",), True),
)


class EndpointSource(Protocol):
    """Something that provides an endpoint for the duration of a comparison."""

    label: str

    def open(self) -> contextlib.AbstractContextManager[Endpoint]: ...

    def owns(self, pid: int, name: str) -> bool:
        """Whether process `pid` (named as `process_name` names it) and its descendants serve this side."""
        ...


@dataclass(frozen=True, slots=True)
class UrlSource:
    """An endpoint that is already running."""

    label: str
    endpoint: Endpoint

    @contextlib.contextmanager
    def open(self) -> Iterator[Endpoint]:
        yield self.endpoint

    def owns(self, pid: int, name: str) -> bool:
        return False  # somewhere else: its memory is not this machine's to read


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for side in ("a", "b"):
        where = parser.add_mutually_exclusive_group(required=True)
        where.add_argument(
            f"--base-url-{side}", help=f"endpoint {side.upper()}'s API root (a running server)"
        )
        where.add_argument(
            f"--config-{side}",
            type=Path,
            help=f"a raylane cluster config YAML to start as endpoint {side.upper()} (stopped on exit)",
        )
        where.add_argument(
            f"--llama-server-{side}",
            type=Path,
            metavar="GGUF",
            help=f"start llama.cpp's llama-server on this GGUF file (or packaged model name, e.g. "
            f"smollm2-135m-instruct) as endpoint {side.upper()} (built once into "
            "~/.cache/raylane/llama.cpp; stopped on exit)",
        )
        parser.add_argument(
            f"--model-{side}",
            help=f"endpoint {side.upper()}'s model (default --model, else a config's first pool, "
            "else the GGUF file's name)",
        )
        parser.add_argument(f"--label-{side}", help=f"name in the table ({side.upper()}, or llama-server)")
    parser.add_argument("--model", help="the `model` field for both endpoints")
    group = parser.add_argument_group("llama-server (a --llama-server-a/-b side)")
    group.add_argument("--llama-server-bin", type=Path, help="this binary instead of the cached build")
    group.add_argument("--llama-server-parallel", type=int, default=16, help="slots (-np)")
    group.add_argument("--llama-server-threads", type=int, default=2, help="threads (-t)")
    group.add_argument(
        "--llama-server-ctx-per-slot",
        type=int,
        default=2048,
        help="prompt + answer tokens per slot; the context (-c) is slots x this",
    )
    group.add_argument(
        "--llama-server-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more llama-server argument, repeatable; e.g. --llama-server-arg=--no-repack where "
        "llama.cpp's AMX or repacked kernels fail on a CPU (recorded in compare.json)",
    )
    add_api_key_argument(parser)
    add_dataset_arguments(parser)
    add_sweep_arguments(parser)
    parser.add_argument("--repeats", type=int, default=2, help="A/B runs per sweep point, order alternating")
    parser.add_argument("--out", type=Path, help="write compare.json here")


@dataclass(frozen=True, slots=True)
class ConfigSource:
    """An endpoint this command starts from a raylane cluster config (in `local`, one Serve for both)."""

    label: str
    model: str
    api_key: str
    local: LocalServe  # the config is staged there as app `app`; LocalServe deletes it on exit
    app: str  # the app's name suffix and route prefix: "a" -> /a

    @contextlib.contextmanager
    def open(self) -> Iterator[Endpoint]:
        url = self.local.url(self.app)  # the first open deploys both config sides, in parallel
        yield Endpoint(f"{url}/v1", self.model, self.api_key, self.label)

    def owns(self, pid: int, name: str) -> bool:
        return name.startswith(f"ServeReplica:{APP_PREFIX}{self.app}:")  # its gateway and pools


@dataclass(frozen=True, slots=True)
class LlamaServerSource:
    """llama.cpp's llama-server on a GGUF file, started on a free port when opened, stopped on close."""

    label: str
    model: str  # llama-server answers any `model`; it names the side in the results
    api_key: str
    server: LlamaServer

    @contextlib.contextmanager
    def open(self) -> Iterator[Endpoint]:
        with self.server:
            yield Endpoint(f"{self.server.url}/v1", self.model, self.api_key, self.label)

    def owns(self, pid: int, name: str) -> bool:
        return pid == self.server.pid


def gguf_file(value: Path) -> Path:
    """A GGUF path as given, or the file of a packaged model named as a pool's `model` may name it."""
    if value.exists():
        return value
    from raylane.models.packaged import PACKAGED_MODELS, PackagedModelMissing, packaged_model_path

    if str(value) not in PACKAGED_MODELS:
        return value  # LlamaServer names the missing file
    try:
        return packaged_model_path(str(value))
    except PackagedModelMissing as e:
        raise BenchError(str(e)) from None


def llama_server_source(args: argparse.Namespace, side: str, given: Path) -> LlamaServerSource:
    gguf = gguf_file(given)
    server = LlamaServer(
        gguf,
        n_parallel=args.llama_server_parallel,
        threads=args.llama_server_threads,
        ctx_per_slot=args.llama_server_ctx_per_slot,
        binary=args.llama_server_bin,
        extra_args=tuple(args.llama_server_arg),
    )
    model = getattr(args, f"model_{side}") or args.model or gguf.name
    return LlamaServerSource(getattr(args, f"label_{side}") or "llama-server", model, args.api_key, server)


def load_cluster_config(path: Path) -> ClusterConfig:
    try:
        return ClusterConfig.from_yaml(path)
    except (ConfigError, OSError) as e:
        raise BenchError(f"{path}: {e}") from None


def endpoint_sources(
    args: argparse.Namespace, stack: contextlib.ExitStack
) -> tuple[EndpointSource, EndpointSource]:
    """The two sides; a config side starts (once, in `stack`) the in-process Serve both configs share."""
    sources: list[EndpointSource] = []
    local: LocalServe | None = None
    for side in ("a", "b"):
        gguf = getattr(args, f"llama_server_{side}")
        if gguf is not None:
            sources.append(llama_server_source(args, side, gguf))
            continue
        label = getattr(args, f"label_{side}") or side.upper()
        config_path = getattr(args, f"config_{side}")
        config = load_cluster_config(config_path) if config_path else None
        model = getattr(args, f"model_{side}") or args.model or (config.pools[0].model_id if config else None)
        if not model:
            raise BenchError(f"give --model or --model-{side}")
        if config is None:
            endpoint = Endpoint(getattr(args, f"base_url_{side}"), model, args.api_key, label)
            sources.append(UrlSource(label, endpoint))
            continue
        if local is None:
            local = stack.enter_context(LocalServe())
        local.add(side, config)
        sources.append(ConfigSource(label, model, args.api_key, local, side))
    return sources[0], sources[1]


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    try:
        requests, dataset = requests_from_args(args)
        with contextlib.ExitStack() as stack:
            sources = endpoint_sources(args, stack)
            endpoints = tuple(stack.enter_context(s.open()) for s in sources)
            points = asyncio.run(
                compare_sweep(
                    endpoints,
                    requests,
                    sweep_points(args),
                    settings,
                    args.repeats,
                    args.warmup,
                    memory=lambda: memory_mib(sources),
                )
            )
    except (BenchError, DatasetUnavailable, LocalServeError, LlamaServerError, ValueError) as e:
        print(f"raylane bench compare: {e}", file=sys.stderr)
        return 1
    a, b = endpoints
    print(f"A = {a.label}: {a.model} @ {a.base_url}")
    print(f"B = {b.label}: {b.model} @ {b.base_url}")
    print(f"dataset {dataset['name']}: {dataset['num_prompts']} prompts per side and repeat")
    print(f"prompt tokens {dataset['prompt_tokens']}")
    for point in points:
        print_comparison(point, a.label, b.label, args.repeats)
    if args.out:
        report = {
            "benchmark": "compare",
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "endpoints": [endpoint_record(e, s) for e, s in zip(endpoints, sources, strict=True)],
            "dataset": dataset,
            "repeats": args.repeats,
            "unique_prompts": settings.unique_prompts,
            "client_machine": client_machine(),
            "points": points,
        }
        write_json(args.out / "compare.json", json_safe(report))
        print(f"\nwrote {args.out / 'compare.json'}")
    return 0


def endpoint_record(endpoint: Endpoint, source: EndpointSource) -> dict[str, Any]:
    record = {"label": endpoint.label, "base_url": endpoint.base_url, "model": endpoint.model}
    if isinstance(source, LlamaServerSource):  # how the anchor ran: its threads, slots, extra arguments
        record["command"] = source.server.command()
    return record


async def compare_sweep(
    endpoints: tuple[Endpoint, Endpoint],
    requests: list[BenchRequest],
    points: list[SweepPoint],
    settings: SweepSettings,
    repeats: int,
    warmup: int = 1,
    memory: Callable[[], dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Each point's sides alternated; `memory`, if given, is read after every run of a point and the
    point keeps each side's largest reading."""
    clients = [make_client(e, settings.options) for e in endpoints]
    try:
        for client, endpoint in zip(clients, endpoints, strict=True):
            await warm_up(client, endpoint, requests[:warmup], settings)
        return [
            await compare_point(clients, endpoints, requests, p, settings, repeats, memory) for p in points
        ]
    finally:
        for client in clients:
            await client.close()


async def compare_point(
    clients: list,
    endpoints: tuple[Endpoint, Endpoint],
    requests: list[BenchRequest],
    point: SweepPoint,
    settings: SweepSettings,
    repeats: int,
    memory: Callable[[], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    runs: list[list[dict[str, Any]]] = [[], []]
    readings = []
    for repeat in range(repeats):
        for side in (0, 1) if repeat % 2 == 0 else (1, 0):
            runs[side].append(
                await measure_point(clients[side], endpoints[side], requests, point, settings, repeat)
            )
            if memory is not None:
                readings.append(await asyncio.to_thread(memory))
    pooled = [pool(side_runs, settings) for side_runs in runs]
    exact = [exact_lengths(side_runs, requests) for side_runs in runs]
    per_repeat = [
        {label: ratio(run_b["summary"], run_a["summary"], path) for label, path, _ in COMPARED}
        for run_a, run_b in zip(runs[0], runs[1], strict=True)
    ]
    return {
        "concurrency": point.concurrency,
        "request_rate": point.request_rate,
        "label": point.label,
        "summaries": pooled,
        "ratios": {label: ratio(pooled[1], pooled[0], path) for label, path, _ in COMPARED},
        "ratios_per_repeat": per_repeat,
        "exact_output_tokens": exact,
        "memory_mib": largest_memory(readings),
        "runs": runs,
    }


def memory_mib(sources: tuple[EndpointSource, EndpointSource]) -> dict[str, Any]:
    """What each side runs on this machine, now, as proportional set size in MiB (shared pages split
    between the processes that share them): llama-server's process; a config side's gateway and pool
    replicas with their children (engine cores, forkservers, workers). The rest of the in-process Ray
    (GCS, raylet, Serve's controller and proxy, Ray's agents) goes to the config side when there is
    one, as part of what it takes to run it, else stays `shared`; this command's own process and the
    replicas of other apps (in a Ray it joined) count nowhere. None for a side served from elsewhere
    (a URL)."""
    tree = process_tree_pss_mib()
    owned, shared = [0.0, 0.0], 0.0
    processes: dict[str, float] = {}  # what was counted, by process name (`python` by its parent's)
    for pid, (ppid, own_name, pss) in tree.items():
        if pid == os.getpid():
            continue
        owner, node = None, pid
        while owner is None and node in tree:
            name = tree[node][1]
            owner = next((i for i, s in enumerate(sources) if s.owns(node, name)), None)
            if owner is None and name.startswith("ServeReplica:"):
                owner = -1  # another app's, in a Ray this command joined: neither side's
            node = tree[node][0]
        if owner is None:
            shared += pss
        elif owner >= 0:
            owned[owner] += pss
        else:
            continue
        if own_name == "python" and ppid in tree:  # a forkserver or worker: whose
            own_name = f"python under {tree[ppid][1]}"
        processes[own_name] = processes.get(own_name, 0.0) + pss
    configs = [i for i, s in enumerate(sources) if isinstance(s, ConfigSource)]
    if len(configs) == 1:
        owned[configs[0]] += shared
        shared = 0.0
    sides = [None if isinstance(s, UrlSource) else owned[i] for i, s in enumerate(sources)]
    return {"sides": sides, "shared": shared, "processes": processes}


def largest_memory(readings: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Each side's largest reading over a point, and the last reading's processes (None without
    readings)."""
    if not readings:
        return None
    sides = [r["sides"] for r in readings]
    return {
        "sides": [None if s[0] is None else max(s) for s in zip(*sides, strict=True)],
        "shared": max(r["shared"] for r in readings),
        "processes": readings[-1]["processes"],
    }


def exact_lengths(runs: list[dict[str, Any]], requests: list[BenchRequest]) -> dict[str, int]:
    """How many completed answers had exactly the `max_tokens` asked for, by the server's usage count.

    With `ignore_eos` honoured that is every one; a side that stops at EOS (or counts differently)
    shows here, before its throughput is read against the other's."""
    exact = completed = 0
    for run in runs:
        for record, request in zip(run["records"], requests, strict=True):
            if record["error_code"] is None:
                completed += 1
                exact += record["output_tokens"] == request.max_tokens
    return {"exact": exact, "completed": completed}


def pool(runs: list[dict[str, Any]], settings: SweepSettings) -> dict[str, Any]:
    """One summary over all repeats of a side: records pooled, wall times added."""
    records = [RequestRecord.from_json(r) for run in runs for r in run["records"]]
    return summarize(records, sum(run["summary"]["wall_s"] for run in runs), settings.slo)


def lookup(summary: dict[str, Any], path: tuple[str, ...]) -> float | None:
    value: Any = summary
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def ratio(b: dict[str, Any], a: dict[str, Any], path: tuple[str, ...]) -> float | None:
    """b / a of one metric; None where either is missing, NaN or a is zero."""
    va, vb = lookup(a, path), lookup(b, path)
    if va is None or vb is None or math.isnan(va) or math.isnan(vb) or va == 0:
        return None
    return vb / va


def print_comparison(point: dict[str, Any], label_a: str, label_b: str, repeats: int) -> None:
    a, b = point["summaries"]
    print(f"\n{point['label']}: {a['requests']} requests per side over {repeats} alternated repeats")
    rows = []
    for label, path, higher_better in COMPARED:
        r = point["ratios"][label]
        if r is None and lookup(a, path) is None:
            continue
        spread = [x[label] for x in point["ratios_per_repeat"] if x[label] is not None]
        rows.append(
            [
                label,
                fmt(lookup(a, path)),
                fmt(lookup(b, path)),
                "-" if r is None else f"{r:.3f}",
                f"{min(spread):.3f}..{max(spread):.3f}" if spread else "-",
                better(r, higher_better, label_a, label_b),
            ]
        )
    rows.append(["errors", str(a["errors"]), str(b["errors"]), "", "", ""])
    if memory := point.get("memory_mib"):
        ma, mb = memory["sides"]
        r = None if ma is None or mb is None or ma == 0 else mb / ma
        rows.append(
            [
                "memory PSS MiB",
                fmt(ma),
                fmt(mb),
                "-" if r is None else f"{r:.3f}",
                "",
                better(r, False, label_a, label_b),
            ]
        )
    if "exact_output_tokens" in point:
        ea, eb = (f"{e['exact']}/{e['completed']}" for e in point["exact_output_tokens"])
        rows.append(["exactly max_tokens", ea, eb, "", "", ""])
    print_table(["metric (ms, /s)", label_a, label_b, "B/A", "B/A per repeat", "better"], rows)
    if memory and memory["shared"]:
        print(f"memory: Ray and Serve's own processes, shared by both sides: {memory['shared']:.0f} MiB PSS")
    for label, e in zip((label_a, label_b), point.get("exact_output_tokens", ()), strict=False):
        if e["exact"] < e["completed"]:
            short = e["completed"] - e["exact"]
            print(f"note: {label} ended {short} answers off max_tokens: its tok/s and TPOT count other")
            print("  numbers of tokens than the other side's (does it honour ignore_eos?)")


def better(r: float | None, higher_better: bool, label_a: str, label_b: str) -> str:
    if r is None or r == 1:
        return "-"
    return label_b if (r > 1) == higher_better else label_a


def fmt(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.2f}"
