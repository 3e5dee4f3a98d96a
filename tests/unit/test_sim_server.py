"""`raylane sim-server`: a simulated engine behind an OpenAI server in one process, as a router that
fronts vLLM servers sees it (the `openai` SDK, vLLM's /metrics names)."""

import threading
import time

import httpx2 as httpx
import openai
import pytest
import uvicorn

from raylane.cluster.serve_env import free_port
from raylane.cluster.sim_server import build_app

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
HELLO = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def server():
    port = free_port()
    app = build_app("llama-3.1-8b-h100")
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.05)
    yield url
    uv.should_exit = True
    thread.join(timeout=10)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0, timeout=30)


def test_chat_whole_and_streamed_say_the_same(client):
    whole = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=12)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=HELLO, max_tokens=12, stream=True, stream_options={"include_usage": True}
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert whole.choices[0].message.content == streamed and streamed.strip()
    assert whole.usage.completion_tokens == chunks[-1].usage.completion_tokens == 12
    assert whole.usage.prompt_tokens == chunks[-1].usage.prompt_tokens > 0


def test_completions_and_models(client):
    out = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 5
    assert [m.id for m in client.models.list()] == [MODEL]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(model=MODEL, messages=HELLO, response_format={"type": "json_object"})


def test_metrics_carry_vllms_names(client, server):
    prefix = [{"role": "system", "content": "You are terse. " * 40}]
    for question in ("One?", "Two?"):
        client.chat.completions.create(model=MODEL, messages=[*prefix, {"role": "user", "content": question}])
    text = httpx.get(f"{server}/metrics", timeout=10).text
    values = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:") and "{" in line
    }
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:gpu_cache_usage_perc",
        "vllm:kv_cache_usage_perc",
        "vllm:time_to_first_token_seconds_count",
        "vllm:time_per_output_token_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
    ):
        assert name in values, name
    assert values["vllm:prefix_cache_hits_total"] > 0  # the second request found the system prompt cached
    assert values["vllm:prefix_cache_queries_total"] >= values["vllm:prefix_cache_hits_total"]
    assert 'model_name="meta-llama/Llama-3.1-8B-Instruct"' in text
