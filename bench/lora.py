"""`raylane bench lora`: many LoRA adapters on one engine against the base model alone.

Two engines in this process on the same checkpoint (by default the packaged SmolLM2-135M-Instruct,
float32): the base model, and the base with `enable_lora` holding `--adapters` adapters of rank
`--rank` on every projection (made here by PEFT with random weights: what they compute does not
matter, what they cost does). The same batch of requests (`--requests` prompts of `--prompt-tokens`,
`--max-tokens` each, EOS ignored) runs on the base engine without adapters and on the LoRA engine
spread round-robin over the adapters, alternated `--rounds` times; the table gives output tokens/s
and the ratio. Memory: the weights one engine holds (its parameters and packed copies, adapter slots
included) against what `--adapters` single-adapter engines would hold (the base weights each, plus
one slot). The KV cache is left out of both: it is per request, not per adapter.

With `--hot`, a second part in Ray Serve: one pool of two replicas serving the same adapters (the
gateway's adapter-aware replica routing, deployments/gateway/request_router.py). Two workloads are
alternated batch by batch through the `openai` client at `--concurrency`: an even mix over the
adapters, and a hot one, 80% of requests to `adapter-0` and the rest spread over the others. It
reports the hot adapter's p50 time to first token against the even mix's, and which replicas hold
each adapter afterwards (their routing stats): a popular adapter should be on both, not pinned to one.

    raylane bench lora [--adapters 8] [--rank 8] [--requests 32] [--max-tokens 64] [--out DIR]
    raylane bench lora --hot [--hot-rounds 4] [--out DIR]
"""

import argparse
import random
import tempfile
import time
from pathlib import Path

from raylane.bench.common import machine_info, print_table, write_json

SETTINGS = ("adapters", "rank", "requests", "prompt_tokens", "max_tokens", "rounds")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a .gguf file or a packaged model")
    parser.add_argument("--adapters", type=int, default=8, help="LoRA adapters loaded and mixed in the batch")
    parser.add_argument("--rank", type=int, default=8, help="each adapter's rank")
    parser.add_argument("--requests", type=int, default=32, help="requests per round")
    parser.add_argument("--prompt-tokens", type=int, default=96, help="tokens in each prompt")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens of each request")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per setting, alternated")
    parser.add_argument("--out", type=Path, help="folder to write lora.json (lora_hot.json) into")
    parser.add_argument("--hot", action="store_true", help="the two-replica hot-adapter run instead")
    parser.add_argument("--hot-rounds", type=int, default=4, help="batches per workload, alternated")
    parser.add_argument("--concurrency", type=int, default=8, help="requests at once")


def make_adapters(checkpoint: str, folder: Path, count: int, rank: int) -> list[str]:
    """PEFT adapters for `checkpoint`'s architecture (random A and B, an update of modest size)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(checkpoint)
    paths = []
    for i in range(count):
        torch.manual_seed(i)
        model = AutoModelForCausalLM.from_config(config)  # only the shapes matter to the adapter
        peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS))
        with torch.no_grad():
            for name, p in peft.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.01)
        peft.save_pretrained(folder / f"adapter-{i}")
        paths.append(str(folder / f"adapter-{i}"))
    return paths


def run(args: argparse.Namespace) -> int:
    if args.hot:
        return run_hot(args)
    import torch

    from raylane.engine import LLM, LoRARequest, SamplingParams
    from raylane.models.gguf import checkpoint_dir

    path = Path(args.model)
    if not path.is_file():
        from raylane.models.packaged import packaged_model_path

        path = packaged_model_path(args.model)
    folder = Path(tempfile.mkdtemp(prefix="raylane-lora-bench-"))
    adapters = [
        LoRARequest(f"adapter-{i}", i + 1, p)
        for i, p in enumerate(make_adapters(checkpoint_dir(path), folder, args.adapters, args.rank))
    ]
    generator = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(100, 40000, (args.prompt_tokens,), generator=generator).tolist()
        for _ in range(args.requests)
    ]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    engine = dict(max_num_seqs=args.requests, kv_cache_memory_gb=1.0, max_model_len=1024)
    base = LLM(str(path), **engine)
    lora = LLM(str(path), enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank, **engine)
    per_request = [adapters[i % len(adapters)] for i in range(args.requests)]
    for llm, loras in ((base, None), (lora, per_request)):  # warm-up: the adapters load here
        llm.generate(prompts, params, lora_request=loras)
    tokens_s: dict[str, list[float]] = {"base": [], "lora": []}
    for _ in range(args.rounds):
        for name, llm, loras in (("base", base, None), ("lora", lora, per_request)):
            start = time.perf_counter()
            outs = llm.generate(prompts, params, lora_request=loras)
            elapsed = time.perf_counter() - start
            tokens_s[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / elapsed)
    base_bytes, lora_bytes = base.engine.runner.weight_bytes(), lora.engine.runner.weight_bytes()
    slot_bytes = (lora_bytes - base_bytes) / args.adapters
    separate = args.adapters * (base_bytes + slot_bytes)
    machine = machine_info()
    print(f"machine: {machine['cpu']}, {machine['cores']} cores; model: {path.name}, float32")
    print(
        f"{args.requests} requests of {args.prompt_tokens} prompt + {args.max_tokens} output tokens; "
        f"{args.adapters} adapters of rank {args.rank} on q/k/v/o/gate/up/down"
    )
    best = {name: max(v) for name, v in tokens_s.items()}
    print_table(
        ["run", "output tokens/s (best of rounds)", "all rounds"],
        [
            ["base model alone", f"{best['base']:.1f}", ", ".join(f"{v:.1f}" for v in tokens_s["base"])],
            [
                f"{args.adapters} adapters, mixed",
                f"{best['lora']:.1f}",
                ", ".join(f"{v:.1f}" for v in tokens_s["lora"]),
            ],
            ["ratio", f"{best['lora'] / best['base']:.2f}x", ""],
        ],
    )
    print_table(
        ["weights held", "MiB"],
        [
            ["one engine, base + all adapters' slots", f"{lora_bytes / 2**20:.0f}"],
            [f"{args.adapters} single-adapter engines", f"{separate / 2**20:.0f}"],
            ["ratio", f"{lora_bytes / separate:.2f}x"],
        ],
    )
    if args.out:
        write_json(
            args.out / "lora.json",
            {
                "machine": machine,
                "model": str(path),
                "settings": {k: getattr(args, k) for k in SETTINGS},
                "tokens_s": tokens_s,
                "weight_bytes": {"base": base_bytes, "lora": lora_bytes, "separate": separate},
            },
        )
    return 0


HOT_SHARE = 0.8
QUESTIONS = [
    "Name a fruit that is yellow.",
    "What is the capital of France?",
    "Write a haiku about rain.",
    "How many legs does a spider have?",
    "Give me a synonym for happy.",
    "What colour is the sky on a clear day?",
    "Suggest a name for a cat.",
    "What is two plus three?",
]


def hot_workload(adapters: int, per_round: int, hot: bool, seed: int) -> list[tuple[str, str]]:
    """(model, question) pairs: an even mix over the adapters, or HOT_SHARE of them to adapter-0."""
    rng = random.Random(seed)
    models = []
    for i in range(per_round):
        if hot:
            cold = f"adapter-{1 + rng.randrange(adapters - 1)}"
            models.append("adapter-0" if rng.random() < HOT_SHARE else cold)
        else:
            models.append(f"adapter-{i % adapters}")
    return [(m, QUESTIONS[rng.randrange(len(QUESTIONS))]) for m in models]


def run_hot(args: argparse.Namespace) -> int:
    import asyncio
    import statistics

    from raylane.bench.apps import LocalServe
    from raylane.config import ClusterConfig
    from raylane.models.gguf import checkpoint_dir

    path = Path(args.model) if Path(args.model).is_file() else None
    if path is None:
        from raylane.models.packaged import packaged_model_path

        path = packaged_model_path(args.model)
    folder = Path(tempfile.mkdtemp(prefix="raylane-lora-bench-"))
    paths = make_adapters(checkpoint_dir(path), folder, args.adapters, args.rank)
    engine = {"max_num_seqs": 16, "kv_cache_memory_gb": 0.25, "max_model_len": 1024, "cpus_per_rank": 0.5}
    engine |= {"max_loras": args.adapters, "max_lora_rank": args.rank}
    config = ClusterConfig.from_dict(
        {
            "gateway": {"num_cpus": 0.1},
            "embeddings": {"enabled": False},
            "pools": [
                {
                    "name": "chat",
                    "model": str(path),
                    "engine": engine,
                    "replicas": {"min_replicas": 2, "max_replicas": 2},
                    "adapters": {f"adapter-{i}": p for i, p in enumerate(paths)},
                }
            ],
            "tiers": [{"name": "bench", "priority": 0, "max_queue_depth": 1024, "max_queue_wait_s": 600}],
            "api_keys": {"default_tier": "bench"},
        }
    )
    ttfts: dict[str, dict[str, list[float]]] = {"even": {}, "hot": {}}
    with LocalServe() as serve:
        url = serve.deploy({"lora": config})["lora"]
        for round_ in range(args.hot_rounds):
            for name in ("even", "hot") if round_ % 2 == 0 else ("hot", "even"):
                batch = hot_workload(args.adapters, 4 * args.concurrency, name == "hot", seed=round_)
                for model, ttft in asyncio.run(_send_all(url, batch, args.concurrency)):
                    ttfts[name].setdefault(model, []).append(ttft)
        holders = _replicas_holding(serve)
    hot = ttfts["hot"]["adapter-0"]
    hot_p50 = statistics.median(hot)
    even_p50 = statistics.median([t for v in ttfts["even"].values() for t in v])
    machine = machine_info()
    print(f"machine: {machine['cpu']}, {machine['cores']} cores; model: {path.name}; 2 replicas")
    print_table(
        ["workload", "requests", "p50 TTFT s"],
        [
            ["even mix over the adapters", str(sum(map(len, ttfts["even"].values()))), f"{even_p50:.3f}"],
            [
                f"hot: adapter-0 ({HOT_SHARE:.0%} of requests)",
                str(len(ttfts["hot"]["adapter-0"])),
                f"{hot_p50:.3f}",
            ],
            ["ratio hot / even", "", f"{hot_p50 / even_p50:.2f}x"],
        ],
    )
    print_table(["replica", "adapters resident"], [[pid, ", ".join(names)] for pid, names in holders.items()])
    if args.out:
        write_json(
            args.out / "lora_hot.json",
            {"machine": machine, "model": str(path), "ttft_s": ttfts, "holders": holders},
        )
    return 0


async def _send_all(url: str, batch: list[tuple[str, str]], concurrency: int) -> list[tuple[str, float]]:
    import asyncio

    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=300)
    limit = asyncio.Semaphore(concurrency)

    async def one(model: str, question: str) -> tuple[str, float]:
        async with limit:
            sent = time.perf_counter()
            stream = await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": question}],
                max_tokens=16,
                temperature=0,
                stream=True,
            )
            ttft = None
            async for chunk in stream:
                if ttft is None and any(c.delta and c.delta.content for c in chunk.choices):
                    ttft = time.perf_counter() - sent
            return model, ttft if ttft is not None else time.perf_counter() - sent

    try:
        return list(await asyncio.gather(*(one(m, q) for m, q in batch)))
    finally:
        await client.close()


def _replicas_holding(serve) -> dict[str, list[str]]:
    """Each replica's resident adapters (its `stats`, asked until both replicas answered)."""
    from ray import serve as ray_serve

    from raylane.bench.apps import APP_PREFIX
    from raylane.deployments.app import pool_deployment_name

    handle = ray_serve.get_deployment_handle(pool_deployment_name("chat"), app_name=APP_PREFIX + "lora")
    holders: dict[str, list[str]] = {}
    for _ in range(40):
        stats = handle.stats.remote().result(timeout_s=30)
        holders[str(stats["pid"])] = sorted(f"adapter-{i - 1}" for i in stats["lora_ids"])
        if len(holders) == 2:
            break
    return holders
