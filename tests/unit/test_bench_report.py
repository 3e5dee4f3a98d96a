"""`raylane bench report`'s output on known figures: goals not met are said plainly with the measured
number, and rewriting the docs touches only the marked section (the live run is in
tests/integration/test_bench_live.py)."""

import pytest

from raylane.bench.report import ReportError, measured, replace_marked
from raylane.bench.report_markdown import full_markdown, summary_markdown


def stats(p50: float, p99: float | None = None) -> dict[str, float]:
    return {"mean": p50, "p50": p50, "p90": p99 or p50, "p99": p99 or p50}


def sweep_point(concurrency: int, throughput: float) -> dict:
    return {
        "concurrency": concurrency,
        "request_throughput": throughput / 50,
        "output_throughput": throughput,
        "ttft": stats(40.0),
        "tpot": stats(5.0),
        "e2e": stats(300.0),
        "errors": 0,
    }


def report(sweep: list[tuple[int, float]], gain: float) -> dict:
    prefix = {
        "requests_per_side": 32,
        "prompt_tokens": 1060,
        "prefix_tokens": 1024,
        "question_tokens": 16,
        "output_tokens": 16,
        "off": {"ttft": stats(200.0), "e2e": stats(300.0)},
        "on": {"ttft": stats(200.0 / gain), "e2e": stats(100.0)},
        "ttft_p50_gain": gain,
        "ttft_p50_gain_per_repeat": [gain, gain],
        "goal": 3.0,
        "goal_met": gain >= 3,
        "other_load": 0.05,
    }
    points = [sweep_point(c, t) for c, t in sweep]
    rising = all(b[1] > a[1] for a, b in zip(sweep, sweep[1:], strict=False))
    sweep_part = {
        "max_num_seqs": 16,
        "requests_per_point": 32,
        "mean_prompt_tokens": 128.0,
        "mean_output_tokens": 64.0,
        "points": points,
        "goal_met": rising,
        "other_load": 0.02,
    }
    return {
        "date": "2026-11-30",
        "command": "raylane bench report --out results",
        "machine": {"cpu": "AMD EPYC", "cores": 2, "torch": "2.13.0+cpu", "python": "3.11.7"},
        "quick": False,
        "serving_model": {
            "name": "raylane-llama-tiny",
            "params": 3950848,
            "engine": {"max_num_seqs": 16, "num_kv_blocks": 1024, "cpus_per_rank": 1.0},
        },
        "parts": {"prefix": prefix, "sweep": sweep_part, "routing": {"error": "RuntimeError: boom"}},
    }


def test_goals_met_and_not_met_are_stated_with_the_measured_figures():
    summary = summary_markdown(report(sweep=[(1, 100.0), (4, 300.0), (16, 250.0)], gain=2.4))
    assert "| prefix-cache TTFT p50 gain (cache on vs off) | >= 3x | 2.4x | **NOT met** |" in summary
    assert (
        "| output tokens/s across concurrency | rising | 100 tok/s at 1 -> 250 at 16 | **NOT met** |"
        in summary
    )
    assert (
        "up to 5% of the CPUs during a part." in summary and "raylane-llama-tiny (4.0M parameters)" in summary
    )
    full = full_markdown(report(sweep=[(1, 100.0), (4, 300.0), (16, 250.0)], gain=2.4))
    assert "not rising: 300 -> 250 from 4 to 16" in full
    assert "TTFT p50 **2.4x** lower with caching" in full and "AMD EPYC, 2 cores" in full


def test_parts_measured_under_other_load_are_marked_rough():
    noisy = report(sweep=[(1, 100.0), (2, 180.0)], gain=7.0)
    noisy["parts"]["sweep"]["other_load"] = 0.4
    assert "up to 40% of the CPUs during a part (over 10% in 5. Concurrency sweep" in summary_markdown(noisy)
    assert "other load 40% (over 10%: rough figures)" in full_markdown(noisy)
    assert "other load 5%." in full_markdown(noisy)  # the quiet part is not marked


def test_skipped_and_failed_parts_say_so_instead_of_showing_figures():
    good = report(sweep=[(1, 100.0), (2, 180.0), (4, 300.0)], gain=7.0)
    full = full_markdown(good)
    assert "#### 1. Engine\n\nNot measured in this run (skipped)." in full
    assert "#### 3. `auto` routing\n\nNot measured: the part failed (RuntimeError: boom)." in full
    assert "rising at every step (goal: rising with concurrency: met)" in full
    summary = summary_markdown(good)
    assert (
        "Not measured in this run: 1. Engine, 2. Serving overhead, 3. `auto` routing, 6. Replica affinity."
        in summary
    )
    assert "| prefix-cache TTFT p50 gain (cache on vs off) | >= 3x | 7.0x | met |" in summary


def test_replace_marked_rewrites_only_between_the_markers():
    text = "intro\n<!-- bench-report:full -->\nold\nlines\n<!-- /bench-report:full -->\noutro\n"
    assert replace_marked(text, "full", "new\n") == (
        "intro\n<!-- bench-report:full -->\nnew\n<!-- /bench-report:full -->\noutro\n"
    )
    with pytest.raises(ReportError, match="README.md has no <!-- bench-report:summary -->"):
        replace_marked(text, "summary", "x", "README.md")
    with pytest.raises(ReportError):  # the closing marker before the opening one
        replace_marked("<!-- /bench-report:full --> <!-- bench-report:full -->", "full", "x")


def overhead_part(ttft: float, e2e: float, ingress: str) -> dict:
    side = {"http": stats(60.0), "engine": stats(50.0)}
    return {
        "machine": {"torch_threads": 1},
        "dataset_prompt_tokens": 130.0,
        "other_load": 0.01,
        "summary": {
            "ingress": ingress,
            "requests": 32,
            "identical_outputs": 32,
            "ttft": side | {"overhead_p50_ms": ttft},
            "e2e": side | {"overhead_p50_ms": e2e},
            "goal_ms": 15.0,
            "goal_met": max(ttft, e2e) <= 15,
        },
    }


def test_the_overhead_behind_haproxy_is_reported_beside_the_proxy_one():
    both = report(sweep=[(1, 100.0), (2, 180.0)], gain=7.0)
    both["parts"]["overhead"] = overhead_part(10.5, 21.0, "proxy") | {
        "other_ingress": overhead_part(8.0, 12.5, "haproxy")
    }
    summary = summary_markdown(both)
    assert (
        "| serving overhead over the engine, p50, concurrency 1 (proxy) | <= 15 ms | TTFT +10.5 ms, "
        "E2E +21.0 ms | **NOT met** |" in summary
    )
    assert "| the same, `http.ingress: haproxy` | <= 15 ms | TTFT +8.0 ms, E2E +12.5 ms | met |" in summary
    full = full_markdown(both)
    assert "| E2E HTTP: HAProxy, gateway, pool" in full and "| E2E HTTP: proxy, gateway, pool" in full
    assert "serving adds **8.0 ms** to TTFT p50 and **12.5 ms** to E2E p50 (goal <= 15 ms: met)" in full
    assert "behind `http.ingress: haproxy` (Serve's HAProxy direct ingress" in full
    failed = {"error": "LocalServeError: --ingress haproxy: no HAProxy binary"}
    both["parts"]["overhead"]["other_ingress"] = failed
    assert "Behind the other `http.ingress`: failed (LocalServeError" in full_markdown(both)


def test_the_report_says_how_much_of_the_overhead_is_serves_own():
    both = report(sweep=[(1, 100.0), (2, 180.0)], gain=7.0)
    part = overhead_part(24.0, 46.0, "proxy")
    s = part["summary"]
    s["ttft"] |= {"floor": stats(70.0), "floor_over_engine_p50_ms": 21.0, "raylane_over_floor_p50_ms": 3.0}
    s["e2e"] |= {"floor": stats(80.0), "floor_over_engine_p50_ms": 28.0, "raylane_over_floor_p50_ms": 18.0}
    both["parts"]["overhead"] = part
    assert (
        "| of that, Serve's own path, no raylane code (`bench/serve_floor.py`) |  "
        "| TTFT +21.0 ms, E2E +28.0 ms |  |" in summary_markdown(both)
    )
    full = full_markdown(both)
    assert "| TTFT Serve's floor: proxy, bare ingress, stand-in pool | 70.0 |" in full
    assert (
        "adds **21.0 ms** to TTFT p50 and **28.0 ms** to E2E p50; "
        "raylane's own code the rest, +3.0 ms and +18.0 ms" in full
    )


def test_a_report_that_updates_the_docs_names_its_checked_in_json():
    data = report([(1, 100.0), (2, 150.0)], gain=6.0) | {"kept_json": "bench/results/report.json"}
    assert "JSON: `bench/results/report.json`." in full_markdown(data)
    assert "JSON: `bench/results/report.json`." in summary_markdown(data)
    assert "bench/results/report.json" not in full_markdown(report([(1, 100.0), (2, 150.0)], gain=6.0))


def test_the_replica_affinity_part_reports_its_three_goals():
    """The part as `raylane bench affinity` writes it (a made-up run: one goal missed)."""
    from raylane.bench.affinity import goals

    def side(hit_rate: float, computed: int, ttft_s: float) -> dict:
        return {"hit_rate": hit_rate, "computed_tokens": computed, "mean_ttft_s": ttft_s, "requests": 96}

    results = {
        "raylane": side(0.8, 1000, 0.3),
        "serve-default": side(0.5, 4000, 0.4),
        "single": side(0.85, 900, 0.2),
    }
    settings = {"prompts": 8, "prompt_chars": 2000, "concurrency": 8, "rounds": 6, "per_round": 16}
    run = report(sweep=[(1, 100.0), (2, 180.0)], gain=7.0)
    run["parts"]["affinity"] = {
        "results": results,
        "goals": goals(results),
        "settings": settings,
        "other_load": 0.05,
    }
    summary, full = summary_markdown(run), full_markdown(run)
    assert "| two replicas' prefix-cache hit rate against one replica's | >= 0.9x | 0.94x | met |" in summary
    assert "| prompt tokens computed, Serve's router / raylane's | >= 1.5x | 4.00x | met |" in summary
    assert "| mean TTFT, Serve's router / raylane's | >= 1.5x | 1.33x | **NOT met** |" in summary
    assert "| 2 replicas, Serve's default router | 0.50 | 0.59x | 4,000 | 400 ms |" in full
    assert "6. Replica affinity" not in summary.split("Not measured in this run:")[-1]


def test_a_part_that_meters_its_own_other_load_keeps_that_figure():
    """The affinity part starts and stops a Ray of its own: metered across that teardown, its workers'
    CPU (unreaped by this process tree) reads as other processes' load (85% in a quiet run)."""
    assert measured("affinity", lambda: {"goals": {}, "other_load": 0.01})["other_load"] == 0.01
    assert "other_load" in measured("sweep", lambda: {"points": []})  # the part's meter, where it has none
