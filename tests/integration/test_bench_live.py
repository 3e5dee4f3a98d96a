"""The serving benchmarks against live apps, run as a user runs them (`raylane bench ...` through the CLI
entry point, real Ray, Serve, HTTP and the official `openai` client): what they count must agree
with what the server says, failures must show up as numbers rather than crashes, and apps that a
benchmark starts must be gone afterwards. No test asserts a duration.

Apps: `api_server` (tests/live_servers.py: pools `chat` = the demo Llama served as
`raylane-llama-tiny`, and `reasoning`); `bench compare --config-*` and `bench report` deploy their
own apps on the same Serve and must delete them.
"""

import json
import re
from pathlib import Path

import pytest
from PIL import Image

from raylane.bench.datasets import TokenCounter, random_requests
from raylane.cluster.cli import main
from raylane.models.sources import model_path

MODEL = "raylane-llama-tiny"
SMALL = ["--random-input-len", "24", "--random-output-len", "6", "--no-progress"]


def bench(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["bench", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def bench_apps() -> list[str]:
    from ray import serve

    return [name for name in serve.status().applications if name.startswith("raylane-bench-")]


def test_bench_serve_counts_what_the_server_reports(api_server, client, demo_models, capsys, tmp_path):
    tokenizer = str(demo_models[MODEL])
    code, out, err = bench(
        capsys,
        "serve",
        *("--base-url", api_server.base_url, "--model", MODEL, "--tokenizer", tokenizer),
        *("--num-prompts", "4", "--concurrency", "1,2", "--out", str(tmp_path), *SMALL),
    )
    assert code == 0, err
    assert "output tokens counted from the server's usage (exact)" in out
    assert "concurrency 1" in out and "concurrency 2" in out

    report = json.loads((tmp_path / "serve.json").read_text())
    # The same workload (seed 0), asked again without streaming: the server's own usage per request.
    requests = random_requests(4, 0, TokenCounter(tokenizer), 24, 6, 0.5)
    usage = []
    for request in requests:
        reply = client.chat.completions.create(
            model=MODEL,
            messages=request.messages,
            max_tokens=request.max_tokens,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        usage.append(reply.usage)
    assert [p["concurrency"] for p in report["points"]] == [1, 2]
    for point in report["points"]:
        records, summary = point["records"], point["summary"]
        assert len(records) == 4 and summary["completed"] == 4 and summary["errors"] == 0
        for record, request, used in zip(records, requests, usage, strict=True):
            assert record["usage_reported"]
            assert record["output_tokens"] == used.completion_tokens == request.max_tokens
            assert record["prompt_tokens"] == used.prompt_tokens
            assert 0 < record["ttft"] <= record["e2e"]
            assert len(record["itl"]) <= record["output_tokens"] - 1
        assert summary["output_tokens"] == sum(r.max_tokens for r in requests)
        assert summary["request_throughput"] > 0 and summary["output_throughput"] > 0
        assert summary["ttft"]["p50"] <= summary["e2e"]["p50"]
    with Image.open(tmp_path / "serve.png") as png:
        assert png.format == "PNG" and png.width > 400 and png.height > 200


def test_bench_serve_reports_a_wrong_model_as_404_errors_not_a_crash(api_server, capsys, tmp_path):
    args = ["--base-url", api_server.base_url, "--model", "no-such-model", "--num-prompts", "3", *SMALL]
    code, out, err = bench(capsys, "serve", *args, "--warmup", "0", "--out", str(tmp_path))
    assert code == 0, err
    assert "errors by status: 404: 3" in out
    (point,) = json.loads((tmp_path / "serve.json").read_text())["points"]
    assert point["summary"]["errors_by_status"] == {"404": 3} and point["summary"]["completed"] == 0
    assert all("no-such-model" in r["error"] for r in point["records"])

    # With the default warm-up, the run stops before measuring and says why, without a traceback.
    code, out, err = bench(capsys, "serve", *args)
    assert code == 1
    assert "'no-such-model'" in err and "404" in err and "Traceback" not in err


def test_bench_compare_two_urls_prints_ratios(api_server, capsys, tmp_path):
    code, out, err = bench(
        capsys,
        "compare",
        *("--base-url-a", api_server.base_url, "--model-a", "chat"),
        *("--base-url-b", api_server.base_url, "--model-b", MODEL),
        *("--num-prompts", "3", "--concurrency", "1", "--repeats", "2", "--out", str(tmp_path), *SMALL),
    )
    assert code == 0, err
    assert "| metric (ms, /s)" in out and "B/A" in out
    ratio_line = next(line for line in out.splitlines() if line.startswith("| TTFT p50"))
    assert float(ratio_line.split("|")[4]) > 0  # the B/A column
    (point,) = json.loads((tmp_path / "compare.json").read_text())["points"]
    assert [s["requests"] for s in point["summaries"]] == [6, 6]  # 3 prompts x 2 repeats per side
    assert point["ratios"]["req/s"] > 0 and len(point["ratios_per_repeat"]) == 2


def test_bench_compare_starts_a_config_beside_a_url_and_deletes_it(
    api_server, client, demo_models, capsys, tmp_path
):
    from raylane.bench.serving import serving_config

    llama = str(demo_models[MODEL])
    config = serving_config(llama, False, max_num_seqs=4, num_kv_blocks=128, cpus_per_rank=0.5)
    (tmp_path / "off.yaml").write_text(config.to_yaml())
    code, out, err = bench(
        capsys,
        "compare",
        *("--config-a", str(tmp_path / "off.yaml"), "--label-a", "cache-off"),
        *("--base-url-b", api_server.base_url, "--model-b", MODEL, "--label-b", "session"),
        *("--dataset", "prefix", "--prefix-len", "64", "--prefix-output-len", "4", "--tokenizer", llama),
        *("--num-prompts", "3", "--concurrency", "1", "--repeats", "2", "--no-progress"),
        *("--out", str(tmp_path)),
    )
    assert code == 0, err
    # Memory: the config side's replicas (gateway, pool, its engine) and its share of Ray's processes;
    # none for the URL's side, served by an app this command did not start.
    memory = json.loads((tmp_path / "compare.json").read_text())["points"][0]["memory_mib"]
    assert memory["sides"][0] > 200 and memory["sides"][1] is None, memory
    assert re.search(r"\| memory PSS MiB +\| +[0-9.]+ \| +- \|", out), out
    port = api_server.url.rsplit(":", 1)[1]  # the session's Serve: one HTTP listener, a new prefix
    assert f"A = cache-off: chat @ http://127.0.0.1:{port}/a/v1" in out
    assert f"B = session: {MODEL} @ {api_server.base_url}" in out
    assert re.search(r"\| errors +\| +0 \| +0 \|", out), out
    assert bench_apps() == []
    # The session's own app was left alone.
    reply = client.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert reply.usage.completion_tokens >= 1


def test_bench_compare_names_a_bad_config(capsys, tmp_path):
    (tmp_path / "bad.yaml").write_text("pools: []\n")
    code, _, err = bench(
        capsys, "compare", "--config-a", str(tmp_path / "bad.yaml"), "--base-url-b", "http://x/v1"
    )
    assert code == 1 and "bad.yaml" in err and "pools" in err


def test_bench_router_compares_auto_with_a_named_model(api_server, capsys, tmp_path):
    code, out, err = bench(
        capsys,
        "router",
        *("--no-classifier", "--base-url", api_server.base_url, "--model", MODEL),
        *("--live-pairs", "4", "--live-output-len", "4", "--out", str(tmp_path)),
    )
    assert code == 0, err
    live = json.loads((tmp_path / "router.json").read_text())["auto_vs_named"]
    summary, records = live["summary"], live["records"]
    assert summary["pairs"] == len(records) == 4 and summary["errors"] == 0
    # Named requests all go to the chat pool; auto ones wherever the classifier sent them (this app
    # has chat and reasoning), and only pairs served by the same pool are compared.
    assert {named["pool"] for _, named in records} == {"chat"}
    assert {auto["pool"] for auto, _ in records} <= {"chat", "reasoning"}
    same_pool = sum(auto["pool"] == "chat" for auto, _ in records)
    assert summary["compared"] == same_pool and summary["other_pool"] == 4 - same_pool
    assert sum(summary["auto_routes"].values()) == 4
    assert "TTFT auto - named" in out and "E2E auto - named" in out and "goal <= 15 ms" in out
    if same_pool:
        assert summary["e2e"]["auto"]["p50"] > 0 and summary["e2e"]["named"]["p50"] > 0


def test_bench_overhead_runs_the_same_work_on_both_sides(api_server):
    from ray import serve

    from raylane.bench.overhead import run_overhead
    from raylane.bench.serve_floor import floor_app
    from tests.live_servers import wait_healthy

    pool = next(p for p in api_server.config.pools if p.name == "chat")
    requests = random_requests(3, 0, TokenCounter(model_path(pool)), 24, 8, 0.5)
    serve.run(floor_app(), name="bench-serve-floor", route_prefix="/serve-floor")
    try:
        floor_root = api_server.base_url.removesuffix("/v1") + "/serve-floor"
        wait_healthy(f"{floor_root}/health", 60)  # the proxy learns the new route a moment later
        floor_url = f"{floor_root}/v1"
        result = run_overhead(api_server.base_url, "x", pool, requests, 1, "proxy", floor_url)
    finally:
        serve.delete("bench-serve-floor")
    summary = result["summary"]
    assert summary["requests"] == 3 and summary["http_errors"] == 0
    # Greedy, same engine config, same prompt rendering: the HTTP stream and the engine agree.
    assert summary["identical_outputs"] == 3 and summary["same_token_counts"] == 3
    assert all(
        p["http"]["output_tokens"] == r.max_tokens for p, r in zip(result["pairs"], requests, strict=True)
    )
    for side in ("http", "engine", "floor"):
        assert 0 < summary["ttft"][side]["p50"] <= summary["e2e"][side]["p50"]
    assert {p["first"] for p in result["pairs"]} == {"http", "engine"}  # alternated
    # Serve's floor streamed the engine's outputs back through Serve and the SDK, usage included.
    assert summary["floor_identical_outputs"] == 3
    assert all(p["floor"]["output_tokens"] == p["engine"]["output_tokens"] for p in result["pairs"])


@pytest.mark.timeout(1200)
def test_bench_report_writes_tables_and_rewrites_only_the_marked_sections(
    api_server, demo_models, capsys, tmp_path
):
    docs = tmp_path / "docs"
    (docs / "bench").mkdir(parents=True)
    (docs / "docs").mkdir()
    marked = "<!-- bench-report:summary -->\nold figures\n<!-- /bench-report:summary -->"
    page = f"# Performance\n\nBefore.\n{marked}\nAfter.\n"
    (docs / "docs" / "performance.md").write_text(page)
    (docs / "bench" / "README.md").write_text(
        "# Benchmarks\n<!-- bench-report:full -->\n<!-- /bench-report:full -->\n"
    )
    out_dir = tmp_path / "out"
    code, out, err = bench(
        capsys,
        "report",
        *("--out", str(out_dir), "--quick", "--skip", "engine,affinity", "--num-prompts", "4"),
        *("--concurrency", "1,4"),  # (the sweep's default ends at 16: 32 requests more, nothing more checked)
        *("--model", str(demo_models[MODEL]), "--update-docs", "--docs-root", str(docs)),
    )
    assert code == 0, err
    assert bench_apps() == []
    report = (out_dir / "report.md").read_text()
    for title in ("2. Serving overhead", "3. `auto` routing", "4. Prefix cache", "5. Throughput"):
        assert title in report
    assert "1. Engine\n\nNot measured in this run (skipped)." in report
    assert "raylane-llama-tiny" in report and "cores" in report  # the model and the machine are named
    goals = [line for line in report.splitlines() if "goal" in line and ("met" in line)]
    assert len(goals) >= 4
    summary = (docs / "docs" / "performance.md").read_text()
    assert summary.startswith("# Performance\n\nBefore.\n<!-- bench-report:summary -->\nMeasured ")
    assert summary.endswith("<!-- /bench-report:summary -->\nAfter.\n") and "old figures" not in summary
    assert "| prefix-cache TTFT p50 gain" in summary
    full = (docs / "bench" / "README.md").read_text()
    assert "#### 5. Throughput and latency across concurrency" in full
    data = json.loads((out_dir / "report.json").read_text())
    assert set(data["parts"]) == {"overhead", "routing", "prefix", "sweep"}
    # The JSON behind the rewritten sections is checked in beside them, and they name it.
    assert json.loads((docs / "bench" / "results" / "report.json").read_text()) == data
    assert "JSON: `bench/results/report.json`." in summary and "JSON: `bench/results/report.json`." in full
    points = data["parts"]["sweep"]["points"]
    assert [p["concurrency"] for p in points] == [1, 4]
    # No request was refused: the bench's own tier has no rate limit (the default one would 429).
    assert all(p["errors"] == 0 and p["completed"] == p["requests"] for p in points)
    assert Path(out_dir / "sweep.png").stat().st_size > 0 and (out_dir / "configs" / "main.yaml").is_file()
