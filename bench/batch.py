"""`raylane bench batch`: what a batch costs interactive traffic, and what spare capacity gives it.

One app of one pool (`chat`, SmolLM2-135M-Instruct by default) in an in-process Ray + Serve
(bench/apps.py), one API key in one interactive tier; the Batch API's `batch` tier below it. In
one run, in this order:

1. **interactive alone**: `--clients` streaming chat clients, each sending its requests one after
   another (a closed loop, as a chat UI does), `--requests` each; TTFT per request;
2. **burst**: the batch's lines sent as direct requests, `--concurrency` at a time: the time the
   same work takes when nobody holds back;
3. **batch alone**: the lines as a batch (`/v1/batches`, through the unmodified `openai` SDK), from
   creation to `completed`, with nothing else running: its throughput on an idle pool;
4. **interactive during a batch**: the interactive clients again, while another batch of the same
   lines runs; then that batch is cancelled;
5. **interactive alone** again, so the machine's drift over the run weighs on both sides.

Goals (issue #38): interactive p50 TTFT during the batch <= 1.2x alone (alone: phases 1 and 5
pooled); batch throughput on an idle pool >= 0.8x the burst's.

    raylane bench batch                          # 2,000 lines; ~15 minutes on two shared cores
    raylane bench batch --lines 200 --out /tmp/batch.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import io
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from raylane.bench.common import OtherLoad, client_machine, print_table, process_tree_cpu_s, write_json
from raylane.config import ClusterConfig

MODEL = "smollm2-135m-instruct"
TTFT_GOAL, THROUGHPUT_GOAL = 1.2, 0.8
SUBJECTS = ["the sea", "a mountain", "a city at night", "an old library", "a train journey", "a garden"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=MODEL, help=f"the pool's model (default {MODEL})")
    parser.add_argument("--lines", type=int, default=2000, help="lines in the batch (default 2000)")
    parser.add_argument("--line-tokens", type=int, default=8, help="max_tokens of a batch line")
    parser.add_argument("--clients", type=int, default=2, help="interactive clients (closed loops)")
    parser.add_argument("--requests", type=int, default=20, help="requests per interactive client and phase")
    parser.add_argument("--chat-tokens", type=int, default=16, help="max_tokens of an interactive request")
    parser.add_argument("--concurrency", type=int, default=8, help="direct requests at once in the burst")
    parser.add_argument(
        "--out", type=Path, default=Path("bench/results/batch.json"), help="where the JSON goes"
    )


def pool_config(model: str, concurrency: int, store: Path) -> ClusterConfig:
    return ClusterConfig.from_dict(
        {
            "gateway": {"num_cpus": 0.1},
            "embeddings": {"enabled": False},
            "pools": [
                {
                    "name": "chat",
                    "model": model,
                    "engine": {"max_num_seqs": 16, "max_model_len": 1024, "cpus_per_rank": 1, "seed": 0},
                    "max_in_flight": 16,
                }
            ],
            "batch": {"store": str(store / "batch.sqlite3"), "files_dir": str(store / "files"),
                      "max_concurrency": concurrency},
            "tiers": [
                {"name": "interactive", "priority": 0, "max_queue_depth": 256, "max_queue_wait_s": 600,
                 "batches": True}
            ],
            "api_keys": {"default_tier": "interactive"},
        }
    )  # fmt: skip


def batch_lines(lines: int, max_tokens: int) -> list[dict[str, Any]]:
    out = []
    for i in range(lines):
        text = f"In one sentence, describe {SUBJECTS[i % len(SUBJECTS)]} (note {i})."
        body = {"model": "chat", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}
        out.append({"custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
    return out


async def interactive(client, clients: int, requests: int, max_tokens: int) -> list[float]:
    """TTFTs (s) of `clients` closed loops of `requests` streamed chat requests each."""

    async def loop(c: int) -> list[float]:
        ttfts = []
        for r in range(requests):
            sent = time.perf_counter()
            stream = await client.chat.completions.create(
                model="chat",
                messages=[
                    {
                        "role": "user",
                        "content": f"Client {c} asks question {r}: what is a good name for a cat?",
                    }
                ],
                max_tokens=max_tokens,
                stream=True,
            )
            first = None
            async for chunk in stream:
                if first is None and any(ch.delta and ch.delta.content for ch in chunk.choices):
                    first = time.perf_counter() - sent
            ttfts.append(first if first is not None else time.perf_counter() - sent)
        return ttfts

    return [t for ts in await asyncio.gather(*(loop(c) for c in range(clients))) for t in ts]


async def burst(client, lines: list[dict], concurrency: int) -> tuple[float, int]:
    """(seconds, output tokens) of `lines` sent as direct requests, `concurrency` at a time."""
    limit = asyncio.Semaphore(concurrency)

    async def one(line: dict) -> int:
        async with limit:
            answer = await client.chat.completions.create(**line["body"])
            return answer.usage.completion_tokens

    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(line) for line in lines)))
    return time.perf_counter() - start, tokens


async def submit(client, lines: list[dict]):
    content = io.BytesIO(("\n".join(json.dumps(line) for line in lines) + "\n").encode())
    source = await client.files.create(file=("lines.jsonl", content), purpose="batch")
    return await client.batches.create(
        input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h"
    )


async def wait_status(client, batch_id: str, statuses: tuple[str, ...]):
    while (batch := await client.batches.retrieve(batch_id)).status not in statuses:
        await asyncio.sleep(0.5)
    return batch


async def phases(url: str, args: argparse.Namespace) -> dict[str, Any]:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0, timeout=3600)
    lines = batch_lines(args.lines, args.line_tokens)
    await interactive(client, 1, 2, args.chat_tokens)  # warm-up: first requests pay one-off costs
    alone = await interactive(client, args.clients, args.requests, args.chat_tokens)
    burst_s, burst_tokens = await burst(client, lines, args.concurrency)
    batch = await submit(client, lines)
    batch = await wait_status(client, batch.id, ("completed", "failed"))
    batch_s = batch.completed_at - batch.created_at  # whole seconds: the API's resolution
    during_batch = await submit(client, lines)
    await wait_status(client, during_batch.id, ("in_progress",))
    await asyncio.sleep(5)  # its window has grown on the idle pool, as a batch running for long has
    during = await interactive(client, args.clients, args.requests, args.chat_tokens)
    progress = (await client.batches.retrieve(during_batch.id)).request_counts
    await client.batches.cancel(during_batch.id)
    await wait_status(client, during_batch.id, ("cancelled", "completed"))
    after = await interactive(client, args.clients, args.requests, args.chat_tokens)
    return {
        "interactive_alone_ttft_s": alone + after,
        "interactive_during_batch_ttft_s": during,
        "lines_done_during_interactive": progress.completed,
        "burst": {"seconds": burst_s, "output_tokens": burst_tokens},
        "batch": {
            "seconds": batch_s,
            "status": batch.status,
            "request_counts": batch.request_counts.model_dump(),
            "output_tokens": batch.usage.output_tokens if batch.usage else None,
        },
    }


def goals(results: dict[str, Any]) -> dict[str, Any]:
    alone = statistics.median(results["interactive_alone_ttft_s"])
    during = statistics.median(results["interactive_during_batch_ttft_s"])
    ttft = during / alone
    burst_rate = results["burst"]["output_tokens"] / results["burst"]["seconds"]
    batch_rate = (results["batch"]["output_tokens"] or 0) / max(results["batch"]["seconds"], 1)
    throughput = batch_rate / burst_rate
    return {
        "ttft_p50_during_batch_x": {"value": ttft, "goal": TTFT_GOAL, "met": ttft <= TTFT_GOAL},
        "batch_throughput_vs_burst_x": {
            "value": throughput, "goal": THROUGHPUT_GOAL, "met": throughput >= THROUGHPUT_GOAL
        },
        "p50_ttft_ms": {"alone": 1000 * alone, "during_batch": 1000 * during},
        "output_tokens_per_s": {"burst": burst_rate, "batch": batch_rate},
    }  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from raylane.bench.apps import LocalServe

    with tempfile.TemporaryDirectory(prefix="raylane-bench-batch-") as store:
        config = pool_config(args.model, args.concurrency, Path(store))
        with LocalServe() as serve, OtherLoad(process_tree_cpu_s) as other:
            urls = serve.deploy({"batch": config})
            results = asyncio.run(phases(urls["batch"], args))
    report = {
        "benchmark": "batch",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": client_machine(),
        "other_load": other.fraction,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"},
        "results": results,
        "goals": goals(results),
    }
    print_report(report)
    write_json(args.out, report)
    print(f"wrote {args.out}")
    return 0


def print_report(report: dict[str, Any]) -> None:
    g, r = report["goals"], report["results"]
    print(f"machine: {report['machine']}; model: {report['settings']['model']}")
    rows = [
        ["interactive p50 TTFT alone (ms)", f"{g['p50_ttft_ms']['alone']:.0f}", ""],
        ["interactive p50 TTFT during a batch (ms)", f"{g['p50_ttft_ms']['during_batch']:.0f}",
         f"{g['ttft_p50_during_batch_x']['value']:.2f}x (goal <= {TTFT_GOAL}x)"],
        ["batch lines done meanwhile", str(r["lines_done_during_interactive"]), ""],
        ["burst of direct requests (output tokens/s)", f"{g['output_tokens_per_s']['burst']:.1f}", ""],
        ["batch on the idle pool (output tokens/s)", f"{g['output_tokens_per_s']['batch']:.1f}",
         f"{g['batch_throughput_vs_burst_x']['value']:.2f}x (goal >= {THROUGHPUT_GOAL}x)"],
    ]  # fmt: skip
    print_table(["", "value", "ratio"], rows)
