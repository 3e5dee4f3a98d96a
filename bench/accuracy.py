"""`raylane bench accuracy`: what the quantized weight forms cost in answers, on the real model.

SmolLM2-135M-Instruct from its packaged GGUF, float32 against each `--quantization` form of the same
file, teacher-forced: the first human turn of `--num-seqs` ShareGPT conversations in the chat template,
then the first `--reply-tokens` tokens of the reply that followed it. At every reply position both
models have seen the same tokens; the table gives how often the quantized model's top token is
float32's (top-1 agreement) and its mean |logit error| over the standard deviation of float32's logits.

Every call goes through the decode kernels (calls of any size, as a decode step's are), so the figures
are decode's: raylane's int4/int8 kernels (int8 activations per 32 inputs, as llama.cpp's) and, with
`--kernels raylane,torch`, torch's (bfloat16 activations) for the same weights. Prefill's dense path
multiplies by the dequantized weights (bfloat16 on AVX512-BF16 CPUs).

    raylane bench accuracy [--quantization int8,int4] [--kernels raylane,torch] [--num-seqs 40]
"""

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raylane.bench.common import machine_info, print_table, write_json

if TYPE_CHECKING:
    import torch

MODEL = "smollm2-135m-instruct"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quantization", default="int8,int4", help="weight forms, comma-separated")
    parser.add_argument("--kernels", default="raylane,torch", help="decode kernels: raylane and/or torch")
    parser.add_argument("--num-seqs", type=int, default=40, help="ShareGPT conversations")
    parser.add_argument("--reply-tokens", type=int, default=128, help="reply tokens scored per conversation")
    parser.add_argument("--out", type=Path, help="folder to write accuracy.json into")


def sequences(path: str, num: int, reply_tokens: int) -> list[tuple[list[int], list[int]]]:
    """(chat-template prompt, first reply tokens) of the first ShareGPT pairs whose prompt fits 384
    tokens and whose reply has at least 32."""
    from transformers import AutoTokenizer

    from raylane.bench.datasets import sharegpt_pairs
    from raylane.models.gguf import checkpoint_dir

    tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir(path))
    seqs = []
    for ask, reply in sharegpt_pairs():
        messages = [{"role": "user", "content": ask}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        answer = tokenizer(reply, add_special_tokens=False)["input_ids"][:reply_tokens]
        if len(prompt) <= 384 and len(answer) >= 32:
            seqs.append((prompt, answer))
        if len(seqs) == num:
            return seqs
    raise ValueError(f"ShareGPT has only {len(seqs)} conversations that fit")


def reply_logits(
    path: str, quantization: str | None, seqs: list[tuple[list[int], list[int]]]
) -> "torch.Tensor":
    """Logits at every reply position (predicting the next reply token), all sequences concatenated."""
    import torch

    from raylane.config import EngineConfig
    from raylane.engine.model_runner import ModelInput, ModelRunner

    longest = max(len(p) + len(r) for p, r in seqs)
    blocks = -(-longest // 16)
    runner = ModelRunner(
        EngineConfig(model=path, num_kv_blocks=blocks, block_size=16, quantization=quantization)
    )
    runner.allocate_kv_cache(blocks)
    out = []
    for prompt, reply in seqs:
        tokens = prompt + reply
        n = len(tokens)
        rows = list(range(len(prompt) - 1, n - 1))
        out.append(
            runner.execute_model(
                ModelInput(tokens, list(range(n)), [list(range(-(-n // 16)))], [n], [n], rows)
            )
        )
    return torch.cat(out)


def run(args: argparse.Namespace) -> int:
    from raylane.models.packaged import packaged_model_path
    from raylane.parallel import cpu_kernels, int4, quantization

    kernels = args.kernels.split(",")
    if unknown := set(kernels) - {"raylane", "torch"}:
        print(f"raylane bench accuracy: --kernels takes raylane and/or torch, not {sorted(unknown)}")
        return 1
    path = str(packaged_model_path(MODEL))
    machine = machine_info()
    print(f"machine: {machine['cpu']}, {machine['cores']} cores, torch {machine['torch']}")
    seqs = sequences(path, args.num_seqs, args.reply_tokens)
    saved = int4.DENSE_MIN_TOKENS, quantization.DENSE_MIN_TOKENS, cpu_kernels.quantized_gemv_supported()
    # Every call of the measurement through the decode kernels, however many rows it has.
    int4.DENSE_MIN_TOKENS = quantization.DENSE_MIN_TOKENS = 1 << 30
    rows: list[dict[str, Any]] = []
    try:
        reference = reply_logits(path, None, seqs)
        for kernel in kernels:
            if kernel == "raylane" and not saved[2]:
                print("raylane's kernels do not run here: skipped")
                continue
            cpu_kernels._gemv = kernel == "raylane" and saved[2]  # read at quantization and at each call
            for form in args.quantization.split(","):
                logits = reply_logits(path, form, seqs)
                agreement = float((logits.argmax(-1) == reference.argmax(-1)).float().mean())
                error = float((logits - reference).abs().mean() / reference.std())
                rows.append(
                    {"weights": form, "kernel": kernel, "top1_agreement": agreement, "logit_error": error}
                )
    finally:
        int4.DENSE_MIN_TOKENS, quantization.DENSE_MIN_TOKENS, cpu_kernels._gemv = saved
    print(f"model: {MODEL}; {len(seqs)} ShareGPT replies, {reference.shape[0]} positions scored")
    print_table(
        ["weights", "decode kernel", "top-1 = float32's", "|logit error| / std"],
        [[r["weights"], r["kernel"], f"{r['top1_agreement']:.1%}", f"{r['logit_error']:.3f}"] for r in rows],
    )
    if args.out:
        report = {"benchmark": "accuracy", "machine": machine, "model": MODEL, "sequences": len(seqs)}
        write_json(args.out / "accuracy.json", report | {"positions": reference.shape[0], "rows": rows})
        print(f"wrote {args.out / 'accuracy.json'}")
    return 0
