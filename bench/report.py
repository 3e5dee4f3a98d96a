"""`raylane bench report`: the numbers that matter, measured in one run and written as markdown.

    raylane bench report --out bench/out/report                 # about 6 minutes on two quiet cores
    raylane bench report --out bench/out/report --update-docs   # and rewrite the figures in the docs
    raylane bench report --out /tmp/r --quick --skip engine     # a quick look, about 2 minutes

Parts, each with its goal (a goal that is not met is written as such, with the measured figure):

1. engine: raylane `LLM.generate` against Hugging Face `generate` (bench/engine.py, `--engine-repeats`
   runs each): useful tokens/s >= 3x HF; an engine decode step <= 25% over a bare forward.
2. overhead: the same chat requests over HTTP (Serve's HAProxy or proxy, gateway and router, pool
   replica) and to the same engine in this process, alternated, concurrency 1 (bench/overhead.py):
   <= 15 ms p50; and to Serve's floor (bench/serve_floor.py), to tell Serve's share from raylane's.
   Then again with the other `http.ingress` in a Ray of its own (proxy after HAProxy; HAProxy after
   the proxy where it can run), so both are in the report.
3. routing: `model: "auto"` against the named pool, end to end, alternated (bench/router.py): auto
   adds <= 15 ms to E2E p50.
4. prefix: the `prefix` dataset (a long shared system prompt, a short question) against the same
   config with prefix caching off (A) and on (B), alternated (bench/compare.py): TTFT p50 >= 3x lower.
5. sweep: throughput and latency at concurrency 1, 2, 4, ... up to the pool's max_num_seqs
   (bench/serve.py): output tokens/s rising with concurrency.
6. affinity: one pool of two replicas under raylane's prefix-aware router against Serve's default
   router and one replica of both replicas' KV cache, alternated, in apps of its own (bench/affinity.py):
   hit rate >= 0.9x the single replica's, prompt tokens computed >= 1.5x fewer and mean TTFT >= 1.5x
   lower than under Serve's default router.

Parts 2-5 run against two apps this command deploys in one in-process Ray + Serve (bench/apps.py,
configs from bench/serving.py, written to OUT/configs/): `main` (prefix caching on) and `nocache`.
The serving model is the demo Llama unless `--model DIR`; the shared system prompt (`--prefix-len`
tokens) is most of each prompt, so its prefill dominates the cache-off TTFT. Other load
is measured per part as the CPU used by processes outside this command's process tree (its Ray
included) and printed with the part; on two cores figures under much other load are not reliable.

`--update-docs` replaces what lies between `<!-- bench-report:NAME -->` and `<!-- /bench-report:NAME -->`
in docs/performance.md (NAME = summary) and bench/README.md (NAME = full) under `--docs-root`, and copies
report.json to bench/results/report.json there, which the rewritten sections name: the figures in the
docs and the JSON they came from are checked in together.
"""

import argparse
import asyncio
import datetime
import json
import math
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from raylane.bench.common import OtherLoad, machine_info, process_tree_cpu_s, write_json
from raylane.models.sources import engine_config, model_path

PARTS = ("engine", "overhead", "routing", "prefix", "sweep", "affinity")
REPO = Path(__file__).resolve().parent.parent
DOCS = {"summary": "docs/performance.md", "full": "bench/README.md"}
KEPT_JSON = "bench/results/report.json"  # under --docs-root; what --update-docs checks in beside the docs
PREFIX_GOAL = 3.0


class ReportError(RuntimeError):
    pass


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, required=True, help="write report.md, report.json and parts here")
    parser.add_argument("--update-docs", action="store_true", help="rewrite the marked sections of the docs")
    parser.add_argument("--docs-root", type=Path, default=REPO, help="where docs/ and bench/ are")
    parser.add_argument("--skip", type=parts_list, default=[], help=f"parts to leave out: {','.join(PARTS)}")
    parser.add_argument("--quick", action="store_true", help="fewer requests everywhere (a smoke run)")
    parser.add_argument("--model", default=None, help="serving checkpoint (default: the demo Llama)")
    parser.add_argument("--num-prompts", type=int, help="requests per serving measurement (default 32)")
    parser.add_argument("--concurrency", type=str, default="1,2,4,8,16", help="sweep points")
    parser.add_argument("--prefix-len", type=int, default=1024, help="tokens of the shared system prompt")
    parser.add_argument("--engine-repeats", type=int, default=1, help="HF/raylane runs in the engine part")
    parser.add_argument("--seed", type=int, default=0, help="seed of every benchmark's prompts")


def parts_list(text: str) -> list[str]:
    parts = [p for p in text.split(",") if p]
    if unknown := set(parts) - set(PARTS):
        raise argparse.ArgumentTypeError(f"unknown parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
    return parts


def command_line(args: argparse.Namespace) -> str:
    words = ["raylane bench report", f"--out {args.out}"]
    words += ["--quick"] * args.quick + ([f"--skip {','.join(args.skip)}"] if args.skip else [])
    words += [f"--model {args.model}"] if args.model else []
    words += ["--update-docs"] * args.update_docs
    return " ".join(words)


# -- the parts --------------------------------------------------------------------------------------


def run_engine(args: argparse.Namespace) -> dict[str, Any]:
    import raylane.bench.engine as engine_bench

    parser = argparse.ArgumentParser()
    engine_bench.add_arguments(parser)
    argv = ["--repeats", str(args.engine_repeats), "--out", str(args.out / "engine")]
    argv += ["--num-prompts", "16", "--decode-steps", "10"] if args.quick else []
    engine_bench.run(parser.parse_args(argv))
    return json.loads((args.out / "engine" / "engine.json").read_text())


def serving_requests(args: argparse.Namespace, tokenizer: str, kind: str):
    """The workload of a serving part, counted with the served model's tokenizer."""
    from raylane.bench.datasets import TokenCounter, prefix_requests, random_requests

    counter = TokenCounter(tokenizer)
    n = args.num_prompts or (8 if args.quick else 32)
    if kind == "overhead":
        return random_requests(n, args.seed, counter, input_len=128, output_len=32, range_ratio=0.5)
    if kind == "prefix":
        return prefix_requests(n // 2 or 1, args.seed, counter, args.prefix_len, 16, 16)
    return random_requests(n, args.seed + 1, counter, input_len=128, output_len=64, range_ratio=0.5)


def run_overhead(args, urls: dict[str, str], config, tokenizer: str, ingress: str) -> dict[str, Any]:
    from raylane.bench.overhead import run_overhead as measure

    requests = serving_requests(args, tokenizer, "overhead")
    floor = f"{urls['serve-floor']}/v1" if "serve-floor" in urls else None
    result = measure(f"{urls['main']}/v1", "EMPTY", config.pools[0], requests, 2, ingress, floor)
    result["dataset_prompt_tokens"] = sum(r.prompt_tokens for r in requests) / len(requests)
    write_json(args.out / f"overhead-{ingress}.json", result)
    result.pop("pairs")  # every pair is in the JSON file; the report keeps the summary
    return result


def run_overhead_behind(args, ingress: str) -> dict[str, Any]:
    """The overhead part again, with the main config behind `ingress` (a Ray of its own: the ingress is
    fixed when Ray starts); other load is metered once the app runs, as for the rest."""
    from raylane.bench.apps import LocalServe
    from raylane.bench.serve_floor import floor_app
    from raylane.bench.serving import DEMO_MODEL, serving_config

    config = serving_config(args.model or DEMO_MODEL, ingress=ingress)
    tokenizer = engine_config(config.pools[0]).tokenizer
    try:
        with LocalServe(ingress=ingress) as local:
            local.add_app("serve-floor", floor_app())
            urls = local.deploy({"main": config}) | {"serve-floor": local.url("serve-floor")}
            return measured(
                f"overhead, http.ingress: {ingress}",
                lambda: run_overhead(args, urls, config, tokenizer, local.ingress),
            )
    except Exception as e:  # Ray or the app did not start: recorded like a failed part
        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {e}"}


def run_routing(args, urls: dict[str, str]) -> dict[str, Any]:
    from raylane.bench.router import measure_auto_vs_named, routing_prompts, summarize_auto_vs_named

    pairs = 16 if args.quick else 64
    prompts = routing_prompts(pairs + 2, args.seed + 1)
    measured = asyncio.run(measure_auto_vs_named(f"{urls['main']}/v1", "EMPTY", "chat", prompts, 16))
    return {"summary": summarize_auto_vs_named(measured), "named_model": "chat", "output_len": 16}


def run_prefix(args, urls: dict[str, str], tokenizer: str) -> dict[str, Any]:
    from raylane.bench.client import Endpoint
    from raylane.bench.compare import compare_sweep
    from raylane.bench.serve import SweepPoint

    requests = serving_requests(args, tokenizer, "prefix")
    endpoints = (
        Endpoint(f"{urls['nocache']}/v1", "chat", "EMPTY", "cache off"),
        Endpoint(f"{urls['main']}/v1", "chat", "EMPTY", "cache on"),
    )
    repeats = 2
    (point,) = asyncio.run(
        compare_sweep(endpoints, requests, [SweepPoint(concurrency=1)], sweep_settings(), repeats)
    )
    off, on = point["summaries"]
    gain = off["ttft"]["p50"] / on["ttft"]["p50"]
    per_repeat = [1 / r["TTFT p50"] for r in point["ratios_per_repeat"] if r["TTFT p50"]]
    return {
        "requests_per_side": len(requests) * repeats,
        "prompt_tokens": requests[0].prompt_tokens,
        "prefix_tokens": args.prefix_len,
        "question_tokens": 16,
        "output_tokens": 16,
        "off": {k: off[k] for k in ("ttft", "e2e", "request_throughput", "errors")},
        "on": {k: on[k] for k in ("ttft", "e2e", "request_throughput", "errors")},
        "ttft_p50_gain": gain,
        "ttft_p50_gain_per_repeat": per_repeat,
        "goal": PREFIX_GOAL,
        "goal_met": gain >= PREFIX_GOAL,
    }


def run_sweep(args, urls: dict[str, str], config, tokenizer: str) -> dict[str, Any]:
    from raylane.bench.client import Endpoint
    from raylane.bench.serve import SweepPoint, json_safe, plot
    from raylane.bench.serve import run_sweep as sweep

    max_seqs = config.pools[0].engine.max_num_seqs
    levels = [c for c in (int(x) for x in args.concurrency.split(",")) if c <= max_seqs]
    if args.quick:
        levels = [c for c in levels if c in (1, 4, max_seqs)] or levels[:1]
    requests = serving_requests(args, tokenizer, "sweep")
    if len(requests) < 2 * levels[-1]:  # the highest level must be reached and held for a while
        args = argparse.Namespace(**(vars(args) | {"num_prompts": 2 * levels[-1]}))
        requests = serving_requests(args, tokenizer, "sweep")
    endpoint = Endpoint(f"{urls['main']}/v1", "chat", "EMPTY")
    points = asyncio.run(
        sweep(endpoint, requests, [SweepPoint(concurrency=c) for c in levels], sweep_settings())
    )
    plot(
        points,
        args.out / "sweep.png",
        f"chat ({Path(model_path(config.pools[0])).name}) through the gateway",
    )
    write_json(args.out / "sweep.json", json_safe({"points": points}))
    rows = [{"concurrency": p["concurrency"], **p["summary"]} for p in points]
    for row in rows:
        row.pop("slo", None)
    throughput = [r["output_throughput"] for r in rows]
    rising = all(b > a for a, b in zip(throughput, throughput[1:], strict=False))
    return {
        "max_num_seqs": max_seqs,
        "requests_per_point": len(requests),
        "mean_prompt_tokens": sum(r.prompt_tokens for r in requests) / len(requests),
        "mean_output_tokens": sum(r.max_tokens for r in requests) / len(requests),
        "points": rows,
        "goal_met": rising,
    }


def sweep_settings():
    from raylane.bench.client import RequestOptions
    from raylane.bench.metrics import Slo
    from raylane.bench.serve import SweepSettings

    return SweepSettings(options=RequestOptions(temperature=0.0, ignore_eos=True), slo=Slo(), progress=False)


def checkpoint_params(path: str | Path) -> int:
    """Parameters stored in a checkpoint's safetensors files (a tied embedding once)."""
    from safetensors import safe_open

    total = 0
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            total += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())  # noqa: SIM118 (safe_open is no dict)
    return total


def run_affinity(args: argparse.Namespace) -> dict[str, Any]:
    import raylane.bench.affinity as affinity_bench

    parser = argparse.ArgumentParser()
    affinity_bench.add_arguments(parser)
    argv = ["--out", str(args.out / "affinity.json"), "--seed", str(args.seed)]
    argv += ["--model", args.model] if args.model else []
    argv += ["--rounds", "2"] if args.quick else []
    affinity_bench.run(parser.parse_args(argv))
    result = json.loads((args.out / "affinity.json").read_text())
    # Its own other-load figure, metered while its apps ran: the part's meter (`measured`) also spans
    # the Ray it starts and stops, whose workers' CPU leaves this process tree unreaped at shutdown.
    return {k: result[k] for k in ("results", "goals", "settings", "other_load")}


def run_serving_parts(args: argparse.Namespace, report: dict[str, Any], todo: list[str]) -> None:
    from raylane.bench.apps import LocalServe
    from raylane.bench.serve_floor import floor_app
    from raylane.bench.serving import DEMO_MODEL, serving_config

    model = args.model or DEMO_MODEL
    configs = {"main": serving_config(model), "nocache": serving_config(model, prefix_caching=False)}
    (args.out / "configs").mkdir(parents=True, exist_ok=True)
    for name, config in configs.items():
        (args.out / "configs" / f"{name}.yaml").write_text(config.to_yaml())
    with LocalServe() as local:
        if "overhead" in todo:
            local.add_app("serve-floor", floor_app())
        urls = local.deploy(configs)
        if "overhead" in todo:
            urls["serve-floor"] = local.url("serve-floor")
        pool = configs["main"].pools[0]
        tokenizer = engine_config(pool).tokenizer
        report["serving_model"] = {
            "name": Path(model_path(pool)).name,
            "params": checkpoint_params(model_path(pool)),
            "engine": pool.engine.model_dump(include={"max_num_seqs", "num_kv_blocks", "cpus_per_rank"}),
        }
        steps: dict[str, Callable[[], dict[str, Any]]] = {
            "overhead": lambda: run_overhead(args, urls, configs["main"], tokenizer, local.ingress),
            "routing": lambda: run_routing(args, urls),
            "prefix": lambda: run_prefix(args, urls, tokenizer),
            "sweep": lambda: run_sweep(args, urls, configs["main"], tokenizer),
        }
        for part in todo:
            report["parts"][part] = measured(part, steps[part])


def measured(part: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run one part under an other-load meter; a failure is recorded, not raised (the rest still run)."""
    print(f"\n== {part} ==", file=sys.stderr, flush=True)
    try:
        with OtherLoad(process_tree_cpu_s) as load:
            result = fn()
    except Exception as e:  # one part failing must not lose the others' figures
        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {e}"}
    return {"other_load": load.fraction} | result  # a part's own figure, where it has one, comes first


def run(args: argparse.Namespace) -> int:
    from raylane.bench.apps import LocalServe
    from raylane.bench.report_markdown import full_markdown, summary_markdown

    todo = [p for p in PARTS if p not in args.skip]
    report: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "command": command_line(args),
        "machine": machine_info(),
        "quick": args.quick,
        "parts": {},
    }
    if args.update_docs:
        report["kept_json"] = KEPT_JSON
    args.out.mkdir(parents=True, exist_ok=True)
    if "engine" in todo:  # first, alone: no idle Ray processes beside it
        report["parts"]["engine"] = measured("engine", lambda: run_engine(args))
    serving = [p for p in todo if p not in ("engine", "affinity")]
    if serving:
        run_serving_parts(args, report, serving)
    if "affinity" in todo:  # apps of its own: two-replica pools and a single replica
        report["parts"]["affinity"] = measured("affinity", lambda: run_affinity(args))
    overhead = report["parts"].get("overhead", {})
    if "overhead" in todo and "error" not in overhead:
        other = "proxy" if overhead["summary"]["ingress"] == "haproxy" else "haproxy"
        if why := LocalServe.ingress_problem(other):
            print(f"overhead behind http.ingress: {other} not measured: {why}", file=sys.stderr)
        else:
            overhead["other_ingress"] = run_overhead_behind(args, other)
    from raylane.bench.serve import json_safe

    write_json(args.out / "report.json", json_safe(report))
    full, summary = full_markdown(report), summary_markdown(report)
    (args.out / "report.md").write_text(f"{summary}\n\n{full}\n")
    print(f"\n{summary}\n\n{full}\n\nwrote {args.out / 'report.md'} and {args.out / 'report.json'}")
    failed = [p for p, r in report["parts"].items() if "error" in r or "error" in r.get("other_ingress", {})]
    if failed:
        print(
            f"raylane bench report: failed parts: {', '.join(failed)}; docs left as they were",
            file=sys.stderr,
        )
        return 1
    if args.update_docs:
        write_json(args.docs_root / KEPT_JSON, json_safe(report))
        print(f"wrote {args.docs_root / KEPT_JSON}")
        for name, content in (("summary", summary), ("full", full)):
            path = args.docs_root / DOCS[name]
            path.write_text(replace_marked(path.read_text(), name, content, path))
            print(f"updated the {name} section of {path}")
    return 0


def replace_marked(text: str, name: str, content: str, where: Path | str = "the document") -> str:
    """`text` with what lies between `<!-- bench-report:NAME -->` and its closing marker replaced."""
    begin, end = f"<!-- bench-report:{name} -->", f"<!-- /bench-report:{name} -->"
    start, stop = text.find(begin), text.find(end)
    if start < 0 or stop < start:
        raise ReportError(f"{where} has no {begin} ... {end} section to rewrite")
    return f"{text[: start + len(begin)]}\n{content.strip()}\n{text[stop:]}"
