"""What a pool replica streams to the gateway: one item per engine output, so each Serve hop (pool ->
gateway -> proxy) passes on as few messages as the tokens allow (every message costs each process
CPU that the engine thread then lacks; `raylane bench overhead`). The last item carries the request's
summary for the gateway's request log, so no further message is needed."""

import asyncio
import json

from raylane.deployments.metrics.pool import MeteredLLM, PoolMetrics
from raylane.deployments.pool.serving_chat import OpenAIServingChat
from raylane.deployments.pool.serving_completion import OpenAIServingCompletion
from raylane.deployments.protocol.openai_schemas import ChatCompletionRequest, CompletionRequest
from raylane.deployments.protocol.sampling import chat_params, completion_params
from raylane.deployments.protocol.wire import FinalItem, StreamItem
from raylane.engine import AsyncLLM


def events(item: str) -> list[dict | str]:
    """The SSE events in one streamed item, as JSON (or the `[DONE]` marker)."""
    payloads = [line.removeprefix("data: ") for line in item.split("\n\n") if line]
    return [p if p == "[DONE]" else json.loads(p) for p in payloads]


async def stream(llm, body: dict) -> list:
    if "messages" in body:
        req = ChatCompletionRequest.model_validate(body)
        params, plan = chat_params(req)
        items = OpenAIServingChat(llm, "chat", 2048).chat(req, params, plan, "r1")
    else:
        req = CompletionRequest.model_validate(body)
        items = OpenAIServingCompletion(llm, "chat", 2048).completion(req, completion_params(req), "r2")
    return [item async for item in items]


def test_each_streamed_item_is_one_engine_output_with_the_opening_and_closing_events_folded_in(demo_models):
    engine = AsyncLLM(model=str(demo_models["raylane-llama-tiny"]), num_kv_blocks=64)
    llm = MeteredLLM(engine, PoolMetrics("chat", "m"))  # as the pool runs it
    common = {"model": "chat", "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True}
    usage = {"stream_options": {"include_usage": True}}
    try:
        chat = asyncio.run(stream(llm, {**common, **usage, "messages": [{"role": "user", "content": "hi"}]}))
        text = asyncio.run(stream(llm, {**common, **usage, "prompt": "Once upon", "echo": True}))
        batch = {**common, "stream": False, "prompt": ["Once upon", "a time"]}
        [whole] = asyncio.run(stream(llm, batch))
    finally:
        engine.shutdown()

    # The items before the last carry, beside their text, the token ids that text holds (what a
    # resumption on another replica needs; never sent to the client): one id per token out.
    assert all(isinstance(item, StreamItem) for item in chat[:-1] + text[:-1])
    assert all(len(item.token_ids[0]) >= 1 for item in chat[:-1] + text[:-1])
    assert sum(len(item.token_ids[0]) for item in chat[:-1]) < 6  # the last token went with the end
    chat[:-1], text[:-1] = [i.text for i in chat[:-1]], [i.text for i in text[:-1]]
    # The last item says it is the last and carries what the request log needs.
    assert isinstance(chat[-1], FinalItem) and isinstance(text[-1], FinalItem)
    assert (chat[-1].summary.completion_tokens, chat[-1].summary.finish_reason) == (6, "length")
    chat[-1], text[-1] = chat[-1].item, text[-1].item
    # A batch of prompts is one engine request each: the summary adds them up.
    body = json.loads(whole.item)
    assert whole.summary.completion_tokens == body["usage"]["completion_tokens"] == 12
    assert whole.summary.prompt_tokens == body["usage"]["prompt_tokens"]
    assert whole.summary.finish_reason == "length" and whole.summary.ttft_s is not None

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
