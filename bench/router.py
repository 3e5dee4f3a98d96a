"""`raylane bench router`: how long the semantic classifier takes to route one request, and what
`auto` costs end to end on a live app.

Classifier goal: p50 <= 10 ms on one CPU core for a ~200-token prompt. Every timed prompt is new
(built from the project's labelled prompts, never repeated), so the classifier's embedding cache does
not flatter the numbers; the multi-turn case shows what that cache does for a conversation that
resends its system prompt and earlier turns.

End to end (`--live`: start bench/serving.py's app here; or `--base-url URL --model NAMED` for a
running one): the same ~200-token prompts are sent as `model: "auto"` and as the named model, each
pair back to back, the order alternating (auto first for even pairs), streamed through the official
`openai` client. The two requests of a pair differ in their first word, so neither reuses the
other's prompt in the engine's prefix cache. Only pairs that the gateway served from the same pool
(`x-raylane-pool`) are compared; the app bench/serving.py starts points every route at one pool.
Goal: `auto` adds <= 15 ms to the named model's E2E at p50 (TTFT shown too).
"""

import argparse
import asyncio
import contextlib
import datetime
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from raylane.bench.client import RequestOptions, chat_stream_args, measure_stream
from raylane.bench.common import OtherLoad, machine_info, print_table, process_tree_cpu_s, pyplot, write_json
from raylane.bench.datasets import BenchRequest
from raylane.bench.metrics import RequestRecord, latency_stats_ms
from raylane.bench.metrics import percentile as metrics_percentile

# case -> (approximate prompt tokens, timed requests)
CASES = {"short": (15, 300), "200 tokens": (200, 200), "2,000 tokens": (2000, 100)}
GOAL_P50_MS = 10.0


GOAL_AUTO_ADDED_MS = 15.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (the goal is for one core)")
    parser.add_argument("--repeats", type=float, default=1.0, help="scale the number of timed requests")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts drawn")
    parser.add_argument("--out", type=Path, help="write router.json and router.png here")
    live = parser.add_argument_group("end to end: auto against a named model")
    where = live.add_mutually_exclusive_group()
    where.add_argument("--live", action="store_true", help="start bench/serving.py's app here and measure")
    where.add_argument("--base-url", help="measure a running app (its OpenAI API root)")
    live.add_argument("--model", default="chat", help="the named model `auto` is compared with")
    live.add_argument("--api-key", default="EMPTY", help="the API key sent to the live cluster")
    live.add_argument("--live-pairs", type=int, default=64, help="auto/named request pairs")
    live.add_argument("--live-output-len", type=int, default=16, help="max_tokens of each request")
    live.add_argument("--no-classifier", action="store_true", help="skip the classifier-only timings")


def build_prompt(pieces: list[str], tokens: int, count_tokens, rng: random.Random, serial: int) -> str:
    """Labelled prompts strung together until the text has about `tokens` embedding-model tokens."""
    parts = [f"Request {serial}:"]
    while count_tokens(" ".join(parts)) < tokens:
        parts.append(rng.choice(pieces))
    return " ".join(parts)


def time_case(classifier, prompts: list[list[dict]]) -> list[float]:
    classifier.classify(prompts[0])  # warm-up: first calls allocate
    millis = []
    for messages in prompts[1:]:
        start = time.perf_counter()
        classifier.classify(messages)
        millis.append((time.perf_counter() - start) * 1000)
    return millis


def conversation(latest: str) -> list[dict]:
    return [
        {"role": "system", "content": "You are a friendly assistant for the staff of a small hotel."},
        {"role": "user", "content": "Hi! I need some help preparing for the weekend."},
        {"role": "assistant", "content": "Of course, what do you need?"},
        {"role": "user", "content": "We have a wedding party of 40 guests arriving on Friday."},
        {"role": "assistant", "content": "Congratulations to them! How can I help?"},
        {"role": "user", "content": latest},
    ]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run(args: argparse.Namespace) -> int:
    result: dict[str, Any] = {}
    if not args.no_classifier:
        result = run_classifier(args)
    if args.live or args.base_url:
        result["auto_vs_named"] = run_live(args)
        print_auto_vs_named(result["auto_vs_named"])
    if args.out:
        write_json(args.out / "router.json", result)
        if "cases" in result:
            write_plot(args.out / "router.png", result)
        print(f"\nwrote {args.out / 'router.json'}" + (" and router.png" if "cases" in result else ""))
    return 0


def run_classifier(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from raylane.config import RouterConfig
    from raylane.router.classifier import SemanticClassifier
    from raylane.router.dataset import EVAL_PATH, TRAIN_PATH, read_labelled

    torch.set_num_threads(args.threads)
    machine = machine_info()
    # Rules off: a pasted code block would skip the model and time nothing; the semantic path is the cost.
    defaults = RouterConfig()
    config = defaults.model_copy(
        update={"routes": [r.model_copy(update={"keywords": [], "regex": []}) for r in defaults.routes]}
    )
    start = time.perf_counter()
    classifier = SemanticClassifier(config)
    startup_s = time.perf_counter() - start
    print(
        f"machine:    {machine['cpu']}, {machine['cores']} cores, torch {machine['torch']} "
        f"({machine['torch_threads']} threads)"
    )
    encoder = classifier.encoder
    print(
        f"classifier: MiniLM-L6 {'int8' if encoder.quantized else 'float32'}, reads <= {encoder.max_tokens} "
        f"tokens per message, {classifier.num_examples} training prompts, keyword/regex rules off; "
        f"start-up {startup_s:.1f} s\n"
    )
    rng = random.Random(args.seed)
    pieces = [text for _, text in read_labelled(TRAIN_PATH) + read_labelled(EVAL_PATH)]
    count = encoder.count_tokens
    results: dict[str, Any] = {}
    rows = []
    with OtherLoad() as load:
        for case, (tokens, n) in CASES.items():
            prompts = [build_prompt(pieces, tokens, count, rng, i) for i in range(int(n * args.repeats) + 1)]
            millis = time_case(classifier, [[{"role": "user", "content": p}] for p in prompts])
            results[case] = _summary(millis, [count(p) for p in prompts])
        short = [build_prompt(pieces, 40, count, rng, i) for i in range(int(200 * args.repeats) + 1)]
        millis = time_case(classifier, [conversation(p) for p in short])
        results["6-turn chat, history cached"] = _summary(millis, [count(p) for p in short])
    for case, r in results.items():
        rows.append([case, str(r["tokens_median"]), f"{r['p50_ms']:.1f}", f"{r['p99_ms']:.1f}", str(r["n"])])
    print("Classification latency per request (new prompt every time)")
    print_table(["prompt", "tokens", "p50 ms", "p99 ms", "requests"], rows)
    p50 = results["200 tokens"]["p50_ms"]
    verdict = "met" if p50 <= GOAL_P50_MS else "NOT met"
    print(f"200-token p50 {p50:.1f} ms on {args.threads} thread(s): goal <= {GOAL_P50_MS:g} ms {verdict}")
    print(
        f"other processes used {100 * (load.fraction or 0):.0f}% of the CPUs during the runs"
        + (": numbers are unreliable, rerun on a quiet machine" if (load.fraction or 0) > 0.1 else "")
    )
    if not (args.live or args.base_url):
        print("the gateway's added latency (auto vs a named model, end to end): --live or --base-url URL")
    return {
        "date": datetime.date.today().isoformat(),
        "machine": machine,
        "startup_s": startup_s,
        "quantized": encoder.quantized,
        "max_tokens": encoder.max_tokens,
        "other_load": load.fraction,
        "cases": results,
    }


def _summary(millis: list[float], tokens: list[int]) -> dict[str, Any]:
    return {
        "n": len(millis),
        "tokens_median": int(statistics.median(tokens)),
        "p50_ms": percentile(millis, 0.5),
        "p99_ms": percentile(millis, 0.99),
        "mean_ms": statistics.fmean(millis),
        "ms": millis,
    }


def write_plot(path: Path, result: dict[str, Any]) -> None:
    plt = pyplot()
    cases = list(result["cases"])
    fig, ax = plt.subplots(figsize=(8, 4))
    xs = range(len(cases))
    ax.bar([x - 0.2 for x in xs], [result["cases"][c]["p50_ms"] for c in cases], width=0.4, label="p50")
    ax.bar([x + 0.2 for x in xs], [result["cases"][c]["p99_ms"] for c in cases], width=0.4, label="p99")
    goal = f"goal: p50 <= {GOAL_P50_MS:g} ms (200 tokens)"
    ax.axhline(GOAL_P50_MS, color="gray", linestyle="--", label=goal)
    ax.set_xticks(list(xs), cases)
    ax.set_ylabel("ms per request")
    machine = result["machine"]
    ax.set_title(f"Router classification, {machine['cpu']}, {machine['torch_threads']} thread(s)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- end to end: auto against a named model -----------------------------------------------------


@dataclass(slots=True)
class Routed:
    """One request's timing (raylane.bench.metrics.RequestRecord) and where the gateway sent it."""

    record: RequestRecord
    pool: str | None = None
    route: str | None = None


def routing_prompts(num: int, seed: int, tokens: int = 200) -> list[str]:
    """`num` new ~`tokens`-token prompts (MiniLM tokens) built from the labelled routing prompts."""
    from tokenizers import Tokenizer

    from raylane.router.dataset import EVAL_PATH, TRAIN_PATH, read_labelled
    from raylane.router.embeddings import model_path

    tokenizer = Tokenizer.from_file(f"{model_path()}/tokenizer.json")  # the classifier's word pieces
    tokenizer.no_truncation()  # the file cuts at the model's window: a count could never reach `tokens`

    def count(text: str) -> int:
        return len(tokenizer.encode(text).ids)

    rng = random.Random(seed)
    pieces = [text for _, text in read_labelled(TRAIN_PATH) + read_labelled(EVAL_PATH)]
    return [build_prompt(pieces, tokens, count, rng, i) for i in range(num)]


async def send_routed(client, model: str, request: BenchRequest, options: RequestOptions) -> Routed:
    """Stream one chat request; its record plus the `x-raylane-pool` / `-route` response headers."""
    import openai

    clock = time.perf_counter
    sent_at = clock()
    routed = Routed(RequestRecord())
    try:
        raw = await client.chat.completions.with_raw_response.create(
            **chat_stream_args(model, request, options)
        )
        routed.pool, routed.route = raw.headers.get("x-raylane-pool"), raw.headers.get("x-raylane-route")
        routed.record = await measure_stream(raw.parse(), sent_at, clock)
    except openai.APIStatusError as e:
        routed.record = RequestRecord(error_code=str(e.status_code), error=e.message)
    except openai.APIError as e:
        routed.record = RequestRecord(error_code="connection", error=str(e))
    return routed


async def measure_auto_vs_named(
    base_url: str, api_key: str, named: str, prompts: list[str], output_len: int, warmup: int = 2
) -> list[tuple[Routed, Routed]]:
    """(auto, named) per prompt, each pair back to back, the order alternating; `warmup` pairs first."""
    import openai

    options = RequestOptions(temperature=0.0, ignore_eos=True)
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=600)

    def request(tag: str, prompt: str) -> BenchRequest:
        # Different first words: the pair's second request finds no prefix of the first in the cache.
        return BenchRequest([{"role": "user", "content": f"{tag} {prompt}"}], 0, output_len)

    try:
        for prompt in prompts[:warmup]:
            for model in ("auto", named):
                warm = await send_routed(client, model, request("Warm", prompt), options)
                if not warm.record.ok:
                    where = f"{base_url} (model {model!r})"
                    raise RuntimeError(f"warm-up request to {where} failed: {warm.record.error}")
        pairs = []
        for i, prompt in enumerate(prompts[warmup:]):
            order = ("auto", named) if i % 2 == 0 else (named, "auto")
            first = await send_routed(client, order[0], request("A", prompt), options)
            second = await send_routed(client, order[1], request("B", prompt), options)
            pairs.append((first, second) if order[0] == "auto" else (second, first))
        return pairs
    finally:
        await client.close()


def summarize_auto_vs_named(pairs: list[tuple[Routed, Routed]]) -> dict[str, Any]:
    """p50/p99 of TTFT and E2E (ms) of both, over pairs both served from the same pool; differences."""
    compared = [(a, n) for a, n in pairs if a.record.ok and n.record.ok and a.pool == n.pool]
    routes: dict[str, int] = {}
    for a, _ in pairs:
        routes[a.route or "?"] = routes.get(a.route or "?", 0) + 1
    result: dict[str, Any] = {
        "pairs": len(pairs),
        "compared": len(compared),
        "errors": sum((not a.record.ok) + (not n.record.ok) for a, n in pairs),
        "other_pool": sum(a.pool != n.pool for a, n in pairs if a.record.ok and n.record.ok),
        "auto_routes": routes,
    }
    for metric in ("ttft", "e2e"):
        auto = latency_stats_ms([getattr(a.record, metric) for a, _ in compared])
        named = latency_stats_ms([getattr(n.record, metric) for _, n in compared])
        paired = [(getattr(a.record, metric) - getattr(n.record, metric)) * 1e3 for a, n in compared]
        result[metric] = {
            "auto": auto,
            "named": named,
            "added_p50_ms": auto["p50"] - named["p50"],
            "added_p99_ms": auto["p99"] - named["p99"],
            "paired_difference_p50_ms": metrics_percentile(paired, 50),
        }
    result["goal_ms"] = GOAL_AUTO_ADDED_MS
    result["goal_met"] = result["e2e"]["added_p50_ms"] <= GOAL_AUTO_ADDED_MS
    return result


def auto_vs_named_rows(summary: dict[str, Any]) -> list[list[str]]:
    rows = []
    for metric in ("ttft", "e2e"):
        s = summary[metric]
        for side in ("named", "auto"):
            rows.append([f"{metric.upper()} {side}", f"{s[side]['p50']:.1f}", f"{s[side]['p99']:.1f}"])
        added = [f"{s['added_p50_ms']:+.1f}", f"{s['added_p99_ms']:+.1f}"]
        rows.append([f"{metric.upper()} auto - named", *added])
    return rows


def auto_vs_named_verdict(summary: dict[str, Any]) -> str:
    added = summary["e2e"]["added_p50_ms"]
    state = "met" if summary["goal_met"] else "NOT met"
    return f"auto adds {added:.1f} ms to E2E p50: goal <= {GOAL_AUTO_ADDED_MS:g} ms {state}"


def run_live(args: argparse.Namespace) -> dict[str, Any]:
    """The live measurement against --base-url, or against bench/serving.py's app started here."""
    from raylane.bench.apps import LocalServe
    from raylane.bench.serving import serving_config

    prompts = routing_prompts(args.live_pairs + 2, args.seed + 1)
    with contextlib.ExitStack() as stack:
        if args.live:
            local = stack.enter_context(LocalServe())
            base_url = local.deploy({"router": serving_config()})["router"] + "/v1"
        else:
            base_url = args.base_url
        with OtherLoad(process_tree_cpu_s) as load:
            pairs = asyncio.run(
                measure_auto_vs_named(base_url, args.api_key, args.model, prompts, args.live_output_len)
            )
    return {
        "base_url": base_url,
        "named_model": args.model,
        "machine": machine_info(),
        "summary": summarize_auto_vs_named(pairs),
        "other_load": load.fraction,
        "records": [[asdict(a), asdict(n)] for a, n in pairs],
    }


def print_auto_vs_named(live: dict[str, Any]) -> None:
    s = live["summary"]
    print(
        f"\nauto vs {live['named_model']!r} end to end at {live['base_url']}: "
        f"{s['compared']} of {s['pairs']} pairs compared (alternated; auto served by another pool: "
        f"{s['other_pool']}, errors: {s['errors']})"
    )
    print(f"auto's routes: {', '.join(f'{r} {n}' for r, n in sorted(s['auto_routes'].items()))}")
    print_table(["latency (ms)", "p50", "p99"], auto_vs_named_rows(s))
    print(auto_vs_named_verdict(s))
    print(f"other processes used {100 * (live['other_load'] or 0):.0f}% of the CPUs during the run")
