"""A pool replica's event loop keeps running while a huge prompt is rendered and tokenized (issue #35,
item 3): other requests' streams and Serve's health checks are coroutines on that loop."""

import asyncio
import json

from raylane.deployments.pool.serving_chat import OpenAIServingChat
from raylane.deployments.pool.serving_completion import OpenAIServingCompletion
from raylane.deployments.pool.serving_tokenization import OpenAIServingTokenization
from raylane.deployments.pool.tokenize_offload import INLINE_MAX_CHARS, is_large, tokenize_off_loop
from raylane.deployments.protocol.openai_schemas import ChatCompletionRequest, CompletionRequest
from raylane.deployments.protocol.sampling import chat_params
from raylane.deployments.protocol.tokenization_schemas import TokenizeCompletionRequest

HUGE = "All work and no play makes Jack a dull boy. " * 5_000  # 220 KB: 50x the inline bound


class _TokenizerOnly:
    """Stands in for the engine: rendering a prompt needs only its tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer


async def ticks_while(work) -> tuple[int, object]:
    """How many times another coroutine on this loop got to run while `work` was awaited."""
    ticks, done = 0, False

    async def ticker():
        nonlocal ticks
        while not done:
            ticks += 1
            await asyncio.sleep(0)

    other = asyncio.create_task(ticker())
    try:
        result = await work
    finally:
        done = True
        await other
    return ticks - 1, result  # its last turn saw `done`


def test_the_loop_runs_while_a_huge_chat_prompt_is_tokenized():
    from raylane.models.demo import load_tokenizer

    tokenizer = load_tokenizer()
    serving = OpenAIServingChat(_TokenizerOnly(tokenizer), "chat", 1 << 20)
    req = ChatCompletionRequest.model_validate(
        {"model": "chat", "messages": [{"role": "user", "content": HUGE}]}
    )
    _, plan = chat_params(req)
    ticks, ids = asyncio.run(ticks_while(serving.prompt_ids(req, plan)))
    assert ids == serving.render_chat(req, plan)  # the same prompt as inline
    assert ticks > 10  # inline, the other coroutine would not run once until the prompt was done


def test_the_loop_runs_while_a_huge_completion_prompt_and_tokenize_call_are_encoded():
    from raylane.models.demo import load_tokenizer

    tokenizer = load_tokenizer()
    completion = OpenAIServingCompletion(_TokenizerOnly(tokenizer), "chat", 1 << 20)
    req = CompletionRequest.model_validate({"model": "chat", "prompt": HUGE})
    encode_all = lambda: [completion._prompt_ids(p) for p in req.prompts()]  # noqa: E731
    ticks, ids = asyncio.run(ticks_while(tokenize_off_loop(encode_all, req.prompt)))
    assert ids == [tokenizer.encode(HUGE, add_special_tokens=False)] and ticks > 10

    serving = OpenAIServingTokenization(tokenizer, "chat", 1 << 20)
    tokenize = TokenizeCompletionRequest(model="chat", prompt=HUGE)
    ticks, body = asyncio.run(ticks_while(tokenize_off_loop(lambda: serving.tokenize(tokenize), tokenize)))
    assert json.loads(body)["count"] == len(ids[0]) and ticks > 10


def test_small_prompts_stay_inline_and_many_small_parts_count_as_large():
    calls = []

    async def run():
        return await tokenize_off_loop(lambda: calls.append(asyncio.get_running_loop()), "short")

    asyncio.run(run())
    assert calls and calls[0] is not None  # ran on the loop's own thread (get_running_loop worked)
    assert not is_large(["x" * 100, {"role": "user"}])
    assert is_large("x" * (INLINE_MAX_CHARS + 1))
    assert is_large([{"a": ""}] * 1_000_000)  # decided after a few hundred of them


def test_the_loop_runs_while_a_long_detokenize_is_decoded():
    """/detokenize of a million ids took about a second of a busy replica's loop (issue #62, item 2)."""
    from raylane.deployments.protocol.tokenization_schemas import DetokenizeRequest
    from raylane.models.demo import load_tokenizer

    tokenizer = load_tokenizer()
    serving = OpenAIServingTokenization(tokenizer, "chat", 1 << 20)
    ids = tokenizer.encode(HUGE, add_special_tokens=False) * 8
    req = DetokenizeRequest(model="chat", tokens=ids)
    ticks, body = asyncio.run(ticks_while(tokenize_off_loop(lambda: serving.detokenize(req), req)))
    assert json.loads(body)["prompt"] == tokenizer.decode(ids) and ticks > 10
