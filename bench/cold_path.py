"""`raylane bench cold-path`: where a lone request's time goes on a cluster that has just started.

Starts `raylane serve` (the embedded default, or `--config`) with its traces sent to an OTLP receiver
in this process (bench/otlp_receiver.py), and the moment /health says ok: `--requests` lone chat
streams back to back, as many again `--gap-s` apart, then `--rounds` rounds of `--concurrency` at
once. Per phase, the client's TTFT (the first request's, p50, max) and, over the phase's traces, each
span's start after the request's first span and its duration (p50, max): the gateway's steps, the
pool's template rendering, the engine's queue wait, prefill and decode, the stream's relay. And the CPU
each kind of process took during the first phase: what the first requests shared the cores with.
`--settle-s` waits that long after ready before the first request. `--tracing both --repeat N`
starts N clusters with tracing on and N with it off, alternated: tracing's cost measured side by side.

    raylane bench cold-path --out bench/results/cold_path
    raylane bench cold-path --tracing both --repeat 2 --requests 100 --out bench/results/cold_path
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from raylane.bench.common import (
    client_result,
    print_table,
    process_tree_cpu_by_name,
    write_json,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="the cluster config (default: the embedded one)")
    parser.add_argument("--model", default="chat", help="the pool (or model) the requests name")
    parser.add_argument("--requests", type=int, default=10, help="lone requests per phase")
    parser.add_argument("--gap-s", type=float, default=0.5, help="the pause between spaced requests")
    parser.add_argument("--concurrency", type=int, default=4, help="requests at once in the last phase")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of the last phase")
    parser.add_argument("--max-tokens", type=int, default=8, help="output tokens of each request")
    parser.add_argument("--settle-s", type=float, default=0.0, help="wait this long after ready")
    parser.add_argument(
        "--tracing",
        choices=("on", "off", "both"),
        default="on",
        help="off: no spans, the TTFTs without tracing's cost; both: on and off alternated",
    )
    parser.add_argument("--repeat", type=int, default=1, help="clusters started per tracing setting")
    parser.add_argument("--port", type=int, default=18321, help="the port `raylane serve` listens on")
    parser.add_argument("--out", type=Path, help="folder for cold_path.json")


def start_server(args: argparse.Namespace, endpoint: str, tracing: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS" and not k.startswith("OTEL_EXPORTER_")}
    if tracing == "on":
        env |= {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint, "OTEL_BSP_SCHEDULE_DELAY": "300"}
    command = [str(Path(sys.executable).with_name("raylane")), "serve", "--port", str(args.port)]
    command += ["--config", str(args.config)] if args.config else []
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / "raylane-cold-path.log", "w")  # noqa: SIM115
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_ready(url: str, process: subprocess.Popen, timeout_s: float = 600) -> float:
    import httpx2

    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if process.poll() is not None:
            raise SystemExit(
                f"raylane serve exited ({process.returncode}); its output: $TMPDIR/raylane-cold-path.log"
            )
        try:
            if httpx2.get(f"{url}/health", timeout=5).json().get("status") == "ok":
                return time.monotonic() - started
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url}/health did not say ok within {timeout_s:.0f} s")


def stream_once(client, model: str, max_tokens: int, text: str) -> tuple[str, float]:
    """(trace id, seconds to the first content chunk) of one streamed chat request."""
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}
    started, ttft = time.monotonic(), None
    with client.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as r:
        r.raise_for_status()
        trace = r.headers.get("x-raylane-trace-id", "")
        for line in r.iter_lines():
            if ttft is None and '"content":"' in line:
                ttft = time.monotonic() - started
    return trace, ttft if ttft is not None else time.monotonic() - started


def phases(client, args: argparse.Namespace, root: int) -> tuple[dict[str, list[tuple[str, float]]], dict]:
    """Each phase's (trace id, TTFT) per request, and the CPU seconds each kind of process took from
    ready to the end of the first phase (what the lone first requests shared the cores with)."""

    def one(i: int, tag: str) -> tuple[str, float]:
        return stream_once(client, args.model, args.max_tokens, f"Say hi, number {i} ({tag}).")

    before, started = process_tree_cpu_by_name(root), time.monotonic()
    out = {"lone, back to back": [one(i, "b") for i in range(args.requests)]}
    spent = {k: v - before.get(k, 0.0) for k, v in process_tree_cpu_by_name(root).items()}
    cpu = {
        "seconds": round(time.monotonic() - started, 1),
        "cpu_s": {k: round(v, 2) for k, v in sorted(spent.items(), key=lambda kv: -kv[1]) if v >= 0.1},
    }
    spaced = []
    for i in range(args.requests):
        time.sleep(args.gap_s)
        spaced.append(one(i, "s"))
    out[f"lone, {args.gap_s:g} s apart"] = spaced
    together = []
    with ThreadPoolExecutor(args.concurrency) as pool:
        for r in range(args.rounds):
            together += pool.map(lambda i, r=r: one(i, f"c{r}"), range(args.concurrency))
    out[f"{args.concurrency} at once"] = together
    return out, cpu


def span_table(receiver, traces: list[str]) -> dict[str, dict[str, float]]:
    """span name -> start and duration (ms, p50 and max) over `traces`, from each trace's first span."""
    rows: dict[str, list[tuple[float, float]]] = {}
    for trace in traces:
        spans = receiver.trace(trace)
        if not spans:
            continue
        first = min(s.start_ns for s in spans)
        for s in spans:
            rows.setdefault(s.name, []).append(((s.start_ns - first) / 1e6, (s.end_ns - s.start_ns) / 1e6))
    return {
        name: {
            "start_p50_ms": statistics.median(x[0] for x in v),
            "duration_p50_ms": statistics.median(x[1] for x in v),
            "duration_max_ms": max(x[1] for x in v),
        }
        for name, v in sorted(rows.items(), key=lambda kv: statistics.median(x[0] for x in kv[1]))
    }


def run_once(args: argparse.Namespace, receiver, tracing: str) -> dict[str, Any]:
    """One fresh cluster: when it was ready, the first phase's CPU and each phase's TTFTs and spans."""
    import httpx2

    server = start_server(args, receiver.endpoint, tracing)
    url = f"http://127.0.0.1:{args.port}"
    try:
        ready_s = wait_ready(url, server)
        time.sleep(args.settle_s)
        with httpx2.Client(base_url=url, timeout=120) as client:
            results, first_phase_cpu = phases(client, args, server.pid)
        time.sleep(2)  # the last spans' export (OTEL_BSP_SCHEDULE_DELAY)
        report = {}
        for name, rows in results.items():
            ttfts = [t for _, t in rows]
            report[name] = {
                "ttft_first_ms": 1000 * ttfts[0],
                "ttft_last_ms": 1000 * ttfts[-1],
                "ttft_p50_ms": 1000 * statistics.median(ttfts),
                "ttft_max_ms": 1000 * max(ttfts),
                "spans": span_table(receiver, [trace for trace, _ in rows]),
            }
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
    return {
        "tracing": tracing,
        "ready_after_s": round(ready_s, 1),
        "first_phase_cpu": first_phase_cpu,
        "phases": report,
    }


def run(args: argparse.Namespace) -> int:
    try:
        from raylane.bench.otlp_receiver import OtlpReceiver
    except ImportError:
        raise SystemExit("cold-path needs the tracing extra: pip install 'raylane[tracing]'") from None

    receiver = OtlpReceiver()
    settings = ["on", "off"] if args.tracing == "both" else [args.tracing]
    runs = []
    try:
        for _ in range(args.repeat):
            for tracing in settings:
                runs.append(run_once(args, receiver, tracing))
                print(f"\n== run {len(runs)}, tracing {tracing}")
                print_report(runs[-1])
    finally:
        receiver.close()
    if len(runs) > 1:
        print_summary(runs)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        write_json(
            args.out / "cold_path.json",
            client_result("cold-path", args, runs=runs),
        )
    return 0


def print_summary(runs: list[dict[str, Any]]) -> None:
    """Per run, the lone requests' TTFT: first, last (the `--requests`th) and p50, and p50 at once."""
    names = list(runs[0]["phases"])
    rows = []
    for i, r in enumerate(runs, 1):
        lone, together = r["phases"][names[0]], r["phases"][names[-1]]
        rows.append(
            [
                str(i),
                r["tracing"],
                f"{lone['ttft_first_ms']:.0f}",
                f"{lone['ttft_last_ms']:.0f}",
                f"{lone['ttft_p50_ms']:.0f}",
                f"{r['phases'][names[1]]['ttft_p50_ms']:.0f}",
                f"{together['ttft_p50_ms']:.0f}",
            ]
        )
    print(f"\nTTFT ms, {len(runs)} clusters in the order they ran")
    print_table(
        ["run", "tracing", "first", "last", f"p50 {names[0]}", f"p50 {names[1]}", f"p50 {names[-1]}"], rows
    )


def print_report(run: dict[str, Any]) -> None:
    cpu, report = run["first_phase_cpu"], run["phases"]
    print(f"/health ok {run['ready_after_s']:.1f} s after start")
    spent = ", ".join(f"{k} {v:.1f}" for k, v in cpu["cpu_s"].items())
    print(f"CPU seconds in the first phase ({cpu['seconds']:g} s from ready): {spent}")
    print_table(
        ["phase", "TTFT first", "last", "p50", "max"],
        [
            [
                name,
                f"{r['ttft_first_ms']:.0f}",
                f"{r['ttft_last_ms']:.0f}",
                f"{r['ttft_p50_ms']:.0f}",
                f"{r['ttft_max_ms']:.0f}",
            ]
            for name, r in report.items()
        ],
    )
    for name, r in report.items():
        if not r["spans"]:
            continue
        print(f"\n{name}: spans (ms from the request's first span)")
        print_table(
            ["span", "start p50", "duration p50", "max"],
            [
                [
                    span,
                    f"{s['start_p50_ms']:.1f}",
                    f"{s['duration_p50_ms']:.1f}",
                    f"{s['duration_max_ms']:.1f}",
                ]
                for span, s in r["spans"].items()
            ],
        )
