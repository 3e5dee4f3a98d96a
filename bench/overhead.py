"""`raylane bench overhead`: what serving adds over the engine itself, at concurrency 1.

The same chat requests go (a) over HTTP through Serve's proxy, the gateway (auth, validation, the
router's resolve/plan/admission) and the pool replica, streamed with the official `openai` client,
and (b) straight to an `AsyncLLM` in this process built from the same pool's engine config, with the
prompt rendered and the sampling parameters made by the same code the pool uses
(`OpenAIServingChat.render_chat`, `raylane.deployments.protocol.sampling.chat_params`). Request i
goes to both, in turn
(HTTP first for even i, the engine first for odd i), so a slow spell of the machine hits both sides.

With `floor_url` (the command deploys it), request i goes, right after the in-process engine, to a
third side: Serve's floor (`bench/serve_floor.py`), the same topology with a stand-in pool that
replays the engine's outputs for that request at the times the in-process engine made them. So
floor - engine is what Ray Serve's own path costs here, and HTTP - floor what raylane's code adds.

TTFT is request sent -> first generated text (an SSE chunk with content; an engine output with
text); E2E is request sent -> the end of the stream (the HTTP body's end, which the async `openai`
client reads to); the tail is the last text -> the end of the stream. The overhead is the
difference of the p50s.
Goal: <= 15 ms at p50. The in-process engine gets as many torch threads as Ray gives the replica
(Ray sets OMP_NUM_THREADS from the actor's CPUs), so both run the model alike; greedy outputs of the
two sides are compared as a check that they did the same work.

    raylane bench overhead                      # the demo Llama, started here (bench/serving.py)
    raylane bench overhead --config my.yaml --pool chat --num-prompts 64
"""

import argparse
import asyncio
import contextlib
import datetime
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from raylane.bench.common import OtherLoad, machine_info, print_table, process_tree_cpu_s, write_json
from raylane.bench.datasets import BenchRequest, add_dataset_arguments, requests_from_args
from raylane.bench.metrics import percentile
from raylane.config import ClusterConfig, PoolConfig
from raylane.models.sources import engine_config, model_path

GOAL_MS = 15.0


@dataclass(slots=True)
class Sample:
    """One request on one side: times in seconds, the generated text and token count."""

    ttft: float | None = None
    e2e: float | None = None
    last_text: float | None = None
    text: str = ""
    output_tokens: int = 0
    error: str | None = None
    outputs: list[tuple[float, str]] = field(default_factory=list)  # in-process: (time, text) per output


@dataclass(slots=True)
class Pair:
    http: Sample
    engine: Sample
    first: str  # which side ran first: "http" or "engine"
    floor: Sample | None = None  # Serve's floor, when measured
    identical: bool = field(init=False)

    def __post_init__(self) -> None:
        self.identical = self.http.error is None and self.http.text == self.engine.text


def request_body(model: str, request: BenchRequest) -> dict[str, Any]:
    """What the benchmark sends: greedy, exactly max_tokens (ignore_eos), streamed with usage."""
    return {
        "model": model,
        "messages": request.messages,
        "max_tokens": request.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }


def _torch_threads(engine) -> int:
    import torch

    return torch.get_num_threads()


class InProcessEngine:
    """The pool's engine in this process, fed exactly what the pool would feed it."""

    def __init__(self, pool: PoolConfig, torch_threads: int):
        import torch

        from raylane.deployments.pool.serving_chat import OpenAIServingChat
        from raylane.engine import AsyncLLM

        torch.set_num_threads(torch_threads)  # before the engine thread starts: it inherits the count
        self.llm = AsyncLLM(engine_config(pool))
        self.serving = OpenAIServingChat(self.llm, pool.model_id, self.llm.max_model_len)
        self.model_id = pool.model_id

    async def torch_threads(self) -> int:
        return await self.llm.run_in_engine(_torch_threads)

    def prepare(self, request: BenchRequest):
        """(prompt token ids, sampling params) as the pool makes them from the same request body."""
        from raylane.deployments.protocol.openai_schemas import ChatCompletionRequest
        from raylane.deployments.protocol.sampling import chat_params
        from raylane.engine.sampling_params import RequestOutputKind

        body = ChatCompletionRequest.model_validate(request_body(self.model_id, request))
        params, plan = chat_params(body)
        return self.serving.render_chat(body, plan), params.clone(output_kind=RequestOutputKind.DELTA)

    async def send(self, request: BenchRequest) -> Sample:
        sent = time.perf_counter()
        prompt, params = self.prepare(request)  # the pool does this per request too: it counts
        sample = Sample()
        texts: list[str] = []
        async for out in self.llm.generate(prompt, params):
            completion = out.outputs[0]
            if completion.text:
                sample.last_text = time.perf_counter() - sent
                sample.ttft = sample.ttft or sample.last_text
            sample.outputs.append((time.perf_counter() - sent, completion.text))
            texts.append(completion.text)
            sample.output_tokens += len(completion.token_ids)
        sample.e2e = time.perf_counter() - sent
        sample.text = "".join(texts)
        return sample

    def shutdown(self) -> None:
        self.llm.shutdown()


async def send_http(client, model: str, request: BenchRequest, extra: dict[str, Any] | None = None) -> Sample:
    import openai

    body = request_body(model, request)
    extra = {"ignore_eos": body.pop("ignore_eos")} | (extra or {})
    sample = Sample()
    texts: list[str] = []
    sent = time.perf_counter()
    try:
        stream = await client.chat.completions.create(**body, extra_body=extra)
        async for chunk in stream:
            if chunk.usage is not None:
                sample.output_tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                if choice.delta and choice.delta.content:
                    sample.last_text = time.perf_counter() - sent
                    sample.ttft = sample.ttft or sample.last_text
                    texts.append(choice.delta.content)
        sample.e2e = time.perf_counter() - sent
    except openai.APIError as e:
        sample.error = f"{getattr(e, 'status_code', '')} {e.message}".strip()
    sample.text = "".join(texts)
    return sample


async def measure(
    base_url: str,
    api_key: str,
    engine: InProcessEngine,
    requests: list[BenchRequest],
    warmup: int = 2,
    floor_url: str | None = None,
) -> list[Pair]:
    """Each request to both sides, alternating which goes first, and then, right after the engine,
    to Serve's floor at `floor_url`, replaying what the engine did; `warmup` unmeasured rounds first."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=600)
    floor = (
        openai.AsyncOpenAI(base_url=floor_url, api_key="EMPTY", max_retries=0, timeout=600)
        if floor_url
        else None
    )

    async def replay(local: Sample, request: BenchRequest) -> Sample | None:
        if not floor:
            return None
        extra = {"replay": local.outputs, "replay_tokens": local.output_tokens}
        sample = await send_http(floor, engine.model_id, request, extra)
        if sample.error:
            raise RuntimeError(f"request to Serve's floor at {floor_url} failed: {sample.error}")
        return sample

    try:
        for request in requests[:warmup]:
            warm = await send_http(client, engine.model_id, request)
            if warm.error:
                raise RuntimeError(f"warm-up request to {base_url} failed: {warm.error}")
            await replay(await engine.send(request), request)
        pairs = []
        for i, request in enumerate(requests):
            if i % 2 == 0:
                http = await send_http(client, engine.model_id, request)
                local = await engine.send(request)
                pairs.append(Pair(http, local, "http", await replay(local, request)))
            else:
                local = await engine.send(request)
                replayed = await replay(local, request)
                pairs.append(
                    Pair(await send_http(client, engine.model_id, request), local, "engine", replayed)
                )
        return pairs
    finally:
        await client.close()
        if floor:
            await floor.close()


def summarize(pairs: list[Pair], ingress: str = "proxy") -> dict[str, Any]:
    """p50/p99 of TTFT and E2E per side (ms), the overheads (differences of p50s) and checks; with
    Serve's floor measured, also what the floor adds over the engine and raylane over the floor."""
    ok = [p for p in pairs if p.http.error is None]
    result: dict[str, Any] = {
        "ingress": ingress,
        "requests": len(pairs),
        "http_errors": len(pairs) - len(ok),
        "identical_outputs": sum(p.identical for p in pairs),
        "same_token_counts": sum(p.http.output_tokens == p.engine.output_tokens for p in ok),
    }
    sides = ("http", "engine", "floor") if ok and all(p.floor for p in ok) else ("http", "engine")
    if "floor" in sides:  # the stand-in carried the engine's text through Serve and the SDK
        result["floor_identical_outputs"] = sum(p.floor.text == p.engine.text for p in ok)
    for metric in ("ttft", "e2e"):
        stats = {}
        for side in sides:
            ms = [getattr(getattr(p, side), metric) * 1e3 for p in ok if getattr(getattr(p, side), metric)]
            stats[side] = {"p50": percentile(ms, 50), "p99": percentile(ms, 99), "mean": statistics.fmean(ms)}
        paired = [
            (getattr(p.http, metric) - getattr(p.engine, metric)) * 1e3
            for p in ok
            if getattr(p.http, metric) is not None and getattr(p.engine, metric) is not None
        ]
        result[metric] = {
            **stats,
            "overhead_p50_ms": stats["http"]["p50"] - stats["engine"]["p50"],
            "paired_difference_p50_ms": percentile(paired, 50),
        }
        if "floor" in stats:
            result[metric]["floor_over_engine_p50_ms"] = stats["floor"]["p50"] - stats["engine"]["p50"]
            result[metric]["raylane_over_floor_p50_ms"] = stats["http"]["p50"] - stats["floor"]["p50"]
    result["tail"] = {}
    for side in sides:
        tails = []
        for sample in (getattr(p, side) for p in ok):
            if sample.e2e and sample.last_text:
                tails.append((sample.e2e - sample.last_text) * 1e3)
        if tails:
            result["tail"][side] = {"p50": percentile(tails, 50)}
    result["goal_ms"] = GOAL_MS
    result["goal_met"] = all(result[m]["overhead_p50_ms"] <= GOAL_MS for m in ("ttft", "e2e"))
    return result


def front_label(ingress: str | None) -> str:
    """What receives the request before the gateway, as the tables name it."""
    return "HAProxy" if ingress == "haproxy" else "proxy"


def table_rows(summary: dict[str, Any]) -> list[list[str]]:
    rows = []
    front = front_label(summary.get("ingress"))
    labels = {
        "engine": "engine in-process",
        "http": f"HTTP: {front}, gateway, pool",
        "floor": f"Serve's floor: {front}, bare ingress, stand-in pool",
    }
    for metric in ("ttft", "e2e"):
        s, name = summary[metric], metric.upper()
        for side in ("engine", "http", "floor"):
            if side in s:
                rows.append([f"{name} {labels[side]}", f"{s[side]['p50']:.1f}", f"{s[side]['p99']:.1f}"])
        rows.append([f"{name} added by serving", f"{s['overhead_p50_ms']:+.1f}", ""])
        if "floor" in s:
            rows.append(
                [
                    f"{name} of that, Serve's floor over the engine",
                    f"{s['floor_over_engine_p50_ms']:+.1f}",
                    "",
                ]
            )
            rows.append(
                [f"{name} of that, raylane over Serve's floor", f"{s['raylane_over_floor_p50_ms']:+.1f}", ""]
            )
    for side in ("engine", "http", "floor"):
        if side in summary.get("tail", {}):
            rows.append(
                [f"last text to end of response, {labels[side]}", f"{summary['tail'][side]['p50']:.1f}", ""]
            )
    return rows


def verdict(summary: dict[str, Any]) -> str:
    worst = max(summary[m]["overhead_p50_ms"] for m in ("ttft", "e2e"))
    state = "met" if summary["goal_met"] else "NOT met"
    line = f"serving adds {worst:.1f} ms p50 at most (TTFT, E2E): goal <= {GOAL_MS:g} ms {state}"
    if "floor" in summary["ttft"]:
        floor = max(summary[m]["floor_over_engine_p50_ms"] for m in ("ttft", "e2e"))
        line += f"; Serve's floor alone adds {floor:.1f} ms at most"
    return line


def ray_torch_threads(cpus: float) -> int:
    """The torch threads Ray gives an actor with `cpus` CPUs (it sets OMP_NUM_THREADS from them)."""
    import ray

    @ray.remote
    def threads() -> int:
        import torch

        return torch.get_num_threads()

    return ray.get(threads.options(num_cpus=cpus).remote())


# -- the command ----------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="cluster config to start (default: bench/serving.py's)")
    parser.add_argument("--pool", help="the pool to measure (default: the config's first)")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured request pairs first")
    parser.add_argument(
        "--stream-interval", type=int, help="set the pool's engine.stream_interval (both sides run it)"
    )
    parser.add_argument(
        "--stream-batching-interval-ms",
        type=float,
        help="set the pool's engine.stream_batching_interval_ms (both sides run it)",
    )
    parser.add_argument(
        "--engine-core",
        choices=("auto", "thread", "process"),
        help="set the pool's engine.engine_core (both sides run it)",
    )
    parser.add_argument(
        "--ingress", choices=("proxy", "haproxy"), help="set http.ingress (default: the config's)"
    )
    parser.add_argument(
        "--no-floor", action="store_true", help="leave out Serve's floor (bench/serve_floor.py)"
    )
    parser.add_argument("--out", type=Path, help="write overhead.json here")
    add_dataset_arguments(parser)
    parser.set_defaults(num_prompts=32, random_input_len=128, random_output_len=32)


def run(args: argparse.Namespace) -> int:
    from raylane.bench.apps import LocalServe, LocalServeError
    from raylane.bench.serve_floor import floor_app
    from raylane.bench.serving import serving_config

    config = ClusterConfig.from_yaml(args.config) if args.config else serving_config()
    pool = next((p for p in config.pools if p.name == (args.pool or config.pools[0].name)), None)
    if pool is None:
        print(f"raylane bench overhead: no pool {args.pool!r} in the config", file=sys.stderr)
        return 1
    engine = {
        "stream_interval": args.stream_interval,
        "stream_batching_interval_ms": args.stream_batching_interval_ms,
        "engine_core": args.engine_core,
    }
    if engine := {k: v for k, v in engine.items() if v is not None}:  # the config is read-only: copies
        pool = pool.model_copy(update={"engine": pool.engine.model_copy(update=engine)})
        pools = [pool if p.name == pool.name else p for p in config.pools]
        config = config.model_copy(update={"pools": pools})
    if args.ingress is not None:
        config = config.model_copy(update={"http": config.http.model_copy(update={"ingress": args.ingress})})
    requests, dataset = requests_from_args(args)
    try:
        with LocalServe(ingress=config.http.ingress) as local:
            if not args.no_floor:
                local.add_app("serve-floor", floor_app())
            url = local.deploy({"overhead": config})["overhead"]
            floor_url = None if args.no_floor else f"{local.url('serve-floor')}/v1"
            result = run_overhead(f"{url}/v1", "EMPTY", pool, requests, args.warmup, local.ingress, floor_url)
    except (LocalServeError, RuntimeError) as e:
        print(f"raylane bench overhead: {e}", file=sys.stderr)
        return 1
    result |= {"dataset": dataset, "date": datetime.date.today().isoformat()}
    print_report(result)
    if args.out:
        write_json(args.out / "overhead.json", result)
        print(f"\nwrote {args.out / 'overhead.json'}")
    return 0


def run_overhead(
    base_url: str,
    api_key: str,
    pool: PoolConfig,
    requests: list[BenchRequest],
    warmup: int = 2,
    ingress: str = "proxy",
    floor_url: str | None = None,
) -> dict[str, Any]:
    """Measure against a running app whose pool `pool` serves `pool.model_id` (Ray initialized), behind
    `ingress` (what is in front of its gateway: proxy or haproxy), and Serve's floor at `floor_url`
    (an OpenAI base URL of `raylane.bench.serve_floor.floor_app` behind the same ingress) when given."""
    import torch

    threads, before = ray_torch_threads(pool.engine.cpus_per_rank), torch.get_num_threads()
    engine = InProcessEngine(pool, threads)
    try:
        with OtherLoad(process_tree_cpu_s) as load:
            pairs = asyncio.run(measure(base_url, api_key, engine, requests, warmup, floor_url))
        engine_threads = asyncio.run(_engine_threads(engine))
    finally:
        engine.shutdown()
        torch.set_num_threads(before)  # the caller's torch work (a report's other parts) as it was
    return {
        "benchmark": "overhead",
        "machine": machine_info() | {"torch_threads": engine_threads},
        "model": pool.model_id,
        "checkpoint": model_path(pool),
        "summary": summarize(pairs, ingress),
        "other_load": load.fraction,
        "pairs": [asdict(p) for p in pairs],
    }


async def _engine_threads(engine: InProcessEngine) -> int:
    with contextlib.suppress(Exception):
        return await engine.torch_threads()
    return -1


def print_report(result: dict[str, Any]) -> None:
    s, machine = result["summary"], result["machine"]
    print(
        f"machine: {machine['cpu']}, {machine['cores']} cores; model {result['model']} "
        f"({result['checkpoint']}), {machine['torch_threads']} torch thread(s) on both sides"
    )
    floor = " (then to Serve's floor, replaying the engine)" if "floor" in s["ttft"] else ""
    print(f"{s['requests']} requests at concurrency 1, each to both sides, alternated{floor}")
    print_table(["latency (ms)", "p50", "p99"], table_rows(s))
    print(verdict(s))
    print(
        f"greedy outputs identical on both sides: {s['identical_outputs']}/{s['requests']}; "
        f"HTTP errors: {s['http_errors']}"
    )
    print(f"other processes used {100 * (result['other_load'] or 0):.0f}% of the CPUs during the run")
