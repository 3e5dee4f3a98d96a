"""guidellm and aiperf, each a 20-second streamed chat benchmark against the server: every request
must succeed. Both count tokens with the served model's own tokenizer (the folder raylane converts
from the GGUF file)."""

import json
import os
import subprocess
from pathlib import Path

from tests.compat.conftest import FIGURES, MODEL, REPO

BIN = REPO / ".venv-compat" / "bin"
SECONDS = 20


def run(command: list[str], env: dict, cwd: Path, timeout: float = 240) -> str:
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-5000:]
    return output


def test_guidellm_chat_benchmark_has_no_errors(server, model_files, tmp_path):
    """guidellm's chat requests: content as text parts, streamed with continuous_usage_stats."""
    report = tmp_path / "benchmarks.json"
    options = (
        f"--backend kind=openai_http,target={server.url},model={MODEL} --profile kind=concurrent,streams=2 "
        f"--constraint kind=max_duration,seconds={SECONDS} "
        "--data kind=synthetic_text,prompt_tokens=128,output_tokens=32 "
        f"--tokenizer kind=huggingface_auto,model={model_files['tokenizer']} "
        f"--output kind=json,path={report} --disable-console-interactive"
    )
    run([str(BIN / "guidellm"), "run", *options.split()], os.environ, tmp_path)
    benchmark = json.loads(report.read_text())["benchmarks"][0]
    metrics, totals = benchmark["metrics"], benchmark["metrics"]["request_totals"]
    errors = [r.get("error") for r in benchmark["requests"]["errored"][:3]]
    assert totals["errored"] == 0 and totals["successful"] > 0, f"{totals}; first errors: {errors}"

    def median(name: str) -> float:
        return metrics[name]["successful"]["median"]

    FIGURES["guidellm (concurrency 2, 128 in / 32 out, 20 s)"] = (
        f"{totals['successful']} ok, {totals['errored']} errors, {totals['incomplete']} cut at the end; "
        f"TTFT median {median('time_to_first_token_ms'):.0f} ms, ITL median "
        f"{median('inter_token_latency_ms'):.1f} ms, {median('output_tokens_per_second'):.1f} output tok/s"
    )


def test_aiperf_chat_benchmark_has_no_errors(server, model_files, tmp_path):
    """aiperf's offline mode cannot load a tokenizer from a local folder (it looks the path up in the
    Hugging Face cache as a repo id: HFValidationError), so it runs in its online mode with the hub's
    address pointed at a closed local port: a local folder needs no hub, and nothing leaves the box."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env["HF_ENDPOINT"] = "http://127.0.0.1:9"
    artifacts = tmp_path / "aiperf"
    options = (
        f"--model {MODEL} --url {server.url} --endpoint-type chat --streaming --concurrency 2 "
        f"--benchmark-duration {SECONDS} --benchmark-grace-period 30 --tokenizer {model_files['tokenizer']} "
        f"--isl 128 --osl 32 --artifact-dir {artifacts} --ui-type none --no-gpu-telemetry --no-server-metrics"
    )
    run([str(BIN / "aiperf"), "profile", *options.split()], env, tmp_path)
    result = json.loads((artifacts / "profile_export_aiperf.json").read_text())
    assert result["error_summary"] == [] and not result["was_cancelled"]
    assert result["request_count"]["avg"] > 0
    FIGURES["aiperf (concurrency 2, 128 in / 32 out, 20 s)"] = (
        f"{result['request_count']['avg']:.0f} requests, 0 errors; "
        f"TTFT median {result['time_to_first_token']['p50']:.0f} ms, "
        f"ITL median {result['inter_token_latency']['p50']:.1f} ms, "
        f"{result['output_token_throughput']['avg']:.1f} output tok/s"
    )
