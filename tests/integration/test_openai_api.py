"""The OpenAI API as an application sees it: the official `openai` SDK against the Serve app.

The pools serve random-weight demo models, so tests check what the API promises (shapes, exact
usage, determinism, constraints, streaming equal to non-streaming) rather than what the text says.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import jsonschema
import numpy as np
import openai
import pytest

from raylane.deployments.protocol.tool_calls import ToolCallStreamParser, parse_tool_calls
from tests.live_servers import alive, descendants

HELLO = [{"role": "user", "content": "Write one sentence about the sea."}]
WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Forecast for a city.",
            "parameters": WEATHER_PARAMS,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Local time in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
]
PARAMS_BY_NAME = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
# Forces the markup a tool-calling model writes, so `auto` parsing is exercised with a random model.
TOOL_MARKUP_REGEX = (
    r'Let me check\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
    r'\{"city": "(Paris|Tokyo)", "days": [1-7]\}\}\n</tool_call>'
)


@pytest.fixture(scope="module")
def tokenizer():
    from raylane.models.demo import load_tokenizer

    return load_tokenizer()


def prompt_tokens(tokenizer, messages, tools=None) -> int:
    """Transformers' count of the conversation's prompt. Control tokens inside message text count as
    the plain text they are (a sampled answer fed back may hold `<tool_call>`), as pools encode them."""
    ids = tokenizer.apply_chat_template(
        messages,
        tools=tools,
        add_generation_prompt=True,
        tokenize=True,
        sanitize_control_tokens=True,
        return_dict=False,
    )
    return len(ids)


def collect_stream(stream):
    """(content per choice, tool calls per choice, finish reasons, usage chunks, chunks) of an SDK stream."""
    content, calls, finish, usage, chunks = {}, {}, {}, [], []
    for chunk in stream:
        chunks.append(chunk)
        if chunk.usage is not None:
            usage.append(chunk.usage)
        for choice in chunk.choices:
            content.setdefault(choice.index, "")
            content[choice.index] += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                call = calls.setdefault(choice.index, {}).setdefault(tc.index, {"arguments": ""})
                if tc.id:
                    call["id"] = tc.id
                if tc.function and tc.function.name:
                    call["name"] = tc.function.name
                if tc.function and tc.function.arguments:
                    call["arguments"] += tc.function.arguments
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    return content, calls, finish, usage, chunks


def assert_valid_call(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), PARAMS_BY_NAME[name])


# -- chat ----------------------------------------------------------------------------------------


def test_chat_usage_counts_every_token(client, tokenizer):
    r = client.chat.completions.create(
        model="chat", messages=HELLO, max_tokens=12, temperature=0, logprobs=True
    )
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.model == "raylane-llama-tiny"
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == prompt_tokens(tokenizer, HELLO)
    assert r.usage.completion_tokens == len(choice.logprobs.content) > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    if choice.finish_reason == "length":
        assert r.usage.completion_tokens == 12


def test_pool_name_and_served_model_id_reach_the_same_pool(client):
    by_id = client.chat.completions.create(
        model="raylane-llama-tiny", messages=HELLO, max_tokens=6, temperature=0
    )
    by_pool = client.chat.completions.create(model="chat", messages=HELLO, max_tokens=6, temperature=0)
    assert by_id.choices[0].message.content == by_pool.choices[0].message.content


def test_streaming_chat_equals_non_streaming(client):
    full = client.chat.completions.create(model="reasoning", messages=HELLO, max_tokens=16, temperature=0)
    stream = client.chat.completions.create(
        model="reasoning", messages=HELLO, max_tokens=16, temperature=0, stream=True
    )
    content, _, finish, usage, chunks = collect_stream(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert content[0] == full.choices[0].message.content
    assert finish[0] == full.choices[0].finish_reason
    assert usage == []  # no usage chunk unless asked for


def test_stream_include_usage_ends_with_exact_usage(client, tokenizer):
    stream = client.chat.completions.create(
        model="chat",
        messages=HELLO,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        logprobs=True,
    )
    _, _, _, usage, chunks = collect_stream(stream)
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None and len(usage) == 1
    tokens = sum(
        len(c.choices[0].logprobs.content) for c in chunks[:-1] if c.choices and c.choices[0].logprobs
    )
    assert last.usage.prompt_tokens == prompt_tokens(tokenizer, HELLO)
    assert last.usage.completion_tokens == tokens > 0
    assert last.usage.total_tokens == last.usage.prompt_tokens + tokens


def test_continuous_usage_stats_count_the_tokens_sent_so_far(client, tokenizer):
    """vLLM's `continuous_usage_stats` (guidellm and aiperf ask for it): each chunk's usage counts the
    completion tokens sent up to and with it (counted here by their logprobs), chat and completions."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    common = dict(model="chat", max_tokens=8, temperature=0, stream=True, stream_options=options)
    chat = client.chat.completions.create(messages=HELLO, logprobs=True, **common)
    completion = client.completions.create(prompt="The sea is", logprobs=1, **common)

    def tokens_in(chunk) -> int:
        if not chunk.choices or chunk.choices[0].logprobs is None:
            return 0
        logprobs = chunk.choices[0].logprobs
        return len(logprobs.content if hasattr(logprobs, "content") else logprobs.tokens)

    prompts = (prompt_tokens(tokenizer, HELLO), len(tokenizer.encode("The sea is", add_special_tokens=False)))
    for chunks, prompt in zip((list(chat), list(completion)), prompts, strict=True):
        sent = 0
        for chunk in chunks:
            sent += tokens_in(chunk)
            assert chunk.usage is not None and chunk.usage.prompt_tokens == prompt
            assert chunk.usage.completion_tokens == sent
        assert sent == 8 and len(chunks) > 2


def test_n_choices_streamed_and_not(client):
    r = client.chat.completions.create(
        model="chat", messages=HELLO, max_tokens=8, n=2, seed=5, temperature=1.0
    )
    assert sorted(c.index for c in r.choices) == [0, 1]
    texts = [c.message.content for c in r.choices]
    assert texts[0] != texts[1]  # each choice samples with its own seed
    stream = client.chat.completions.create(
        model="chat",
        messages=HELLO,
        max_tokens=8,
        n=2,
        seed=5,
        temperature=1.0,
        stream=True,
        stream_options={"include_usage": True},
    )
    content, _, finish, usage, _ = collect_stream(stream)
    assert [content[0], content[1]] == texts
    assert set(finish) == {0, 1}
    assert usage[0].completion_tokens == r.usage.completion_tokens


def test_seed_makes_sampling_reproducible(client):
    def sample(seed):
        r = client.chat.completions.create(
            model="chat", messages=HELLO, max_tokens=12, temperature=1.0, seed=seed
        )
        return r.choices[0].message.content

    first = sample(1234)
    assert sample(1234) == first
    assert sample(4321) != first


def test_stop_sequence_ends_the_text_before_it(client):
    base = client.chat.completions.create(model="chat", messages=HELLO, max_tokens=20, temperature=0)
    text = base.choices[0].message.content
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), f"need a visible stop string in {text!r}"
    r = client.chat.completions.create(
        model="chat", messages=HELLO, max_tokens=20, temperature=0, stop=[stop]
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == text[: text.index(stop)]


def test_logprobs_with_top_alternatives(client):
    r = client.chat.completions.create(
        model="chat", messages=HELLO, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy takes the most likely token
        assert [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True
        )
    text = "".join(e.token for e in content if e.token != "<|im_end|>")
    assert text == r.choices[0].message.content


def test_json_mode_returns_a_json_object(client):
    # A random-weight model rarely closes a free-form string; this seed's object ends within 120 tokens.
    r = client.chat.completions.create(
        model="chat",
        messages=[{"role": "user", "content": "Describe a cat as JSON."}],
        response_format={"type": "json_object"},
        max_tokens=120,
        temperature=1.0,
        seed=1,
    )
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_json_schema_output_validates(client):
    schema = {
        "type": "object",
        "properties": {
            "answer": {"type": "string", "enum": ["yes", "no"]},
            "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
            "colors": {"type": "array", "items": {"type": "string", "enum": ["red", "blue"]}, "maxItems": 2},
        },
        "required": ["answer", "confidence", "colors"],
        "additionalProperties": False,
    }
    for model in ("chat", "reasoning"):
        r = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Is the sky blue?"}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "verdict", "schema": schema, "strict": True},
            },
            max_tokens=60,
            temperature=0.8,
            seed=3,
        )
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)


# -- tools ---------------------------------------------------------------------------------------


def test_named_tool_choice_calls_that_function(client):
    r = client.chat.completions.create(
        model="chat",
        messages=[{"role": "user", "content": "What time is it in Tokyo?"}],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=80,
        temperature=0,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop"  # OpenAI's answer when the request named the function
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_time"
    assert_valid_call(call.function.name, call.function.arguments)


def test_a_forced_tool_beside_a_json_schema_format_is_called_by_its_schema(client):
    """instructor and other clients send response_format with a forced tool: as OpenAI does, the call
    follows the tool's schema (response_format would constrain text, and a forced call writes none)."""
    answer = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    r = client.chat.completions.create(
        model="chat",
        messages=[{"role": "user", "content": "Weather in Lima for 2 days?"}],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": answer}},
        max_tokens=80,
        temperature=0,
    )
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert_valid_call(call.function.name, call.function.arguments)
    with pytest.raises(openai.BadRequestError) as refused:  # vLLM's own constraint stays the only one
        client.chat.completions.create(
            model="chat",
            messages=HELLO,
            tools=TOOLS,
            tool_choice="required",
            extra_body={"structured_outputs": {"regex": "a+"}},
        )
    assert refused.value.body["param"] == "structured_outputs"


def test_required_tool_choice_streamed_and_not(client):
    kwargs = dict(
        model="reasoning",
        messages=[{"role": "user", "content": "Weather in Paris for 3 days?"}],
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=0,
    )
    r = client.chat.completions.create(**kwargs)
    assert r.choices[0].finish_reason == "tool_calls"
    [call] = r.choices[0].message.tool_calls
    assert_valid_call(call.function.name, call.function.arguments)
    _, calls, finish, _, _ = collect_stream(client.chat.completions.create(stream=True, **kwargs))
    [streamed] = calls[0].values()
    assert finish[0] == "tool_calls"
    assert (streamed["name"], streamed["arguments"]) == (call.function.name, call.function.arguments)
    assert streamed["id"].startswith("call_")


def test_auto_tool_choice_parses_tool_call_markup(client):
    kwargs = dict(
        model="chat",
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=TOOLS,
        max_tokens=60,
        temperature=0,
        extra_body={"structured_outputs": {"regex": TOOL_MARKUP_REGEX}},
    )
    r = client.chat.completions.create(**kwargs)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert_valid_call(call.function.name, call.function.arguments)

    content, calls, finish, _, chunks = collect_stream(client.chat.completions.create(stream=True, **kwargs))
    assert content[0] == "Let me check." and finish[0] == "tool_calls"
    assert calls[0][0]["name"] == "get_weather" and calls[0][0]["arguments"] == call.function.arguments
    fragments = [c for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    # The name goes out first, then the arguments as they are generated: how many chunks they take
    # depends on how fast the engine runs against the stream batching interval (a fast step packs a
    # whole call into two), so only the order is asserted.
    first = fragments[0].choices[0].delta.tool_calls[0]
    assert first.function.name == "get_weather" and not first.function.arguments
    assert len(fragments) >= 2 and fragments[-1].choices[0].delta.tool_calls[0].function.arguments
    assert "<tool_call>" not in "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_tool_result_conversation(client, tokenizer):
    first = client.chat.completions.create(
        model="chat",
        messages=[{"role": "user", "content": "Weather in Lima for 2 days?"}],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=80,
        temperature=0,
    )
    call = first.choices[0].message.tool_calls[0]
    messages = [
        {"role": "system", "content": "You are a weather bot."},
        {"role": "user", "content": "Weather in Lima for 2 days?"},
        first.choices[0].message.model_dump(exclude_none=True),  # echoed back as SDK users do
        {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny", "high_c": 24}'},
    ]
    r = client.chat.completions.create(
        model="chat", messages=messages, tools=TOOLS, max_tokens=8, temperature=0
    )
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    template_messages = messages[:2] + [
        {"role": "assistant", "content": "", "tool_calls": [call.model_dump()]},
        messages[3],
    ]
    assert r.usage.prompt_tokens == prompt_tokens(tokenizer, template_messages, TOOLS)


def test_stream_parser_matches_whole_text_parse():
    text = 'Sure.\n<tool_call>\n{"name": "a", "arguments": {"x": "}", "y": [1, {"z": 2}]}}\n</tool_call>\n'
    text += '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>'
    content, calls = parse_tool_calls(text)
    for step in (1, 3, 7):
        parser, events = ToolCallStreamParser(), []
        for i in range(0, len(text), step):
            events += parser.feed(text[i : i + step])
        events += parser.finish()
        streamed_content = "".join(e.text for e in events if hasattr(e, "text"))
        args = ["".join(e.arguments for e in events if getattr(e, "index", None) == k) for k in (0, 1)]
        names = [e.name for e in events if getattr(e, "name", None)]
        assert streamed_content == content == "Sure."
        assert names == [c.name for c in calls] == ["a", "b"]
        assert args == [c.arguments for c in calls] == ['{"x": "}", "y": [1, {"z": 2}]}', "{}"]
    assert parse_tool_calls("no calls <tool_call> not json </tool_call>") == (
        "no calls <tool_call> not json </tool_call>",
        [],
    )


# -- completions, embeddings, models -------------------------------------------------------------


def test_completions(client, tokenizer):
    r = client.completions.create(model="chat", prompt="The sea is", max_tokens=5, temperature=0, logprobs=2)
    assert r.object == "text_completion" and len(r.choices) == 1
    assert r.usage.prompt_tokens == len(tokenizer.encode("The sea is", add_special_tokens=False))
    assert r.usage.completion_tokens == len(r.choices[0].logprobs.tokens)
    assert all(len(top) <= 2 for top in r.choices[0].logprobs.top_logprobs)

    stream = client.completions.create(
        model="chat", prompt="The sea is", max_tokens=5, temperature=0, stream=True
    )
    pieces = [c.choices[0].text for c in stream if c.choices]
    assert "".join(pieces) == r.choices[0].text

    batch = client.completions.create(model="reasoning", prompt=["One", "Two"], max_tokens=3, n=2, echo=True)
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]
    assert all(c.text.startswith("One" if c.index < 2 else "Two") for c in batch.choices)

    # lm-eval's loglikelihood request: the prompt scored, nothing generated (tests/unit/
    # test_completions_echo.py checks the values).
    ids = tokenizer.encode("The sea is", add_special_tokens=False)
    scored = client.completions.create(model="chat", prompt=ids, max_tokens=0, echo=True, logprobs=1)
    [choice] = scored.choices
    assert choice.text == "The sea is" and scored.usage.completion_tokens == 0
    assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.tokens) == len(ids)
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs[1:])


def test_embeddings_place_related_sentences_closer(client):
    texts = [
        "A man is playing a guitar.",
        "Someone is playing music on an instrument.",
        "Interest rates rose.",
    ]
    r = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts)  # the SDK asks for base64
    vectors = np.array([d.embedding for d in sorted(r.data, key=lambda d: d.index)])
    assert vectors.shape == (3, 384)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-4)
    related, unrelated = vectors[0] @ vectors[1], vectors[0] @ vectors[2]
    assert related > unrelated + 0.2
    assert r.usage.prompt_tokens == r.usage.total_tokens > 0
    floats = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts[0], encoding_format="float")
    assert np.allclose(floats.data[0].embedding, vectors[0], atol=1e-6)


def test_models_list_and_retrieve(client):
    ids = [m.id for m in client.models.list()]
    assert ids == ["raylane-llama-tiny", "reasoning", "sim", "alpha", "beta", "all-MiniLM-L6-v2"]  # 2 LoRAs
    model = client.models.retrieve("reasoning")
    assert model.id == "reasoning" and model.object == "model" and model.owned_by == "raylane"


# -- disconnects ---------------------------------------------------------------------------------


def wait_for(predicate, timeout: float = 20.0, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def test_disconnect_mid_stream_frees_the_kv_cache(client, api_server):
    idle = api_server.pool_stats("chat")
    assert idle["num_requests_running"] == 0
    stream = client.chat.completions.create(
        model="chat",
        messages=HELLO,
        max_tokens=1500,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    received = 0
    for chunk in stream:
        received += bool(chunk.choices and chunk.choices[0].delta.content)
        if received == 5:
            break
    busy = api_server.pool_stats("chat")
    assert busy["num_requests_running"] == 1 and busy["kv_cache_usage"] > idle["kv_cache_usage"]
    stream.close()  # the client goes away mid-stream
    after = wait_for(
        lambda: (s := api_server.pool_stats("chat"))["num_requests_running"] == 0 and s, timeout=20
    )
    assert after, "the abandoned request is still running"
    assert after["kv_cache_usage"] == idle["kv_cache_usage"]
    assert after["num_free_kv_blocks"] == idle["num_free_kv_blocks"]


def test_disconnect_while_waiting_for_a_whole_response_aborts_it(api_server):
    import httpx2

    # 2000 tokens take this pool about 4 s: the request ending within 2.5 s means it was aborted.
    body = {"model": "chat", "messages": HELLO, "max_tokens": 2000, "ignore_eos": True}
    start = time.monotonic()
    with pytest.raises(httpx2.TimeoutException):
        httpx2.post(f"{api_server.base_url}/chat/completions", json=body, timeout=1.0)
    after = wait_for(
        lambda: (s := api_server.pool_stats("chat"))["num_requests_running"] == 0 and s,
        timeout=1.5,
        interval=0.1,
    )
    print(f"stopped {time.monotonic() - start:.2f} s after it started")
    assert after, "the abandoned request is still running"
    assert after["kv_cache_usage"] == 0.0


def test_health_reports_each_pool(api_server):
    import httpx2

    r = httpx2.get(f"{api_server.url}/health", timeout=30)
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "ok" and set(body["pools"]) == {"chat", "reasoning", "sim"}
    assert all(p["status"] == "ok" for p in body["pools"].values())


# -- the command line ----------------------------------------------------------------------------


def start_raylane_serve(
    demo_models, *args: str, timeout: float = 150, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, list[str], threading.Thread]:
    """`raylane serve ARGS` in a session of its own (with `env` added to this one's), on the demo
    models already written (no download), returned once it prints its URL; its output lines keep
    coming into the list the reader fills."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | (env or {})
    env["RAYLANE_DEMO_DIR"] = str(next(iter(demo_models.values())).parent)
    command = [str(Path(sys.executable).with_name("raylane")), "serve", *args]
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        ready = wait_for(
            lambda: any("OpenAI API at" in line for line in list(lines)), timeout=timeout, interval=0.5
        )
        assert ready, "".join(lines[-30:])
    except BaseException:
        stop_raylane_serve(proc)
        raise
    return proc, lines, reader


def stop_raylane_serve(proc: subprocess.Popen) -> None:
    """Ctrl-C, then kill what is left: a killed Ray leaves an HAProxy running, holding its ports."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=120)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)


def test_raylane_serve_runs_the_embedded_default_until_ctrl_c(demo_models):
    """The README's main command: a fresh Ray, three pools of the real packaged model, which answers
    the README's question; Ctrl-C drains (a running stream finishes, new requests get 503) and leaves
    nothing running."""
    import httpx2

    from tests.live_servers import free_port

    port = free_port()
    proc, lines, reader = start_raylane_serve(demo_models, "--port", str(port), timeout=400)
    try:
        banner = next(line for line in lines if "OpenAI API at" in line)
        url = banner.split(" at ", 1)[1].split()[0]
        assert url == f"http://127.0.0.1:{port}/v1"
        assert "behind Serve's proxy" in banner  # http.ingress: proxy, the default
        assert wait_for(lambda: any("metrics at /metrics" in line for line in list(lines)), timeout=10)
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list()] == ["coding", "reasoning", "chat", "all-MiniLM-L6-v2"]
        question = [{"role": "user", "content": "What is the capital of France?"}]
        for model in ("chat", "auto"):
            r = client.chat.completions.create(model=model, messages=question, max_tokens=24, temperature=0)
            assert "Paris" in r.choices[0].message.content, (model, r.choices[0].message.content)
        started = descendants(proc.pid)
        assert len(started) > 5  # gcs, raylet, Serve's controller and proxy, the replicas, ...

        # Ctrl-C while a stream runs: it finishes, and new requests meanwhile get 503 + Retry-After.
        streaming, finish = threading.Event(), []

        def stream() -> None:
            chunks = client.chat.completions.create(
                model="chat", messages=HELLO, max_tokens=64, stream=True, extra_body={"ignore_eos": True}
            )
            for chunk in chunks:
                streaming.set()
                finish.extend(c.finish_reason for c in chunk.choices if c.finish_reason)

        streamer = threading.Thread(target=stream)
        streamer.start()
        assert streaming.wait(60)
        proc.send_signal(signal.SIGINT)
        hello = {"model": "chat", "messages": HELLO, "max_tokens": 4}

        def rejected():
            response = httpx2.post(f"{url}/chat/completions", json=hello, timeout=30)
            return response if response.status_code == 503 else None

        turned_away = wait_for(rejected, timeout=30, interval=0.1)
        assert turned_away, "no 503 while draining"
        assert int(turned_away.headers["retry-after"]) >= 1
        assert turned_away.json()["error"]["code"] == "draining"
        streamer.join(timeout=120)
        assert finish == ["length"]  # the stream in flight ran to its end
        assert proc.wait(timeout=90) == 0
        assert wait_for(lambda: not [p for p in started if alive(p)], timeout=15), [
            p for p in started if alive(p)
        ]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    reader.join(timeout=5)
    assert "raylane: stopped" in "".join(lines)


STOP_BOUND_S = 30  # how long a supervisor waits after SIGTERM before it kills what is left


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Serve's HAProxy ingress is Linux-only")
def test_two_raylane_serves_behind_haproxy_run_side_by_side(demo_models, tmp_path):
    """`http.ingress: haproxy`: Serve's HAProxy takes the port and forwards to the gateway replica.
    Two such clusters on one machine each get their own HAProxy files and ports (Ray's defaults are
    the same for every cluster), both stream through their own port; SIGHUP makes one apply its edited
    config file in place (cluster/apply.py), and only that one. Then `a` stops on Ctrl-C, and `b` the
    way systemd, `timeout` and most supervisors stop a service: SIGTERM to its whole process group,
    within STOP_BOUND_S and with exit code 0. Neither leaves a process behind."""
    from tests.live_servers import free_port

    servers = []
    ray_root = tempfile.mkdtemp(prefix="rl-grp-", dir="/tmp")  # short: Ray's socket paths live under it
    try:
        # One after the other: two Rays starting at once on one machine can race for GCS's port.
        for name, env in (("a", {}), ("b", {"RAY_TMPDIR": ray_root})):
            port = free_port()
            config = tmp_path / f"{name}.yaml"
            config.write_text(  # a simulated pool: what is tested is the ingress, not a model's words
                f"http: {{port: {port}, ingress: haproxy}}\n"
                "embeddings: {enabled: false}\n"
                "pools: [{name: chat, model: 'sim:llama-3.1-8b-h100', engine: {cpus_per_rank: 0.1}}]\n"
            )
            proc, lines, reader = start_raylane_serve(demo_models, "--config", str(config), env=env)
            servers.append((port, proc, reader, config, lines))
            assert "behind Serve's HAProxy" in next(line for line in lines if "OpenAI API at" in line)
        for port, proc, *_ in servers:
            url = f"http://127.0.0.1:{port}/v1"
            client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=60)
            chunks = list(
                client.chat.completions.create(
                    model="chat",
                    messages=HELLO,
                    max_tokens=16,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True},
                )
            )
            assert chunks[-1].usage.completion_tokens == 16
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)  # streamed text
            children = descendants(proc.pid)
            haproxies = [p for p in children if b"haproxy" in Path(f"/proc/{p}/cmdline").read_bytes()]
            assert port in listening_ports(haproxies)  # HAProxy, not Serve's proxy actor, holds the API port

        # SIGHUP: `a` reads its config file again and applies it in place; `b` is untouched.
        port, proc, _, config, lines = servers[0]
        config.write_text(config.read_text() + "api_keys: {keys: {sk-live: premium}}\n")
        proc.send_signal(signal.SIGHUP)
        assert wait_for(lambda: any("raylane apply: done" in line for line in list(lines)), timeout=120), (
            lines[-20:]
        )
        keyed = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-live", max_retries=0)
        assert keyed.models.list().data
        with pytest.raises(openai.AuthenticationError):  # keys are now required there
            openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0).models.list()
        open_b = openai.OpenAI(base_url=f"http://127.0.0.1:{servers[1][0]}/v1", api_key="x", max_retries=0)
        assert open_b.models.list().data

        # `b`'s Ray runs under its own temp dir, and writes no address file that a plain ray.init()
        # elsewhere on the machine would join through.
        assert any("gcs_server" in text for _, text in ray_processes_of(ray_root))
        assert not (Path(ray_root) / "ray" / "ray_current_cluster").exists()
        started = set().union(*(descendants(proc.pid) for _, proc, *_ in servers))
        (_, a, *_), (_, b, _, _, b_lines) = servers
        a.send_signal(signal.SIGINT)
        os.killpg(b.pid, signal.SIGTERM)  # what `systemctl stop`, `timeout` and `kill -TERM -PGID` do
        try:
            b_code = b.wait(timeout=STOP_BOUND_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {STOP_BOUND_S} s after SIGTERM:\n" + "".join(b_lines[-30:]))
        assert b_code == 0, "".join(b_lines[-30:])
        assert a.wait(timeout=120) == 0

        def left() -> list:
            return [p for p in started if alive(p)] + ray_processes_of(ray_root)

        assert wait_for(lambda: not left(), timeout=15), left()
    finally:
        for _, proc, reader, *_ in servers:
            stop_raylane_serve(proc)
            reader.join(timeout=5)
        for pid, _ in ray_processes_of(ray_root):  # never leave a stray Ray to the rest of the session
            os.kill(pid, signal.SIGKILL)
    for *_, lines in servers:
        assert "raylane: stopped" in "".join(lines)


def ray_processes_of(root: str) -> list[tuple[int, str]]:
    """Live processes whose command line names `root` (a serve's Ray temp dir: GCS, raylet,
    dashboard and workers all take their session dir under it), so other Rays on the machine
    (the test session's own) do not count."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if root in text and alive(int(cmdline.parent.name)):
            found.append((int(cmdline.parent.name), text[:120]))
    return found


def listening_ports(pids: list[int]) -> set[int]:
    """TCP ports the processes `pids` listen on (from /proc: socket inodes of LISTEN entries)."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                if (target := os.readlink(fd)).startswith("socket:["):
                    inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            fields = row.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports
