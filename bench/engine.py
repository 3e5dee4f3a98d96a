"""`raylane bench engine`: raylane's offline throughput against Hugging Face `generate`, and the
engine's per-step overhead over a bare forward pass.

Goals: raylane >= 3x HF's useful output tokens/s on a ~50M-parameter model on two CPU cores, and an
engine decode step <= 25% slower than a bare forward of the same batch. bench/README.md defines
every number; the model is a random-weight Llama written locally, so nothing is downloaded.
"""

import argparse
import datetime
import math
import os
import random
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raylane.bench.common import OtherLoad, machine_info, print_table, pyplot, summary, timed, write_json

MODEL_NAME = "raylane-bench-llama-50m"
# ~50M parameters: small enough for two CPU cores, big enough that matmuls, not Python, should dominate.
MODEL_SHAPE = dict(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1792,
    num_hidden_layers=12,
    num_attention_heads=8,
    num_key_value_heads=4,  # GQA, as in the models raylane serves
    head_dim=64,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)
PROMPT_LEN_RANGE = (32, 256)  # uniform
OUTPUT_LEN_MEDIAN, OUTPUT_LEN_SIGMA, OUTPUT_LEN_RANGE = 64, 0.8, (8, 256)  # lognormal, clipped
WARMUP_STEPS = 3
RUN_LABELS = {  # (table, plot)
    "hf": ("HF generate", "HF generate"),
    "raylane": ("raylane LLM.generate", "raylane"),
    "raylane_torch_linear": ("raylane, torch's matmul (cpu_weight_prepack: false)", "raylane,\ntorch matmul"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cache = Path(os.environ.get("RAYLANE_BENCH_DIR", "~/.cache/raylane/bench-models")).expanduser()
    arg = parser.add_argument
    arg("--model", help=f"checkpoint directory (default: {MODEL_NAME}, written to --cache-dir)")
    arg("--cache-dir", type=Path, default=cache, help="where the default model lives (default: %(default)s)")
    arg("--num-prompts", type=int, default=64, help="prompts generated")
    arg("--max-batch-size", type=int, default=16, help="HF's batch size and the engine's max_num_seqs")
    arg("--repeats", type=int, default=3, help="HF/raylane runs each, alternated so machine drift hits both")
    arg("--decode-steps", type=int, default=30, help="decode steps timed for the step overhead")
    arg("--decode-context", type=int, default=128, help="prompt tokens of each request in the decode batch")
    arg("--threads", type=int, help="torch threads (default: torch's, one per core)")
    arg("--dtype", choices=("float32", "bfloat16"), default="float32", help="of both sides (default float32)")
    arg("--seed", type=int, default=0, help="seed of the prompts and sampling")
    arg("--out", type=Path, help="folder to write engine.json and engine.png into")


def ensure_model(cache_dir: Path) -> Path:
    """Write the benchmark Llama once; a fixed seed, so every machine benchmarks the same weights."""
    path = cache_dir / MODEL_NAME
    if (path / "config.json").is_file():
        return path
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**MODEL_SHAPE, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, dtype="float32")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Save beside the target and rename: an interrupted run must not leave a half model behind.
    tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}.", dir=cache_dir))
    model.save_pretrained(tmp)
    tmp.rename(path)
    return path


@dataclass(slots=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def useful_tokens(self) -> int:
        return sum(self.output_lens)

    def hf_row_steps(self, batch_size: int) -> int:
        """Decode rows HF computes: every row of a batch runs to the batch's longest output."""
        lens = self.output_lens
        return sum(
            len(lens[i : i + batch_size]) * max(lens[i : i + batch_size])
            for i in range(0, len(lens), batch_size)
        )


def make_workload(num_prompts: int, vocab_size: int, seed: int) -> Workload:
    """Random prompts of varied length; output lengths long-tailed like chat traffic."""
    rng = random.Random(seed)
    lo, hi = OUTPUT_LEN_RANGE
    lens = [rng.lognormvariate(math.log(OUTPUT_LEN_MEDIAN), OUTPUT_LEN_SIGMA) for _ in range(num_prompts)]
    prompts = [[rng.randrange(3, vocab_size) for _ in range(rng.randint(*PROMPT_LEN_RANGE))] for _ in lens]
    return Workload(prompts, [min(hi, max(lo, round(n))) for n in lens])


def run_hf(model, work: Workload, batch_size: int) -> list[list[int]]:
    """HF generate in arrival order, batch by batch, each batch run to its longest requested length
    (HF cannot stop rows at different lengths without an EOS). Returns each request's useful tokens."""
    import torch

    outputs: list[list[int]] = []
    for start in range(0, len(work.prompts), batch_size):
        prompts, lens = work.prompts[start : start + batch_size], work.output_lens[start : start + batch_size]
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        n = max(lens)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
        outputs += [row[width : width + n].tolist() for row, n in zip(out, lens, strict=True)]
    return outputs


def run_raylane(llm, work: Workload) -> list[list[int]]:
    from raylane.engine import SamplingParams

    llm.engine.block_manager.reset_prefix_cache()  # a repeat must not reuse the previous repeat's prompts
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in work.output_lens]
    return [list(out.outputs[0].token_ids) for out in llm.generate(work.prompts, params)]


def measure_throughput(llms: dict, hf_model, work: Workload, args: argparse.Namespace) -> dict[str, Any]:
    """`llms`: "raylane" and, on CPU, "raylane_torch_linear" (the same engine with torch's matmul)."""
    warm = Workload([p[:16] for p in work.prompts[:2]], [4, 4])  # load kernels, fill allocator pools
    run_hf(hf_model, warm, args.max_batch_size)
    runners = {"hf": lambda: run_hf(hf_model, work, args.max_batch_size)}
    for name, llm in llms.items():
        run_raylane(llm, warm)
        runners[name] = lambda llm=llm: run_raylane(llm, work)
    seconds: dict[str, list[float]] = {name: [] for name in runners}
    outputs: dict[str, list[list[int]]] = {}
    other_load: list[float] = []
    for _ in range(args.repeats):
        for name, fn in runners.items():
            with OtherLoad() as load:
                wall, outputs[name] = timed(fn)
            seconds[name].append(wall)
            other_load.append(load.fraction or 0.0)
    for name, outs in outputs.items():
        if [len(o) for o in outs] != work.output_lens:
            raise RuntimeError(f"{name} did not produce exactly the requested number of tokens per request")
    result: dict[str, Any] = {
        "num_prompts": len(work.prompts),
        "useful_tokens": work.useful_tokens,
        "hf_row_steps": work.hf_row_steps(args.max_batch_size),
        # A fairness check, not a goal: both sides should compute the same greedy continuations.
        "greedy_outputs_identical": sum(
            a == b for a, b in zip(outputs["hf"], outputs["raylane"], strict=True)
        ),
        "runs": list(runners),
        "other_load_max": max(other_load),
    }
    for name, secs in seconds.items():
        result[name] = {
            "seconds": secs,
            "wall_s": summary(secs),
            "tokens_per_s": summary([work.useful_tokens / s for s in secs]),
            "requests_per_s": summary([len(work.prompts) / s for s in secs]),
        }
    for stat in ("median", "max"):
        for name in llms:
            prefix = "speedup" if name == "raylane" else f"speedup_{name.removeprefix('raylane_')}"
            hf = result["hf"]["tokens_per_s"][stat]
            result[f"{prefix}_{stat}"] = result[name]["tokens_per_s"][stat] / hf
    return result


def measure_step_overhead(llm, args: argparse.Namespace) -> dict[str, Any]:
    """Alternate one engine decode step with a bare forward that replays exactly the batch the step
    ran (same tokens, positions and block tables; metadata and tensors built outside the timer)."""
    import torch

    from raylane.engine import SamplingParams
    from raylane.engine.sampling_params import RequestOutputKind
    from raylane.models.attention import build_attention_metadata

    engine, runner = llm.engine, llm.engine.runner
    batches: list = []
    execute = runner.execute_model
    runner.execute_model = lambda batch: (batches.append(batch), execute(batch))[1]  # record, then run
    rng = random.Random(args.seed + 1)
    params = SamplingParams(
        temperature=0,
        max_tokens=args.decode_steps + 2 * WARMUP_STEPS,
        ignore_eos=True,
        output_kind=RequestOutputKind.FINAL_ONLY,  # as LLM.generate asks for
    )
    prompts = [
        [rng.randrange(3, engine.vocab_size) for _ in range(args.decode_context)]
        for _ in range(args.max_batch_size)
    ]
    ids = [engine.add_request(prompt, params) for prompt in prompts]

    def is_decode(batch) -> bool:
        return len(batch.query_lens) == args.max_batch_size and max(batch.query_lens) == 1

    def bare_forward(batch) -> float:
        # Rewrites the K/V the step just wrote with identical values, so the engine's state is unchanged.
        meta = build_attention_metadata(
            batch.block_tables, batch.context_lens, batch.query_lens, runner.block_size
        )
        ids, positions, rows = (
            torch.tensor(x) for x in (batch.token_ids, batch.positions, batch.sample_indices)
        )
        with torch.inference_mode():
            return timed(lambda: runner.model.compute_logits(runner.model(ids, positions, meta)[rows]))[0]

    engine_ms, bare_ms = [], []
    try:
        while not batches or not is_decode(batches[-1]):  # prefill, in chunks if need be
            engine.step()
        with OtherLoad() as load:
            for i in range(WARMUP_STEPS + args.decode_steps):
                step_s, _ = timed(engine.step)
                if not is_decode(batches[-1]):
                    raise RuntimeError("a timed step was not a pure decode step")
                forward_s = bare_forward(batches[-1])  # the block tables are live lists: replay at once
                if i >= WARMUP_STEPS:
                    engine_ms.append(step_s * 1e3)
                    bare_ms.append(forward_s * 1e3)
    finally:
        del runner.execute_model  # drop the instance attribute: the class's method is back
        for request_id in ids:
            engine.abort_request(request_id)
    step, bare = statistics.median(engine_ms), statistics.median(bare_ms)
    return {
        "batch_size": args.max_batch_size,
        "context": args.decode_context,
        "engine_step_ms": engine_ms,
        "bare_forward_ms": bare_ms,
        "engine_step_ms_median": step,
        "bare_forward_ms_median": bare,
        "overhead_pct": 100 * (step - bare) / bare,
        "other_load": load.fraction or 0.0,
    }


def write_plot(path: Path, result: dict[str, Any]) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    tp, step = result["throughput"], result["step_overhead"]
    names = tp.get("runs", ["hf", "raylane"])
    bars = left.bar([RUN_LABELS[n][1] for n in names], [tp[n]["tokens_per_s"]["median"] for n in names])
    for bar, color in zip(bars, ("#999999", "#1f77b4", "#aec7e8"), strict=False):
        bar.set_color(color)
    for x, name in enumerate(names):  # every repeat as a dot, so the noise shows
        runs = [tp["useful_tokens"] / s for s in tp[name]["seconds"]]
        left.plot([x] * len(runs), runs, "k.")
    left.bar_label(bars, fmt="%.0f", label_type="center", color="white")
    left.set_ylabel("useful output tokens/s")
    left.set_title(f"Offline throughput: raylane = {tp['speedup_median']:.2f}x HF (median)")
    right.plot(step["engine_step_ms"], label=f"engine.step() (median {step['engine_step_ms_median']:.1f} ms)")
    right.plot(
        step["bare_forward_ms"], label=f"bare forward (median {step['bare_forward_ms_median']:.1f} ms)"
    )
    right.set(ylim=(0, None), xlabel="decode step", ylabel="ms")
    right.set_title(f"Decode step, batch {step['batch_size']}: {step['overhead_pct']:+.0f}% overhead")
    right.legend(loc="lower right")
    model, machine = result["model"], result["machine"]
    fig.suptitle(
        f"{model['name']} ({model['params'] / 1e6:.1f}M params), {machine['cpu']}, {machine['cores']} cores, "
        f"{machine['torch_threads']} torch threads"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_report(result: dict[str, Any], args: argparse.Namespace) -> None:
    tp, step = result["throughput"], result["step_overhead"]
    rows = []
    for name in tp.get("runs", ["hf", "raylane"]):
        label = RUN_LABELS[name][0]
        wall, tps, rps = (tp[name][k] for k in ("wall_s", "tokens_per_s", "requests_per_s"))
        rows.append(
            [
                label,
                f"{wall['median']:.1f} ({wall['min']:.1f})",
                f"{tps['median']:.0f} ({tps['max']:.0f})",
                f"{rps['median']:.2f} ({rps['max']:.2f})",
            ]
        )
    print(f"Offline throughput, {args.repeats} run(s) each: median (best)")
    print_table(["", "wall s", "useful tokens/s", "requests/s"], rows)
    print(f"raylane / HF: {tp['speedup_median']:.2f}x median, {tp['speedup_max']:.2f}x best (goal >= 3x)")
    if "speedup_torch_linear_median" in tp:
        print(
            f"raylane with torch's matmul / HF: {tp['speedup_torch_linear_median']:.2f}x median "
            "(the scheduling's share; the rest is oneDNN's prepacked linears)"
        )
    print(
        f"HF decoded {tp['hf_row_steps']} rows for {tp['useful_tokens']} useful tokens "
        f"({tp['hf_row_steps'] / tp['useful_tokens']:.2f}x); greedy outputs identical to HF: "
        f"{tp['greedy_outputs_identical']}/{tp['num_prompts']}\n"
    )
    print(
        f"Decode step: {step['batch_size']} requests with {step['context']}-token prompts, "
        f"median of {len(step['engine_step_ms'])} steps"
    )
    print_table(
        ["", "ms"],
        [
            ["bare model forward + logits", f"{step['bare_forward_ms_median']:.1f}"],
            ["engine.step()", f"{step['engine_step_ms_median']:.1f}"],
        ],
    )
    print(f"step overhead: {step['overhead_pct']:+.1f}% (goal <= 25%)")
    load = max(tp["other_load_max"], step["other_load"])
    warning = ": the numbers are unreliable, rerun on a quiet machine" if load > 0.1 else ""
    print(f"other processes used up to {100 * load:.0f}% of the CPUs during the runs{warning}")


def run(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from raylane.engine import LLM
    from raylane.parallel import onednn

    if args.threads:
        torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()  # generate's advice about pad tokens and generation flags is noise here
    model_dir = Path(args.model).expanduser() if args.model else ensure_model(args.cache_dir)
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).eval()
    params = sum(p.numel() for p in hf_model.parameters())  # a tied embedding is counted once
    machine = machine_info()
    print(
        f"machine:  {machine['cpu']}, {machine['cores']} cores, torch {machine['torch']}, "
        f"{machine['torch_threads']} threads"
    )
    print(f"model:    {model_dir.name}, {params:,} parameters, {args.dtype} ({model_dir})")
    work = make_workload(args.num_prompts, hf_model.config.vocab_size, args.seed)
    (plo, phi), (olo, ohi) = PROMPT_LEN_RANGE, OUTPUT_LEN_RANGE
    print(
        f"workload: {len(work.prompts)} prompts of uniform({plo}, {phi}) random tokens; output lengths "
        f"lognormal(median {OUTPUT_LEN_MEDIAN}, sigma {OUTPUT_LEN_SIGMA}) clipped to [{olo}, {ohi}], "
        f"{work.useful_tokens} in all; greedy, ignore_eos, max batch {args.max_batch_size}\n"
    )
    settings = {"raylane": True}
    if onednn.available(getattr(torch, args.dtype)):  # else nothing is packed: a second run would be the same
        settings["raylane_torch_linear"] = False
    llms = {
        name: LLM(
            str(model_dir),
            dtype=args.dtype,
            max_num_seqs=args.max_batch_size,
            seed=args.seed,
            cpu_weight_prepack=prepack,
        )
        for name, prepack in settings.items()
    }
    result: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "machine": machine,
        "model": {"name": model_dir.name, "path": str(model_dir), "params": params},
        "args": {
            k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if not k.startswith("_")
        },
        "throughput": measure_throughput(llms, hf_model, work, args),
        "step_overhead": measure_step_overhead(llms["raylane"], args),
    }
    print_report(result, args)
    if args.out:
        write_json(args.out / "engine.json", result)
        write_plot(args.out / "engine.png", result)
        print(f"\nwrote {args.out / 'engine.json'} and {args.out / 'engine.png'}")
    return 0
