"""`raylane bench affinity`: prefix-aware replica routing against Serve's default router.

One pool of two replicas serves a workload of a few long system prompts shared by many users, each
request one short user turn, at concurrency 8, under raylane's router (`routing.policy:
prefix_aware`, deployments/gateway/request_router.py) and under Serve's default (`serve_default`: power of
two choices on queue length). Both are the same pool config in two apps of one in-process Ray + Serve
(bench/apps.py), sent the same requests, alternated batch by batch (the order swapped every round), so
a slow spell of the machine hits both. A third app, one replica with the KV cache of both (twice the
blocks), gives the hit rate of a cache that sees every request: the reference the pool is held to.

The KV cache is sized so that one replica holds about half the system prompts (`--kv-blocks`): a
router that sends every prompt to every replica makes each replica evict what the other could have
kept, which is how a pool of two loses to one replica of the same total cache.

Per app: the prefix-cache hit rate (prompt tokens found cached / prompt tokens, from each response's
`usage.prompt_tokens_details.cached_tokens`), the prompt tokens computed (prompt - cached) and the mean
TTFT (request sent -> first generated text, streamed with the `openai` client). Goals (issue #25): hit
rate >= 0.9x the single replica's; prompt tokens computed >= 1.5x fewer and mean TTFT >= 1.5x lower
than under Serve's default router.

    raylane bench affinity                       # the demo Llama; 2-5 minutes on two shared cores
    raylane bench affinity --rounds 4 --out /tmp/affinity.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raylane.bench.common import OtherLoad, client_machine, print_table, process_tree_cpu_s, write_json
from raylane.config import ClusterConfig

DEMO_MODEL = "demo:raylane-llama-tiny"
APPS = {"raylane": "prefix_aware", "serve-default": "serve_default", "single": "prefix_aware"}
HIT_RATE_GOAL, COMPUTED_GOAL, TTFT_GOAL = 0.9, 1.5, 1.5
TOPICS = [
    "a bicycle shop",
    "a public library",
    "a dental clinic",
    "an airline's baggage desk",
    "a university's admissions office",
    "a solar panel installer",
    "a city's recycling service",
    "a cooking school",
    "a mobile phone carrier",
    "a veterinary hospital",
    "a hotel front desk",
    "a tax advisory firm",
]
RULES = [
    "Greet the customer by name when they give one and keep a calm, friendly tone.",
    "Never promise a price, a date or a refund that the policies below do not state.",
    "When a question falls outside the policies, say so and offer to open a ticket.",
    "Answer in at most three sentences unless the customer asks for details.",
    "Quote the exact opening hours and addresses from the facts section when asked.",
    "If the customer is upset, acknowledge it before answering the question itself.",
    "Do not ask for passwords, full card numbers or other secrets under any circumstances.",
    "Use the customer's language; if unsure, answer in English and offer to switch.",
]


def system_prompt(topic: str, index: int, chars: int) -> str:
    """A long support persona for `topic`: rules and numbered facts, about `chars` characters."""
    rng = random.Random(index)
    lines = [f"You are the virtual assistant of {topic} (desk {index}). Follow these rules:"]
    lines += [f"- {rule}" for rule in rng.sample(RULES, len(RULES))]
    fact = 0
    while sum(len(line) + 1 for line in lines) < chars:
        fact += 1
        item, team, ref = rng.randint(100, 999), rng.choice("ABCDEFG"), rng.randint(1000, 9999)
        opens, closes = rng.randint(7, 10), rng.randint(16, 20)
        lines.append(
            f"Fact {fact} for {topic}: item {item} is handled by team {team} on weekdays "
            f"from {opens}:00 to {closes}:00, reference {ref}."
        )
    return "\n".join(lines)


QUESTIONS = [
    "When are you open on Saturday?",
    "Can I change my appointment?",
    "Who handles item {n}?",
    "Is there a fee for that?",
    "My name is {name}, what do you need from me?",
    "Can you open a ticket for me?",
    "Where do I find reference {n}?",
    "Do you have anything in Spanish?",
]
NAMES = ["Ana", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jon"]


@dataclass(frozen=True, slots=True)
class Request:
    messages: list[dict[str, str]]


def workload(prompts: int, rounds: int, per_round: int, chars: int, seed: int) -> list[list[Request]]:
    """`rounds` batches of `per_round` requests: a random system prompt each, a short user turn."""
    systems = [system_prompt(TOPICS[i % len(TOPICS)], i, chars) for i in range(prompts)]
    rng = random.Random(seed)
    batches = []
    for _ in range(rounds):
        batch = []
        for _ in range(per_round):
            question = rng.choice(QUESTIONS).format(n=rng.randint(100, 999), name=rng.choice(NAMES))
            messages = [
                {"role": "system", "content": rng.choice(systems)},
                {"role": "user", "content": question},
            ]
            batch.append(Request(messages))
        batches.append(batch)
    return batches


def pool_config(
    policy: str, replicas: int, kv_blocks: int, model: str, routing: dict[str, Any] | None = None
) -> ClusterConfig:
    engine = {"max_num_seqs": 8, "num_kv_blocks": kv_blocks, "cpus_per_rank": 0.5, "seed": 0}
    return ClusterConfig.from_dict(
        {
            "gateway": {"num_cpus": 0.1},
            "embeddings": {"enabled": False},
            "pools": [
                {
                    "name": "chat",
                    "model": model,
                    "engine": engine,
                    "replicas": {"min_replicas": replicas, "max_replicas": replicas},
                    "routing": {"policy": policy, **(routing or {})},
                }
            ],
            "tiers": [{"name": "bench", "priority": 0, "max_queue_depth": 1024, "max_queue_wait_s": 600}],
            "api_keys": {"default_tier": "bench"},
        }
    )


@dataclass(slots=True)
class Sample:
    ttft: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


async def send(client, request: Request, max_tokens: int) -> Sample:
    sample = Sample()
    sent = time.perf_counter()
    try:
        stream = await client.chat.completions.create(
            model="chat",
            messages=request.messages,
            max_tokens=max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            if sample.ttft is None and any(c.delta and c.delta.content for c in chunk.choices):
                sample.ttft = time.perf_counter() - sent
            if chunk.usage is not None:
                sample.prompt_tokens = chunk.usage.prompt_tokens
                details = chunk.usage.prompt_tokens_details
                sample.cached_tokens = (details.cached_tokens or 0) if details else 0
    except Exception as e:  # a failed request is reported, not retried
        sample.error = f"{type(e).__name__}: {e}"
    return sample


async def run_batch(client, batch: list[Request], concurrency: int, max_tokens: int) -> list[Sample]:
    limit = asyncio.Semaphore(concurrency)

    async def one(request: Request) -> Sample:
        async with limit:
            return await send(client, request, max_tokens)

    return list(await asyncio.gather(*(one(r) for r in batch)))


def summarize(samples: list[Sample]) -> dict[str, Any]:
    ok = [s for s in samples if s.error is None]
    prompt = sum(s.prompt_tokens for s in ok)
    cached = sum(s.cached_tokens for s in ok)
    ttfts = [s.ttft for s in ok if s.ttft is not None]
    return {
        "requests": len(samples),
        "errors": len(samples) - len(ok),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "computed_tokens": prompt - cached,
        "hit_rate": cached / prompt if prompt else 0.0,
        "mean_ttft_s": sum(ttfts) / len(ttfts) if ttfts else None,
    }


def goals(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    ours, default, single = results["raylane"], results["serve-default"], results["single"]
    hit = ours["hit_rate"] / single["hit_rate"] if single["hit_rate"] else None
    computed = default["computed_tokens"] / ours["computed_tokens"] if ours["computed_tokens"] else None
    ttft = (
        default["mean_ttft_s"] / ours["mean_ttft_s"]
        if ours["mean_ttft_s"] and default["mean_ttft_s"]
        else None
    )
    return {
        "hit_rate_vs_single": {
            "value": hit,
            "goal": HIT_RATE_GOAL,
            "met": hit is not None and hit >= HIT_RATE_GOAL,
        },
        "computed_fewer_x": {
            "value": computed,
            "goal": COMPUTED_GOAL,
            "met": computed is not None and computed >= COMPUTED_GOAL,
        },
        "ttft_lower_x": {"value": ttft, "goal": TTFT_GOAL, "met": ttft is not None and ttft >= TTFT_GOAL},
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEMO_MODEL, help="the pool's model (default: the demo Llama)")
    parser.add_argument("--prompts", type=int, default=8, help="distinct system prompts")
    parser.add_argument("--prompt-chars", type=int, default=2000, help="characters per system prompt")
    parser.add_argument("--rounds", type=int, default=6, help="batches per app, alternated")
    parser.add_argument("--per-round", type=int, default=16, help="requests per batch")
    parser.add_argument("--concurrency", type=int, default=8, help="conversations at once")
    parser.add_argument("--max-tokens", type=int, default=8, help="output tokens of each turn")
    parser.add_argument(
        "--kv-blocks", type=int, default=320, help="KV blocks per replica of the pool (the single: twice)"
    )
    parser.add_argument(
        "--max-imbalance",
        type=int,
        default=None,
        help="routing.max_imbalance of raylane's pool (default: the config's)",
    )
    parser.add_argument(
        "--queue-weight",
        type=float,
        default=None,
        help="routing.queue_weight of raylane's pool (default: the config's)",
    )
    parser.add_argument(
        "--kv-weight",
        type=float,
        default=None,
        help="routing.kv_weight of raylane's pool (default: the config's)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the conversations' prompts")
    parser.add_argument(
        "--out", type=Path, default=Path("bench/results/affinity.json"), help="where the JSON goes"
    )


def routing_overrides(args: argparse.Namespace) -> dict[str, Any]:
    knobs = {
        "max_imbalance": args.max_imbalance,
        "queue_weight": args.queue_weight,
        "kv_weight": args.kv_weight,
    }
    return {k: v for k, v in knobs.items() if v is not None}


def run(args: argparse.Namespace) -> int:
    from raylane.bench.apps import LocalServe

    batches = workload(args.prompts, args.rounds, args.per_round, args.prompt_chars, args.seed)
    configs = {
        "raylane": pool_config("prefix_aware", 2, args.kv_blocks, args.model, routing_overrides(args)),
        "serve-default": pool_config("serve_default", 2, args.kv_blocks, args.model),
        "single": pool_config("prefix_aware", 1, 2 * args.kv_blocks, args.model),
    }
    with LocalServe() as serve, OtherLoad(process_tree_cpu_s) as other:
        urls = serve.deploy(configs)
        samples = asyncio.run(alternate(urls, batches, args.concurrency, args.max_tokens))
    results = {name: summarize(s) for name, s in samples.items()}
    report = {
        "benchmark": "affinity",
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


async def alternate(
    urls: dict[str, str], batches, concurrency: int, max_tokens: int
) -> dict[str, list[Sample]]:
    import openai

    clients = {
        name: openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0, timeout=600)
        for name, url in urls.items()
    }
    samples: dict[str, list[Sample]] = {name: [] for name in urls}
    order = list(urls)
    for r, batch in enumerate(batches):
        for name in order[r % len(order) :] + order[: r % len(order)]:  # who goes first rotates
            samples[name] += await run_batch(clients[name], batch, concurrency, max_tokens)
    return samples


def print_report(report: dict[str, Any]) -> None:
    machine = report["machine"]
    other = report["other_load"]
    print(f"machine: {machine}; other load: {'-' if other is None else f'{other:.0%}'}")
    rows = []
    single = report["results"]["single"]["hit_rate"]
    for name, r in report["results"].items():
        label = {
            "raylane": "2 replicas, raylane's router",
            "serve-default": "2 replicas, Serve's default router",
        }
        rows.append(
            [
                label.get(name, "1 replica, twice the KV cache (reference)"),
                f"{r['hit_rate']:.2f}",
                f"{r['hit_rate'] / single:.2f}x" if single else "-",
                f"{r['computed_tokens']:,}",
                f"{r['mean_ttft_s'] * 1000:.0f}" if r["mean_ttft_s"] is not None else "-",
                f"{r['requests']} ({r['errors']} errors)",
            ]
        )
    print_table(
        ["router", "hit rate", "vs single", "prompt tokens computed", "mean TTFT ms", "requests"], rows
    )
    for name, goal in report["goals"].items():
        value = "-" if goal["value"] is None else f"{goal['value']:.2f}"
        print(f"{name}: {value} (goal {goal['goal']}): {'met' if goal['met'] else 'NOT met'}")
