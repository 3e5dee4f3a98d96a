"""`/v1/completions` with `echo` and `logprobs`, `max_tokens: 0` and vLLM's `prompt_logprobs`, as lm-eval's
loglikelihood tasks (`local-completions`) and vLLM's clients read them, through the pool's serving
code on the real default model (no Ray: the gateway's parsing and the pool's serving, as the pool
runs them).

lm-eval sends the context and continuation as token ids with `echo: true, logprobs: 1, max_tokens: 1`
(older versions 0) and reads `choices[i].logprobs.token_logprobs[ctxlen:-1]` (its sum is the
continuation's loglikelihood) and `top_logprobs` (greedy when each token is its position's likeliest).
"""

import asyncio
import json

import pytest

from raylane.deployments.gateway.request_body import validate_body
from raylane.deployments.metrics.pool import MeteredLLM, PoolMetrics
from raylane.deployments.pool.serving_chat import OpenAIServingChat
from raylane.deployments.pool.serving_completion import OpenAIServingCompletion
from raylane.deployments.protocol.errors import OpenAIError
from raylane.deployments.protocol.openai_schemas import ChatCompletionRequest, CompletionRequest
from raylane.deployments.protocol.sampling import chat_params, completion_params
from raylane.deployments.protocol.wire import FinalItem
from raylane.engine import AsyncLLM, RequestOutputKind, SamplingParams
from raylane.models.packaged import packaged_model_path

CONTEXT = "Question: What is the capital of France?\nAnswer:"
CONTINUATION = " The capital of France is Paris."


@pytest.fixture(scope="module")
def llm():
    engine = AsyncLLM(
        model=str(packaged_model_path("smollm2-135m-instruct")), num_kv_blocks=128, engine_core="thread"
    )
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def ids(llm) -> tuple[list[int], list[int]]:
    """The context's and the continuation's token ids, as lm-eval encodes them (separately)."""
    encode = lambda text: llm.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    return encode(CONTEXT), encode(CONTINUATION)


def serve_items(llm, body: dict) -> list:
    """What the pool sends the gateway for `body`, parsed and checked as the gateway does."""

    async def run() -> list:
        if "messages" in body:
            req = validate_body(body, ChatCompletionRequest)
            params, plan = chat_params(req)
            items = OpenAIServingChat(llm, "m", 8192).chat(req, params, plan, "c1")
        else:
            req = validate_body(body, CompletionRequest)
            items = OpenAIServingCompletion(llm, "m", 8192).completion(req, completion_params(req), "c2")
        return [item async for item in items]

    return asyncio.run(run())


def serve(llm, body: dict) -> dict | list:
    """The response as the client gets it: the JSON body, or a stream's events (JSON, then "[DONE]")."""
    items = serve_items(llm, body)
    if isinstance(items[0], OpenAIError):
        raise items[0]
    texts = [item.item if isinstance(item, FinalItem) else item.text for item in items]
    if not body.get("stream"):
        return json.loads(texts[0])
    payloads = [line.removeprefix("data: ") for text in texts for line in text.split("\n\n") if line]
    return [p if p == "[DONE]" else json.loads(p) for p in payloads]


def engine_output(llm, prompt: list[int], params: SamplingParams):
    """The engine's own final output for `prompt`."""

    async def run():
        final = params.clone(output_kind=RequestOutputKind.FINAL_ONLY)
        return [out async for out in llm.generate(prompt, final, request_id="direct")][-1]

    return asyncio.run(run())


def lm_eval_request(prompt: list[int], **fields) -> dict:
    return {"model": "m", "prompt": prompt, "echo": True, "logprobs": 1, "temperature": 0, **fields}


def test_echo_with_logprobs_puts_the_prompt_tokens_logprobs_first(llm, ids):
    context, continuation = ids
    prompt = context + continuation
    body = serve(llm, lm_eval_request(prompt, max_tokens=1))
    [choice] = body["choices"]
    logprobs = choice["logprobs"]
    tokens, token_logprobs, top = logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]
    # The prompt's tokens, then the one generated; the first has no context, so no logprob.
    assert len(tokens) == len(token_logprobs) == len(top) == len(prompt) + 1
    assert token_logprobs[0] is None and top[0] is None
    assert all(isinstance(lp, float) and lp <= 0 for lp in token_logprobs[1:])
    assert choice["text"] == CONTEXT + CONTINUATION + tokens[-1]
    assert "".join(tokens[: len(prompt)]) == CONTEXT + CONTINUATION
    # Offsets count from 0 over the echoed text, then go on over the completion.
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0
    assert all(b - a == len(t) for a, b, t in zip(offsets, offsets[1:], tokens, strict=False))
    # top_logprobs: the likeliest token and the token itself (OpenAI: up to logprobs + 1 entries).
    for token, lp, alternatives in zip(tokens[1:], token_logprobs[1:], top[1:], strict=True):
        assert alternatives[token] == lp and 1 <= len(alternatives) <= 2
        assert max(alternatives.values()) >= lp
    # The continuation's loglikelihood, as lm-eval sums it, is the engine's.
    engine = engine_output(llm, prompt, SamplingParams(max_tokens=1, prompt_logprobs=1)).prompt_logprobs
    positions = range(len(context), len(prompt))
    want = sum(engine[i][prompt[i]].logprob for i in positions)
    assert sum(token_logprobs[len(context) : -1]) == pytest.approx(want, abs=1e-6)
    assert body["usage"] == {
        "prompt_tokens": len(prompt),
        "completion_tokens": 1,
        "total_tokens": len(prompt) + 1,
        "prompt_tokens_details": {"cached_tokens": 0},
    }

    # Streamed: the echo event carries the prompt and its logprobs; the events add up to the same.
    events = serve(llm, lm_eval_request(prompt, max_tokens=1, stream=True))
    echo = events[0]["choices"][0]
    assert echo["text"] == CONTEXT + CONTINUATION
    assert echo["logprobs"]["tokens"] == tokens[: len(prompt)]
    streamed = [e["choices"][0]["logprobs"] for e in events[:-1] if e["choices"][0].get("logprobs")]
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for part in streamed for x in part[field]] == logprobs[field]


def test_max_tokens_0_with_echo_is_the_prompt_alone_with_its_logprobs(llm, ids):
    context, continuation = ids
    prompt = context + continuation
    body = serve(llm, lm_eval_request(prompt, max_tokens=0))
    [choice] = body["choices"]
    assert choice["text"] == CONTEXT + CONTINUATION and choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == len(prompt)
    token_logprobs = choice["logprobs"]["token_logprobs"]
    assert len(token_logprobs) == len(prompt) and token_logprobs[0] is None
    # The request log and the key's rate limit (the pool's summary) count no completion token either.
    [final] = serve_items(MeteredLLM(llm, PoolMetrics("m", "m")), lm_eval_request(prompt, max_tokens=0))
    assert (final.summary.prompt_tokens, final.summary.completion_tokens) == (len(prompt), 0)

    # The prompt's logprobs (one forward of the whole prompt) are the logprobs the engine reports for
    # the same tokens when it generates them (one decode step each): lm-eval's greedy check relies on it.
    greedy = engine_output(llm, context, SamplingParams(temperature=0, max_tokens=4, logprobs=0))
    generated = greedy.outputs[0]
    echoed = serve(llm, lm_eval_request(context + generated.token_ids, max_tokens=0))
    scored = echoed["choices"][0]["logprobs"]["token_logprobs"][len(context) :]
    decoded = [entry[t].logprob for t, entry in zip(generated.token_ids, generated.logprobs, strict=True)]
    assert scored == pytest.approx(decoded, abs=1e-4)
    tops = echoed["choices"][0]["logprobs"]["top_logprobs"][len(context) :]
    assert all(lp == max(top.values()) for lp, top in zip(scored, tops, strict=True))  # greedy tokens

    events = serve(
        llm, lm_eval_request(prompt, max_tokens=0, stream=True, stream_options={"include_usage": True})
    )
    choices = [e["choices"][0] for e in events[:-1] if e["choices"]]
    assert "".join(c["text"] for c in choices) == CONTEXT + CONTINUATION
    assert [c.get("finish_reason") for c in choices][-1] == "length"
    assert sum(len(c["logprobs"]["tokens"]) for c in choices if c.get("logprobs")) == len(prompt)
    assert events[-2]["usage"]["completion_tokens"] == 0 and events[-1] == "[DONE]"


def test_prompt_logprobs_come_in_vllms_format(llm, ids):
    """vLLM's `prompt_logprobs` extension: per prompt token, token id -> logprob, rank, decoded token;
    on each completions choice, and at the top of a chat completion."""
    context, _ = ids
    body = serve(llm, {"model": "m", "prompt": context, "max_tokens": 1, "prompt_logprobs": 2})
    [choice] = body["choices"]
    assert "logprobs" not in choice or choice["logprobs"] is None
    entries = choice["prompt_logprobs"]
    assert len(entries) == len(context) and entries[0] is None
    for token, entry in zip(context[1:], entries[1:], strict=True):
        assert str(token) in entry and 2 <= len(entry) <= 3  # the top 2 and the token itself
        assert {"logprob", "rank", "decoded_token"} == set(entry[str(token)])
        assert sorted(e["rank"] for e in entry.values())[:2] == [1, 2]
    assert entries[1][str(context[1])]["decoded_token"] == llm.tokenizer.decode([context[1]])

    messages = [{"role": "user", "content": "Hi"}]
    chat = serve(llm, {"model": "m", "messages": messages, "max_tokens": 1, "prompt_logprobs": 0})
    entries = chat["prompt_logprobs"]
    assert entries[0] is None and all(len(entry) == 1 for entry in entries[1:])
    assert chat["usage"]["prompt_tokens"] == len(entries)
    plain = serve(llm, {"model": "m", "messages": messages, "max_tokens": 1})
    assert "prompt_logprobs" not in plain


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),  # without echo there is nothing to return
        ({"max_tokens": 0, "echo": True, "min_tokens": 1}, "min_tokens"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),  # capped as vLLM's max_logprobs: 20
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),  # vLLM: not in a stream
        ({"logprobs": 6, "echo": True}, "logprobs"),  # OpenAI's cap on the legacy logprobs: 5
    ],
)
def test_out_of_bounds_is_a_400_naming_the_field(fields, param):
    with pytest.raises(OpenAIError) as raised:
        completion_params(validate_body({"model": "m", "prompt": "Hi", **fields}, CompletionRequest))
    assert (raised.value.status, raised.value.param) == (400, param)
    with pytest.raises(OpenAIError) as raised:
        body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "prompt_logprobs": 21}
        chat_params(validate_body(body, ChatCompletionRequest))
    assert raised.value.param == "prompt_logprobs"
