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

    raylane bench lora [--adapters 8] [--rank 8] [--requests 32] [--max-tokens 64] [--out DIR]
"""

import argparse
import tempfile
import time
from pathlib import Path

from raylane.bench.common import machine_info, print_table, write_json

SETTINGS = ("adapters", "rank", "requests", "prompt_tokens", "max_tokens", "rounds")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a .gguf file or a packaged model")
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, help="folder to write lora.json into")


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
