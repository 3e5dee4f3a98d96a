"""Markdown of a `raylane bench report` run: the full tables (bench/README.md) and a summary table of
the goals (docs/performance.md). Pure functions of the report dict; a part that was skipped or failed
says so."""

from typing import Any

# Above this share of the CPUs used by other processes, a part's figures are marked as rough.
NOISY_LOAD = 0.10


def pct(fraction: float | None) -> str:
    if fraction is None:
        return "?"
    return f"{100 * fraction:.0f}%" + (" (over 10%: rough figures)" if fraction > NOISY_LOAD else "")


def met(ok: bool) -> str:
    return "met" if ok else "**NOT met**"


def table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def machine_line(report: dict[str, Any]) -> str:
    m = report["machine"]
    return f"{m['cpu']}, {m['cores']} cores, torch {m['torch']}, Python {m['python']}"


def kept_json_text(report: dict[str, Any]) -> str:
    """Where the run's JSON is checked in (`--update-docs`), as a sentence; empty otherwise."""
    return f" JSON: `{report['kept_json']}`." if report.get("kept_json") else ""


def serving_model_line(report: dict[str, Any]) -> str:
    model = report.get("serving_model")
    if not model:
        return ""
    engine = model["engine"]
    cpus, seqs, blocks = engine["cpus_per_rank"], engine["max_num_seqs"], engine["num_kv_blocks"]
    return (
        f"Serving model (parts 2-5): {model['name']} ({model['params']:,} parameters, float32), "
        f"one replica with {cpus:g} CPU (Ray gives it one torch thread), max_num_seqs {seqs}, "
        f"{blocks} KV blocks of 16 tokens; app `main` has prefix caching on, `nocache` off "
        "(configs in OUT/configs/, from bench/serving.py). Every route of `main` points at its one pool."
    )


def engine_section(part: dict[str, Any]) -> str:
    tp, step, model, args = part["throughput"], part["step_overhead"], part["model"], part["args"]
    labels = {
        "hf": "HF `generate`",
        "raylane": "raylane `LLM.generate`",
        "raylane_torch_linear": "raylane, torch's matmul (`cpu_weight_prepack: false`)",
    }
    rows = []
    for name in tp.get("runs", ["hf", "raylane"]):
        r, label = tp[name], labels[name]
        rows.append(
            [
                label,
                f"{r['wall_s']['median']:.1f}",
                f"{r['tokens_per_s']['median']:.0f}",
                f"{r['requests_per_s']['median']:.2f}",
            ]
        )
    speedup, overhead = tp["speedup_median"], step["overhead_pct"]
    return "\n".join(
        [
            "#### 1. Engine: raylane against Hugging Face `generate`",
            "",
            f"{model['name']} ({model['params']:,} parameters, {args.get('dtype', 'float32')}), "
            f"{tp['num_prompts']} prompts "
            f"with long-tailed output lengths ({tp['useful_tokens']} useful tokens), max batch "
            f"{args['max_batch_size']}, {args['repeats']} run(s) each (median), "
            f"{part['machine']['torch_threads']} torch threads; other load {pct(part.get('other_load'))}.",
            "",
            table(["", "wall s", "useful tokens/s", "requests/s"], rows),
            "",
            f"- raylane / HF: **{speedup:.2f}x** (goal >= 3x: {met(speedup >= 3)}); greedy outputs "
            f"identical to HF: {tp['greedy_outputs_identical']}/{tp['num_prompts']}",
            *(
                [
                    f"- with torch's own matmul instead of oneDNN's prepacked linears: "
                    f"{tp['speedup_torch_linear_median']:.2f}x HF (what the scheduling alone gives)"
                ]
                if "speedup_torch_linear_median" in tp
                else []
            ),
            f"- decode step of {step['batch_size']} requests: bare forward "
            f"{step['bare_forward_ms_median']:.1f} ms, "
            f"`engine.step()` {step['engine_step_ms_median']:.1f} ms: **{overhead:+.1f}%** "
            f"(goal <= 25%: {met(overhead <= 25)})",
        ]
    )


def overhead_section(part: dict[str, Any]) -> str:
    from raylane.bench.overhead import table_rows

    s = part["summary"]
    ttft, e2e = s["ttft"]["overhead_p50_ms"], s["e2e"]["overhead_p50_ms"]
    return "\n".join(
        [
            "#### 2. Serving overhead: HTTP through gateway and router against the engine in-process",
            "",
            f"{s['requests']} chat requests (random words, ~{part['dataset_prompt_tokens']:.0f} prompt "
            "tokens, 32 output tokens), concurrency 1; each request went to both sides, which went first "
            "alternating. "
            f"The in-process `AsyncLLM` has the pool's engine config and {part['machine']['torch_threads']} "
            f"torch thread(s), like the replica; other load {pct(part.get('other_load'))}.",
            "",
            table(["latency (ms)", "p50", "p99"], table_rows(s)),
            "",
            f"- serving adds **{ttft:.1f} ms** to TTFT p50 and **{e2e:.1f} ms** to E2E p50 "
            f"(goal <= {s['goal_ms']:g} ms: {met(s['goal_met'])}); greedy outputs identical on both sides: "
            f"{s['identical_outputs']}/{s['requests']}",
            *floor_lines(s),
            *other_ingress_lines(part.get("other_ingress")),
        ]
    )


def floor_lines(s: dict[str, Any]) -> list[str]:
    """How the overhead splits between Serve's own path and raylane's code, when the floor ran."""
    from raylane.bench.overhead import front_label

    if "floor" not in s["ttft"]:
        return []
    ttft, e2e = s["ttft"], s["e2e"]
    return [
        f"- of that, Serve's floor (the same {front_label(s['ingress'])}, "
        "ingress replica and handle call, a bare FastAPI ingress and a stand-in pool that replays the "
        "engine's outputs at their in-process times: `bench/serve_floor.py`) adds "
        f"**{ttft['floor_over_engine_p50_ms']:.1f} ms** to TTFT p50 and "
        f"**{e2e['floor_over_engine_p50_ms']:.1f} ms** to E2E p50; raylane's own code the rest, "
        f"{ttft['raylane_over_floor_p50_ms']:+.1f} ms and {e2e['raylane_over_floor_p50_ms']:+.1f} ms"
    ]


def overhead_cells(s: dict[str, Any]) -> list[str]:
    measured = f"TTFT {s['ttft']['overhead_p50_ms']:+.1f} ms, E2E {s['e2e']['overhead_p50_ms']:+.1f} ms"
    return ["<= 15 ms", measured, met(s["goal_met"])]


def floor_row(s: dict[str, Any]) -> list[list[str]]:
    if "floor" not in s["ttft"]:
        return []
    ttft, e2e = s["ttft"]["floor_over_engine_p50_ms"], s["e2e"]["floor_over_engine_p50_ms"]
    measured = f"TTFT {ttft:+.1f} ms, E2E {e2e:+.1f} ms"
    return [["of that, Serve's own path, no raylane code (`bench/serve_floor.py`)", "", measured, ""]]


INGRESS_WORDS = {
    "haproxy": "Serve's HAProxy direct ingress: HAProxy forwards connections to the gateway replica, "
    "which serves HTTP itself",
    "proxy": "Serve's proxy actor passes each request and streamed chunk on to the gateway replica",
}


def other_ingress_lines(part: dict[str, Any] | None) -> list[str]:
    """The same measurement behind the other `http.ingress`, when the report made it."""
    from raylane.bench.overhead import table_rows

    if not part:
        return []
    if "error" in part:
        return ["", f"Behind the other `http.ingress`: failed ({part['error']})."]
    s = part["summary"]
    ttft, e2e = s["ttft"]["overhead_p50_ms"], s["e2e"]["overhead_p50_ms"]
    return [
        "",
        f"The same requests with the main config behind `http.ingress: {s['ingress']}` "
        f"({INGRESS_WORDS[s['ingress']]}), in a Ray of its own; other load {pct(part.get('other_load'))}:",
        "",
        table(["latency (ms)", "p50", "p99"], table_rows(s)),
        "",
        f"- serving adds **{ttft:.1f} ms** to TTFT p50 and **{e2e:.1f} ms** to E2E p50 "
        f"(goal <= {s['goal_ms']:g} ms: {met(s['goal_met'])}); greedy outputs identical: "
        f"{s['identical_outputs']}/{s['requests']}",
        *floor_lines(s),
    ]


def routing_section(part: dict[str, Any]) -> str:
    from raylane.bench.router import auto_vs_named_rows

    s = part["summary"]
    routes = ", ".join(f"{r} {n}" for r, n in sorted(s["auto_routes"].items()))
    return "\n".join(
        [
            "#### 3. `auto` routing against a named model, end to end",
            "",
            f"{s['pairs']} pairs of new ~200-token prompts ({part['output_len']} output tokens), `auto` "
            f"and `{part['named_model']}` back to back, the order alternating; {s['compared']} pairs "
            f"served by the same pool compared (auto chose: {routes}); "
            f"other load {pct(part.get('other_load'))}.",
            "",
            table(["latency (ms)", "p50", "p99"], auto_vs_named_rows(s)),
            "",
            f"- `auto` adds **{s['e2e']['added_p50_ms']:.1f} ms** to E2E p50 and "
            f"{s['ttft']['added_p50_ms']:.1f} ms to TTFT p50 "
            f"(goal <= {s['goal_ms']:g} ms: {met(s['goal_met'])})",
        ]
    )


def prefix_section(part: dict[str, Any]) -> str:
    rows = []
    for side, label in (("off", "prefix caching off"), ("on", "prefix caching on")):
        r = part[side]
        rows.append([label, f"{r['ttft']['p50']:.1f}", f"{r['ttft']['p99']:.1f}", f"{r['e2e']['p50']:.1f}"])
    spread = ", ".join(f"{g:.1f}x" for g in part["ttft_p50_gain_per_repeat"])
    return "\n".join(
        [
            "#### 4. Prefix cache: TTFT on the `prefix` dataset, caching on against off",
            "",
            f"{part['requests_per_side']} requests per side over 2 alternated repeats, concurrency 1; "
            f"each prompt is a {part['prefix_tokens']}-token shared system prompt and a "
            f"{part['question_tokens']}-token question "
            f"({part['prompt_tokens']} tokens counted with the model's tokenizer, before the chat template), "
            f"{part['output_tokens']} output tokens; other load {pct(part.get('other_load'))}.",
            "",
            table(["", "TTFT p50 ms", "TTFT p99 ms", "E2E p50 ms"], rows),
            "",
            f"- TTFT p50 **{part['ttft_p50_gain']:.1f}x** lower with caching (per repeat: {spread}; "
            f"goal >= {part['goal']:g}x: {met(part['goal_met'])})",
        ]
    )


def sweep_section(part: dict[str, Any]) -> str:
    rows = []
    for p in part["points"]:
        rows.append(
            [
                str(p["concurrency"]),
                f"{p['request_throughput']:.2f}",
                f"{p['output_throughput']:.0f}",
                f"{p['ttft']['p50']:.0f}",
                f"{p['ttft']['p99']:.0f}",
                f"{p['tpot']['p50']:.1f}",
                f"{p['e2e']['p50']:.0f}",
                ", ".join(f"{code}: {n}" for code, n in p.get("errors_by_status", {}).items()) or "0",
            ]
        )
    return "\n".join(
        [
            "#### 5. Throughput and latency across concurrency",
            "",
            f"{part['requests_per_point']} requests per point (random words, "
            f"~{part['mean_prompt_tokens']:.0f} prompt tokens, ~{part['mean_output_tokens']:.0f} output "
            f"tokens, ignore_eos), streamed through the gateway; max_num_seqs {part['max_num_seqs']}; "
            f"other load {pct(part.get('other_load'))}.",
            "",
            table(
                [
                    "concurrency",
                    "req/s",
                    "output tok/s",
                    "TTFT p50",
                    "TTFT p99",
                    "TPOT p50",
                    "E2E p50",
                    "errors",
                ],
                rows,
            ),
            "",
            f"- {rising_text(part)} (goal: rising with concurrency: {met(part['goal_met'])}); "
            "latencies in ms",
        ]
    )


def rising_text(part: dict[str, Any]) -> str:
    points = part["points"]
    steps = [
        f"{a['output_throughput']:.0f} -> {b['output_throughput']:.0f} "
        f"from {a['concurrency']} to {b['concurrency']}"
        for a, b in zip(points, points[1:], strict=False)
        if b["output_throughput"] <= a["output_throughput"]
    ]
    first, last = points[0], points[-1]
    text = (
        f"output tokens/s {first['output_throughput']:.0f} at concurrency {first['concurrency']}, "
        f"{last['output_throughput']:.0f} at {last['concurrency']}"
    )
    return text + (f"; not rising: {'; '.join(steps)}" if steps else ", rising at every step")


def affinity_section(part: dict[str, Any]) -> str:
    results, goals, settings = part["results"], part["goals"], part["settings"]
    labels = {
        "raylane": "2 replicas, raylane's router",
        "serve-default": "2 replicas, Serve's default router",
        "single": "1 replica, the KV cache of both (reference)",
    }
    single = results["single"]["hit_rate"]
    rows = [
        [
            labels[name],
            f"{r['hit_rate']:.2f}",
            f"{r['hit_rate'] / single:.2f}x" if single else "?",
            f"{r['computed_tokens']:,}",
            "?" if r["mean_ttft_s"] is None else f"{1000 * r['mean_ttft_s']:.0f} ms",
        ]
        for name, r in results.items()
    ]
    return "\n\n".join(
        [
            "#### 6. Replica affinity: prefix-aware routing against Serve's default router",
            f"One pool of two replicas, {settings['prompts']} shared system prompts of "
            f"{settings['prompt_chars']} characters, short user turns, "
            f"concurrency {settings['concurrency']}, "
            f"{settings['rounds']} rounds of {settings['per_round']} requests per app, alternated "
            f"(bench/affinity.py); other load {pct(part.get('other_load'))}.",
            table(["router", "hit rate", "vs one replica", "prompt tokens computed", "mean TTFT"], rows),
            "; ".join(f"{name}: {_goal(g)}" for name, g in goals.items()) + ".",
        ]
    )


def _goal(goal: dict[str, Any]) -> str:
    value = "?" if goal["value"] is None else f"{goal['value']:.2f}x"
    return f"{value} (goal {goal['goal']}x: {met(goal['met'])})"


SECTIONS = {
    "engine": engine_section,
    "overhead": overhead_section,
    "routing": routing_section,
    "prefix": prefix_section,
    "sweep": sweep_section,
    "affinity": affinity_section,
}
TITLES = {
    "engine": "1. Engine",
    "overhead": "2. Serving overhead",
    "routing": "3. `auto` routing",
    "prefix": "4. Prefix cache",
    "sweep": "5. Concurrency sweep",
    "affinity": "6. Replica affinity",
}


def full_markdown(report: dict[str, Any]) -> str:
    blocks = [
        f"Measured {report['date']} with `{report['command']}` on {machine_line(report)}"
        + (" (a `--quick` run: few requests, rough figures)." if report["quick"] else ".")
        + kept_json_text(report),
    ]
    if line := serving_model_line(report):
        blocks.append(line)
    for name, section in SECTIONS.items():
        part = report["parts"].get(name)
        if part is None:
            blocks.append(f"#### {TITLES[name]}\n\nNot measured in this run (skipped).")
        elif "error" in part:
            blocks.append(f"#### {TITLES[name]}\n\nNot measured: the part failed ({part['error']}).")
        else:
            blocks.append(section(part))
    return "\n\n".join(blocks)


def summary_rows(report: dict[str, Any]) -> list[list[str]]:
    from raylane.bench.overhead import front_label

    parts = report["parts"]

    def ok(name: str) -> dict[str, Any] | None:
        part = parts.get(name)
        return part if part and "error" not in part else None

    rows = []
    if e := ok("engine"):
        speedup, overhead = e["throughput"]["speedup_median"], e["step_overhead"]["overhead_pct"]
        rows.append(
            ["engine throughput against HF `generate`", ">= 3x", f"{speedup:.2f}x", met(speedup >= 3)]
        )
        rows.append(
            ["engine decode step over a bare forward", "<= 25%", f"{overhead:+.1f}%", met(overhead <= 25)]
        )
    if o := ok("overhead"):
        front = front_label(o["summary"]["ingress"])
        rows.append(
            [f"serving overhead over the engine, p50, concurrency 1 ({front})", *overhead_cells(o["summary"])]
        )
        rows += floor_row(o["summary"])
        if "summary" in (h := o.get("other_ingress") or {}):
            other = h["summary"]
            rows.append([f"the same, `http.ingress: {other['ingress']}`", *overhead_cells(other)])
            rows += floor_row(other)
    if r := ok("routing"):
        s = r["summary"]
        measured = f"E2E {s['e2e']['added_p50_ms']:+.1f} ms (TTFT {s['ttft']['added_p50_ms']:+.1f} ms)"
        rows.append(["`auto` routing added to a named model, p50", "<= 15 ms", measured, met(s["goal_met"])])
    if p := ok("prefix"):
        rows.append(
            [
                "prefix-cache TTFT p50 gain (cache on vs off)",
                ">= 3x",
                f"{p['ttft_p50_gain']:.1f}x",
                met(p["goal_met"]),
            ]
        )
    if w := ok("sweep"):
        first, last = w["points"][0], w["points"][-1]
        measured = (
            f"{first['output_throughput']:.0f} tok/s at {first['concurrency']} -> "
            f"{last['output_throughput']:.0f} at {last['concurrency']}"
        )
        rows.append(["output tokens/s across concurrency", "rising", measured, met(w["goal_met"])])
    if a := ok("affinity"):
        g = a["goals"]
        for key, what, goal in (
            ("hit_rate_vs_single", "two replicas' prefix-cache hit rate against one replica's", ">= 0.9x"),
            ("computed_fewer_x", "prompt tokens computed, Serve's router / raylane's", ">= 1.5x"),
            ("ttft_lower_x", "mean TTFT, Serve's router / raylane's", ">= 1.5x"),
        ):
            value = "?" if g[key]["value"] is None else f"{g[key]['value']:.2f}x"
            rows.append([what, goal, value, met(g[key]["met"])])
    return rows


def summary_markdown(report: dict[str, Any]) -> str:
    parts = report["parts"]
    loads = [p.get("other_load") for p in parts.values() if p.get("other_load") is not None]
    models = []
    if (e := parts.get("engine")) and "model" in e:
        models.append(f"engine: {e['model']['name']} ({e['model']['params'] / 1e6:.1f}M parameters)")
    if model := report.get("serving_model"):
        models.append(f"serving: {model['name']} ({model['params'] / 1e6:.1f}M parameters)")
    missing = [TITLES[n] for n in SECTIONS if n not in parts or "error" in parts[n]]
    worst = max(loads) if loads else None
    load = "?" if worst is None else f"{100 * worst:.0f}%"
    noisy = [TITLES[n] for n, p in parts.items() if (p.get("other_load") or 0) > NOISY_LOAD]
    lines = [
        f"Measured {report['date']} with `{report['command']}` on {machine_line(report)}; "
        f"models: {'; '.join(models) or 'none'}. Other processes used up to {load} of the CPUs "
        "during a part"
        + (f" (over 10% in {', '.join(noisy)}: those figures are rough)" if noisy else "")
        + ". Tables and workloads: bench/README.md."
        + kept_json_text(report),
        "",
        table(["what", "goal", "measured", "goal met"], summary_rows(report)),
    ]
    if missing:
        lines += ["", f"Not measured in this run: {', '.join(missing)}."]
    return "\n".join(lines)
