"""`raylane bench router`: how long the semantic classifier takes to route one request.

Goal: p50 <= 10 ms on one CPU core for a ~200-token prompt. Every timed prompt is new (built
from the project's labelled prompts, never repeated), so the classifier's embedding cache does
not flatter the numbers; the multi-turn case shows what that cache does for a conversation
that resends its system prompt and earlier turns. The gateway's added latency (end-to-end
minus engine time, `auto` against a named model) needs a live app and is not measured here.
"""

import argparse
import datetime
import random
import statistics
import time
from pathlib import Path
from typing import Any

from bench.common import OtherLoad, machine_info, print_table, pyplot, write_json

# case -> (approximate prompt tokens, timed requests)
CASES = {"short": (15, 300), "200 tokens": (200, 200), "2,000 tokens": (2000, 100)}
GOAL_P50_MS = 10.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (the goal is for one core)")
    parser.add_argument("--repeats", type=float, default=1.0, help="scale the number of timed requests")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write router.json and router.png here")


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
    import torch

    from cluster.router_config import RouterConfig
    from router.classifier import SemanticClassifier
    from router.dataset import EVAL_PATH, TRAIN_PATH, read_labelled

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
    print("gateway-added latency (auto vs a named model): not measured here, it needs a live app")
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": machine,
        "startup_s": startup_s,
        "quantized": encoder.quantized,
        "max_tokens": encoder.max_tokens,
        "other_load": load.fraction,
        "cases": results,
    }
    if args.out:
        write_json(args.out / "router.json", result)
        write_plot(args.out / "router.png", result)
        print(f"\nwrote {args.out / 'router.json'} and {args.out / 'router.png'}")
    return 0


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
