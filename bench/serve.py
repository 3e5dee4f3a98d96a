"""`raylane bench serve`: load an OpenAI-compatible endpoint and measure what its users would feel.

For each sweep point (a concurrency limit, or a Poisson request rate) the same prompts are streamed
through the official `openai` client, and a table prints TTFT, TPOT, ITL and E2E (mean, p50, p90,
p99 in ms), request and output-token throughput, errors by status and goodput under `--slo`.
bench/metrics.py defines every number. `--out DIR` writes serve.json (every request's record and
every summary) and serve.png (latency against throughput across the sweep; the TTFT distribution).

    raylane bench serve --base-url http://127.0.0.1:8000/v1 --model chat --dataset prefix \\
        --num-prompts 64 --concurrency 1,4,16,64 --slo ttft=500,tpot=50 --out results/
"""

import argparse
import asyncio
import datetime
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raylane.bench.client import Endpoint, RequestOptions, make_client, run_requests, send_one
from raylane.bench.common import OtherLoad, client_machine, print_table, pyplot, write_json
from raylane.bench.datasets import (
    BenchRequest,
    DatasetUnavailable,
    add_dataset_arguments,
    requests_from_args,
    unique_prompts,
)
from raylane.bench.metrics import LATENCIES, Slo, parse_slo, summarize

# The client shares the machine with whatever it measures; past this share of one core spent in the
# client itself, its own parsing may be what limits the numbers.
CLIENT_CPU_WARNING = 0.8


@dataclass(frozen=True, slots=True)
class SweepPoint:
    concurrency: int | None = None
    request_rate: float | None = None

    @property
    def label(self) -> str:
        if self.request_rate is not None:
            return f"rate {self.request_rate:g}/s"
        return f"concurrency {self.concurrency}"


@dataclass(frozen=True, slots=True)
class SweepSettings:
    options: RequestOptions
    slo: Slo
    seed: int = 0
    progress: bool = True
    unique_prompts: bool = False


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", required=True, help="the OpenAI API root, e.g. http://HOST:8000/v1")
    parser.add_argument("--model", required=True, help="the `model` field of each request")
    add_api_key_argument(parser)
    add_dataset_arguments(parser)
    add_sweep_arguments(parser)
    parser.add_argument("--out", type=Path, help="write serve.json and serve.png here")


def add_api_key_argument(parser: argparse.ArgumentParser) -> None:
    default = os.environ.get("RAYLANE_API_KEY") or os.environ.get("OPENAI_API_KEY") or "EMPTY"
    parser.add_argument("--api-key", default=default, help="default: $RAYLANE_API_KEY or $OPENAI_API_KEY")


def add_sweep_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sweep")
    mode = group.add_mutually_exclusive_group()
    mode.add_argument("--concurrency", type=int_list, help="requests in flight, e.g. 1,4,16,64 (default 4)")
    mode.add_argument("--request-rate", type=float_list, help="Poisson arrivals per second, e.g. 1,2 or inf")
    group.add_argument(
        "--slo",
        type=parse_slo,
        default=Slo(),
        help="goodput SLOs: ttft=MS,tpot=MS,e2e=MS (default: none, every request counts)",
    )
    group.add_argument("--warmup", type=int, default=1, help="unmeasured requests first (also a check)")
    group.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    group.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of every request")
    group.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ask for exactly max_tokens (vLLM/raylane extension; --no-ignore-eos for other servers)",
    )
    group.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    group.add_argument(
        "--unique-prompts",
        action="store_true",
        help="start every measured request's first message with a line naming its sweep point, run and "
        "index, so no prompt shares a prefix with one sent before: TTFT then measures prefill, not the "
        "server's prompt cache (which the same prompts, sent again by each point and repeat, hit)",
    )


def int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",")]
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("each value must be >= 1")
    return values


def float_list(text: str) -> list[float]:
    values = [float(v) for v in text.split(",")]
    if any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError("each rate must be > 0")
    return values


def sweep_points(args: argparse.Namespace) -> list[SweepPoint]:
    if args.request_rate:
        return [SweepPoint(request_rate=r) for r in args.request_rate]
    return [SweepPoint(concurrency=c) for c in args.concurrency or [4]]


def settings_from_args(args: argparse.Namespace) -> SweepSettings:
    options = RequestOptions(temperature=args.temperature, ignore_eos=args.ignore_eos, timeout_s=args.timeout)
    return SweepSettings(
        options=options,
        slo=args.slo,
        seed=args.seed,
        progress=not args.no_progress,
        unique_prompts=args.unique_prompts,
    )


async def warm_up(client, endpoint: Endpoint, requests: list[BenchRequest], settings: SweepSettings) -> None:
    """Send the first requests unmeasured; one failing stops the run before any point is measured
    (usually a wrong URL, model name or API key, which would otherwise fill every table with errors)."""
    for request in requests:
        record = await send_one(client, endpoint.model, request, settings.options)
        if not record.ok:
            where = f"{endpoint.base_url} (model {endpoint.model!r})"
            raise BenchError(f"warm-up request to {where} failed: {record.error_code}: {record.error}")


class BenchError(RuntimeError):
    pass


async def measure_point(
    client,
    endpoint: Endpoint,
    requests: list[BenchRequest],
    point: SweepPoint,
    settings: SweepSettings,
    run: int = 0,
) -> dict[str, Any]:
    """Run one sweep point: its summary, every request's record, and the CPU the client itself used.
    `run` tells repeats of a point apart (`--unique-prompts`)."""
    from tqdm import tqdm

    if settings.unique_prompts:
        requests = unique_prompts(requests, f"{point.label} run {run}")

    desc = f"{endpoint.label + ' ' if endpoint.label else ''}{point.label}"
    with tqdm(total=len(requests), desc=desc, disable=not settings.progress, file=sys.stderr) as bar:
        cpu_start = time.process_time()
        with OtherLoad() as other:
            records, wall_s = await run_requests(
                client,
                endpoint.model,
                requests,
                settings.options,
                concurrency=point.concurrency,
                request_rate=point.request_rate,
                seed=settings.seed,
                on_done=lambda _: bar.update(1),
            )
        client_cpu = (time.process_time() - cpu_start) / wall_s if wall_s > 0 else math.nan
    return {
        "concurrency": point.concurrency,
        "request_rate": point.request_rate,
        "label": point.label,
        "summary": summarize(records, wall_s, settings.slo),
        "client_cpu_cores": client_cpu,
        "other_cpu_fraction": other.fraction,
        "records": [r.to_json() for r in records],
    }


async def run_sweep(
    endpoint: Endpoint,
    requests: list[BenchRequest],
    points: list[SweepPoint],
    settings: SweepSettings,
    warmup: int = 1,
) -> list[dict[str, Any]]:
    client = make_client(endpoint, settings.options)
    try:
        await warm_up(client, endpoint, requests[:warmup], settings)
        return [await measure_point(client, endpoint, requests, p, settings) for p in points]
    finally:
        await client.close()


def run(args: argparse.Namespace) -> int:
    endpoint = Endpoint(args.base_url, args.model, args.api_key)
    settings = settings_from_args(args)
    try:
        requests, dataset = requests_from_args(args)
        results = asyncio.run(run_sweep(endpoint, requests, sweep_points(args), settings, args.warmup))
    except (BenchError, DatasetUnavailable, ValueError) as e:
        print(f"raylane bench serve: {e}", file=sys.stderr)
        return 1
    print_header(endpoint, dataset, results)
    for result in results:
        print_point(result)
    print_sweep_table(results, settings.slo)
    if args.out:
        report = {
            "benchmark": "serve",
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "endpoint": {"base_url": endpoint.base_url, "model": endpoint.model},
            "dataset": dataset,
            "options": {
                "temperature": args.temperature,
                "ignore_eos": args.ignore_eos,
                "unique_prompts": args.unique_prompts,
            },
            "client_machine": client_machine(),
            "points": results,
        }
        write_json(args.out / "serve.json", json_safe(report))
        plot(results, args.out / "serve.png", f"{endpoint.model} @ {endpoint.base_url} ({dataset['name']})")
        print(f"\nwrote {args.out / 'serve.json'} and {args.out / 'serve.png'}")
    return 0


def json_safe(value: Any) -> Any:
    """NaN and infinities (an empty statistic, `--request-rate inf`) as null: strict JSON has neither."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def print_header(endpoint: Endpoint, dataset: dict[str, Any], results: list[dict[str, Any]]) -> None:
    usage = all(r["summary"]["usage_reported"] for r in results if r["summary"]["completed"])
    print(f"endpoint {endpoint.base_url}, model {endpoint.model}")
    print(
        f"dataset {dataset['name']}: {dataset['num_prompts']} prompts per point, seed {dataset['seed']}, "
        f"mean max_tokens {dataset['mean_max_tokens']:.0f}"
    )
    print(f"mean {dataset['mean_prompt_tokens']:.0f} prompt tokens, {dataset['prompt_tokens']}")
    source = "the server's usage (exact)" if usage else "content chunks (the server sent no usage)"
    print(f"output tokens counted from {source}")


def errors_text(summary: dict[str, Any]) -> str:
    by_status = summary["errors_by_status"]
    if not by_status:
        return "0"
    return ", ".join(f"{code}: {n}" for code, n in by_status.items())


def goodput_text(summary: dict[str, Any]) -> str:
    if summary["goodput"] is None:
        return "-"
    return f"{summary['goodput']:.2f} req/s ({summary['good_requests']}/{summary['requests']} met SLO)"


def print_point(result: dict[str, Any]) -> None:
    s = result["summary"]
    print(f"\n{result['label']}: {s['requests']} requests in {s['wall_s']:.2f} s")
    print(f"  errors by status: {errors_text(s)}")
    print(f"  throughput: {s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} output tok/s")
    if s["slo"]:
        limits = ", ".join(f"{k[:-3]} <= {v:g} ms" for k, v in s["slo"].items() if v is not None)
        print(f"  goodput ({limits}): {goodput_text(s)}")
    if result["client_cpu_cores"] > CLIENT_CPU_WARNING:
        print(
            f"  note: the client used {result['client_cpu_cores']:.0%} of a core itself; it may be the limit"
        )
    stats = ("mean", "p50", "p90", "p99")
    rows = [[name.upper(), *(f"{s[name][k]:.1f}" for k in stats)] for name in LATENCIES]
    print_table(["latency (ms)", *stats], rows)


def print_sweep_table(results: list[dict[str, Any]], slo: Slo) -> None:
    headers = ["point", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99"]
    headers += ["E2E p50", "E2E p99", "errors"] + (["goodput"] if slo else [])
    rows = []
    for r in results:
        s = r["summary"]
        row = [r["label"], f"{s['request_throughput']:.2f}", f"{s['output_throughput']:.1f}"]
        row += [f"{s[name][p]:.1f}" for name in ("ttft", "tpot", "e2e") for p in ("p50", "p99")]
        row += [str(s["errors"])] + ([f"{s['goodput']:.2f}"] if slo else [])
        rows.append(row)
    print("\nsweep (latencies in ms)")
    print_table(headers, rows)


def plot(results: list[dict[str, Any]], path: Path, title: str) -> None:
    plt = pyplot()
    fig, (ax_lat, ax_tpot, ax_ttft) = plt.subplots(1, 3, figsize=(17, 5))
    throughput = [r["summary"]["output_throughput"] for r in results]
    for ax, names in ((ax_lat, ("ttft", "e2e")), (ax_tpot, ("tpot", "itl"))):
        for color, name in enumerate(names):
            for p, style in (("p50", "o-"), ("p99", "s--")):
                values = [r["summary"][name][p] for r in results]
                ax.plot(throughput, values, style, color=f"C{color}", label=f"{name.upper()} {p}")
        for x, r in zip(throughput, results, strict=True):
            short = r["label"].replace("concurrency ", "c=").replace("rate ", "")
            ax.annotate(
                short,
                (x, r["summary"][names[-1]]["p99"]),
                fontsize=8,
                xytext=(3, 3),
                textcoords="offset points",
            )
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel("ms")
        ax.grid(alpha=0.3)
        ax.legend()
    ax_lat.set_title("TTFT and E2E against throughput")
    ax_tpot.set_title("TPOT and ITL against throughput")
    for r in results:
        ttfts = sorted(rec["ttft"] * 1000.0 for rec in r["records"] if rec["ttft"] is not None)
        fractions = [(i + 1) / len(ttfts) for i in range(len(ttfts))]
        if ttfts:
            ax_ttft.step(ttfts, fractions, where="post", label=r["label"])
    ax_ttft.set_title("TTFT distribution (CDF)")
    ax_ttft.set_xlabel("TTFT (ms)")
    ax_ttft.set_ylabel("fraction of requests")
    ax_ttft.grid(alpha=0.3)
    if ax_ttft.lines:  # no line when every request failed
        ax_ttft.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
