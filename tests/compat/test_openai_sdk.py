"""The `openai` SDK, as every other library here wraps it: chat (sync, async, streamed),
completions and embeddings against the real SmolLM2 and MiniLM."""

import asyncio
import math

from tests.compat.conftest import EMBEDDING_MODEL, MODEL

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_answers_the_question(openai_client):
    reply = openai_client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=16
    )
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens > 0 and reply.model == MODEL


def test_chat_takes_content_as_text_parts(openai_client):
    """What many clients always send (guidellm, the agent SDKs): OpenAI accepts it for every role."""
    parts = [{"role": "system", "content": [{"type": "text", "text": "Answer in one short sentence."}]}] + [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is the capital"},
                {"type": "text", "text": " of France?"},
            ],
        }
    ]
    reply = openai_client.chat.completions.create(model=MODEL, messages=parts, temperature=0, max_tokens=16)
    assert "Paris" in reply.choices[0].message.content


def test_async_chat(server):
    import openai

    async def ask():
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        replies = await asyncio.gather(
            *[client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=16)]
            * 3
        )
        await client.close()
        return replies

    texts = {r.choices[0].message.content for r in asyncio.run(ask())}
    assert len(texts) == 1 and "Paris" in texts.pop()  # greedy: the same answer three times


def test_streamed_chat_equals_the_whole_answer(openai_client):
    whole = openai_client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=16
    )
    chunks = list(
        openai_client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            temperature=0,
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_continuous_usage_stats_count_every_chunk(openai_client):
    """vLLM's `stream_options.continuous_usage_stats` (guidellm sends it): usage on every chunk."""
    chunks = list(
        openai_client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            temperature=0,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    counted = [c.usage.completion_tokens for c in chunks if c.choices and c.choices[0].delta.content]
    assert counted and all(c is not None for c in counted)
    assert counted == sorted(counted) and counted[-1] <= chunks[-1].usage.completion_tokens


def test_completion(openai_client):
    reply = openai_client.completions.create(
        model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=4
    )
    assert "Paris" in reply.choices[0].text


def test_embeddings_of_similar_texts_are_closer(openai_client):
    texts = ["a cat sat on the mat", "a kitten sat on the rug", "stock prices fell sharply"]
    data = openai_client.embeddings.create(model=EMBEDDING_MODEL, input=texts).data
    cat, kitten, stocks = (d.embedding for d in data)
    assert len(cat) == 384
    assert _cosine(cat, kitten) > _cosine(cat, stocks) + 0.2


def test_embeddings_of_token_ids_equal_those_of_the_text(openai_client):
    """OpenAI's API takes token-id arrays; raylane reads them in the embedding model's vocabulary."""
    text = "a cat sat on the mat"
    by_text = openai_client.embeddings.create(model=EMBEDDING_MODEL, input=text).data[0].embedding
    ids = [101, 1037, 4937, 2938, 2006, 1996, 13523, 102]  # MiniLM's tokenizer: [CLS] a cat ... [SEP]
    by_ids = openai_client.embeddings.create(model=EMBEDDING_MODEL, input=[ids]).data[0].embedding
    assert _cosine(by_text, by_ids) > 0.999


def _cosine(a, b) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def test_completion_echoes_the_prompt_with_its_logprobs(openai_client):
    """What lm-eval and other harnesses send for a loglikelihood: the prompt back with each token's
    logprob (the first has none), and with max_tokens 0 nothing generated."""
    prompt = "The capital of France is Paris"
    reply = openai_client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=0)
    choice = reply.choices[0]
    assert choice.text == prompt and reply.usage.completion_tokens == 0
    logprobs = choice.logprobs.token_logprobs
    assert logprobs[0] is None and len(logprobs) == reply.usage.prompt_tokens
    assert all(lp <= 0 for lp in logprobs[1:])
