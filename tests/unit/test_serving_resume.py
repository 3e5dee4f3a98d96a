"""A pool replica continuing a stream that another one began (`ResumeState`): what the client gets,
the items sent before the cut followed by the continuation's, adds up to the undisturbed stream (same
id and created, text, tool calls, finish reasons, usage) and a constrained output still validates.
Each stream is cut after half of its items, as the gateway would resume it (deployments/gateway/relay.py)."""

import asyncio
import json

import jsonschema
import pytest

from raylane.deployments.metrics.pool import MeteredLLM, PoolMetrics
from raylane.deployments.pool.serving_chat import OpenAIServingChat
from raylane.deployments.pool.serving_completion import OpenAIServingCompletion
from raylane.deployments.protocol.openai_schemas import ChatCompletionRequest, CompletionRequest
from raylane.deployments.protocol.sampling import chat_params, completion_params
from raylane.deployments.protocol.wire import FinalItem, ResumeState, StreamItem
from raylane.engine import AsyncLLM

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]
COMMON = {"model": "chat", "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}


@pytest.fixture(scope="module")
def llm(demo_models):
    # Every step's tokens in an item of their own (no stream batching): the tiny model's whole answer
    # would otherwise fit in one or two items, leaving no place to cut it.
    engine = AsyncLLM(
        model=str(demo_models["raylane-llama-tiny"]), num_kv_blocks=128, stream_batching_interval_ms=0
    )
    yield MeteredLLM(engine, PoolMetrics("chat", "m"))  # as the pool runs it
    engine.shutdown()


def stream(llm, body: dict, resume: ResumeState | None = None) -> list:
    async def items():
        if "messages" in body:
            req = ChatCompletionRequest.model_validate(body)
            params, plan = chat_params(req)
            gen = OpenAIServingChat(llm, "chat", 2048).chat(req, params, plan, "r1", 0, resume)
        else:
            req = CompletionRequest.model_validate(body)
            gen = OpenAIServingCompletion(llm, "chat", 2048).completion(
                req, completion_params(req), "r2", 0, resume
            )
        return [item async for item in gen]

    return asyncio.run(items())


def cut_and_resume(llm, body: dict) -> tuple[list[str], list[str]]:
    """(the undisturbed stream's SSE texts, the texts sent before a cut halfway plus the resumed
    stream's), as the client would receive them."""
    whole = stream(llm, body)
    assert all(isinstance(item, StreamItem) for item in whole[:-1]) and isinstance(whole[-1], FinalItem)
    cut = len(whole[:-1]) // 2
    assert cut >= 1, whole
    state = ResumeState(created=events(whole[0].text)[0]["created"])
    for item in whole[:cut]:
        state.add(item)
    resumed = stream(llm, body, state)
    return [text(i) for i in whole], [text(i) for i in whole[:cut] + resumed]


def text(item) -> str:
    return item.item if isinstance(item, FinalItem) else item.text


def events(sse: str) -> list[dict]:
    payloads = [line.removeprefix("data: ") for line in sse.split("\n\n") if line]
    return [json.loads(p) for p in payloads if p != "[DONE]"]


def chat_view(texts: list[str]) -> dict:
    """What a client assembles from a chat stream: per choice its content, tool calls and finish
    reason; the response ids, created and usage; role events and [DONE] markers counted."""
    view = {"ids": set(), "created": set(), "content": {}, "calls": {}, "finish": {}, "roles": 0}
    for e in [e for t in texts for e in events(t)]:
        view["ids"].add(e["id"])
        view["created"].add(e["created"])
        if e.get("usage"):  # cached tokens aside: the continuation finds the prompt in the prefix cache
            view["usage"] = {k: v for k, v in e["usage"].items() if k != "prompt_tokens_details"}
        for c in e["choices"]:
            delta, i = c["delta"], c["index"]
            view["roles"] += delta.get("role") is not None
            view["content"][i] = view["content"].get(i, "") + (delta.get("content") or "")
            for call in delta.get("tool_calls") or []:
                name, args = view["calls"].setdefault((i, call["index"]), ["", ""])
                fn = call.get("function") or {}
                view["calls"][(i, call["index"])] = [
                    name + (fn.get("name") or ""),
                    args + (fn.get("arguments") or ""),
                ]
            view["finish"][i] = c["finish_reason"] or view["finish"].get(i)
    view["done"] = sum(t.count("data: [DONE]") for t in texts)
    return view


def test_a_resumed_chat_stream_adds_up_to_the_undisturbed_one(llm):
    body = {**COMMON, "messages": [{"role": "user", "content": "tell me a story"}], "n": 2, "max_tokens": 40}
    before, after = map(chat_view, cut_and_resume(llm, {**body, "ignore_eos": True}))
    assert after == before
    assert before["roles"] == 2 and before["done"] == 1 and len(before["ids"]) == 1
    assert before["usage"]["completion_tokens"] == 80  # each token counted once, across the cut


def test_a_resumed_forced_tool_call_carries_on_and_its_arguments_validate(llm):
    body = {**COMMON, "messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS}
    body["parallel_tool_calls"] = False  # one call
    before, after = map(
        chat_view, cut_and_resume(llm, {**body, "tool_choice": "required", "max_tokens": 200})
    )
    assert after == before
    [(name, arguments)] = after["calls"].values()
    assert name == "get_weather" and after["finish"][0] == "tool_calls"
    jsonschema.validate(json.loads(arguments), CITY)


def test_a_resumed_json_schema_output_validates(llm):
    schema = {"type": "json_schema", "json_schema": {"name": "w", "schema": CITY}}
    body = {**COMMON, "messages": [{"role": "user", "content": "json"}], "response_format": schema}
    before, after = map(chat_view, cut_and_resume(llm, {**body, "max_tokens": 200}))
    assert after == before and after["finish"][0] == "stop"
    jsonschema.validate(json.loads(after["content"][0]), CITY)


def test_a_resumed_completions_stream_adds_up_per_prompt_and_choice(llm):
    body = {**COMMON, "prompt": ["Once upon", "a time"], "n": 2, "max_tokens": 30, "ignore_eos": True}
    before, after = cut_and_resume(llm, {**body, "logprobs": 1})

    def view(texts):
        out = {"text": {}, "offsets": {}, "finish": {}}
        for e in [e for t in texts for e in events(t)]:
            out["id"], out["created"] = e["id"], e["created"]
            if e.get("usage"):
                out["usage"] = {k: v for k, v in e["usage"].items() if k != "prompt_tokens_details"}
            for c in e["choices"]:
                i = c["index"]
                out["text"][i] = out["text"].get(i, "") + c["text"]
                out["offsets"].setdefault(i, []).extend((c.get("logprobs") or {}).get("text_offset") or [])
                out["finish"][i] = c["finish_reason"] or out["finish"].get(i)
        return out

    assert view(after) == view(before)
    assert view(before)["usage"]["completion_tokens"] == 120
