"""What a pool replica streams to the gateway: one item per engine output, so each Serve hop (pool ->
gateway -> proxy) passes on as few messages as the tokens allow (every message costs each process
CPU that the engine thread then lacks; `raylane bench overhead`)."""

import asyncio
import json

from deployments.openai_schemas import ChatCompletionRequest, CompletionRequest
from deployments.sampling import chat_params, completion_params
from deployments.serving import OpenAIServing
from engine import AsyncLLM


def events(item: str) -> list[dict | str]:
    """The SSE events in one streamed item, as JSON (or the `[DONE]` marker)."""
    payloads = [line.removeprefix("data: ") for line in item.split("\n\n") if line]
    return [p if p == "[DONE]" else json.loads(p) for p in payloads]


async def stream(serving: OpenAIServing, body: dict) -> list[str]:
    if "messages" in body:
        req = ChatCompletionRequest.model_validate(body)
        params, plan = chat_params(req)
        items = serving.chat(req, params, plan, "r1")
    else:
        req = CompletionRequest.model_validate(body)
        items = serving.completion(req, completion_params(req), "r2")
    return [item async for item in items]


def test_each_streamed_item_is_one_engine_output_with_the_opening_and_closing_events_folded_in(demo_models):
    llm = AsyncLLM(model=str(demo_models["raylane-llama-tiny"]), num_kv_blocks=64)
    serving = OpenAIServing(llm, "chat", 2048)
    common = {"model": "chat", "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True}
    usage = {"stream_options": {"include_usage": True}}
    try:
        chat = asyncio.run(
            stream(serving, {**common, **usage, "messages": [{"role": "user", "content": "hi"}]})
        )
        text = asyncio.run(stream(serving, {**common, **usage, "prompt": "Once upon", "echo": True}))
    finally:
        llm.shutdown()

    # Chat: the role event travels with the first token, so the gateway's first item already carries
    # text; the last token, the finish event, usage and [DONE] travel as one. At most one item per token
    # (a token that ends inside a UTF-8 character adds no text and sends nothing).
    assert len(chat) <= 6, chat
    first, last = events(chat[0]), events(chat[-1])
    assert first[0]["choices"][0]["delta"]["role"] == "assistant"
    assert first[1]["choices"][0]["delta"]["content"]
    assert [e["choices"][0]["finish_reason"] for e in last[:2]] == [None, "length"]
    assert last[2]["usage"]["completion_tokens"] == 6 and last[3] == "[DONE]"
    assert all(len(events(item)) == 1 for item in chat[1:-1])

    # Completions: the echoed prompt goes with the first token.
    assert len(text) <= 6 and all(len(events(item)) == 1 for item in text[1:-1]), text
    echo, token = events(text[0])
    assert echo["choices"][0]["text"] == "Once upon" and token["choices"][0]["text"]
    assert events(text[-1])[-1] == "[DONE]"
