"""/v1/embeddings in the gateway (the real MiniLM): one worker process computes them for every key, so a call
of many texts takes it turn by turn and a call from another key is answered between two turns."""

import asyncio
import base64

import numpy as np
import pytest

from raylane.config import EmbeddingsConfig
from raylane.deployments.gateway import embeddings as gateway_embeddings
from raylane.deployments.gateway.embeddings import MAX_CALLS_PER_KEY, TURN_TEXTS
from raylane.deployments.protocol.openai_schemas import EmbeddingRequest, EmbeddingResponse
from raylane.router import embeddings
from raylane.router.errors import OverloadedError


async def create_embeddings(cfg: EmbeddingsConfig, req: EmbeddingRequest, key: str = "") -> EmbeddingResponse:
    """The gateway's answer read as a client reads it; its usage is the count the key is charged."""
    body, tokens = await gateway_embeddings.create_embeddings(cfg, req, key)
    answer = EmbeddingResponse.model_validate_json(body)
    assert answer.usage.prompt_tokens == tokens
    return answer


def test_a_small_call_is_answered_between_the_turns_of_a_large_one():
    cfg = EmbeddingsConfig()
    texts = [f"sentence {i} of a long document about the weather" for i in range(6 * TURN_TEXTS)]
    large = EmbeddingRequest(model=cfg.model_id, input=texts)
    small = EmbeddingRequest(model=cfg.model_id, input="a question from another key")

    async def both():
        large_call = asyncio.create_task(create_embeddings(cfg, large))
        await asyncio.sleep(0)  # the large call's first turn is queued
        small_answer = await create_embeddings(cfg, small)
        return small_answer, large_call.done(), await large_call

    small_answer, large_done_first, large_answer = asyncio.run(both())
    assert not large_done_first  # through one call of all its texts, the small one waited for it
    # Turn by turn, the vectors and token counts are those of one call of all the texts.
    np.testing.assert_allclose([d.embedding for d in large_answer.data], embeddings.embed(texts), atol=1e-5)
    assert [d.index for d in large_answer.data] == list(range(len(texts)))
    assert large_answer.usage.prompt_tokens == sum(embeddings.count_tokens(texts))
    np.testing.assert_allclose(small_answer.data[0].embedding, embeddings.embed([small.input])[0], atol=1e-5)


def test_one_key_holds_at_most_two_calls_in_the_queue_and_another_key_still_gets_in():
    """A third call from a key with two calls queued is the client's 429 with Retry-After at once,
    not a wait behind its own flood; another key's call is answered."""
    cfg = EmbeddingsConfig()
    large = EmbeddingRequest(
        model=cfg.model_id, input=["a long sentence about the weather " * 8] * TURN_TEXTS * 3
    )
    small = EmbeddingRequest(model=cfg.model_id, input="a question")

    async def main():
        flood = [asyncio.create_task(create_embeddings(cfg, large, "A")) for _ in range(MAX_CALLS_PER_KEY)]
        await asyncio.sleep(0)  # both have their first turn queued
        with pytest.raises(OverloadedError) as refused:
            await create_embeddings(cfg, small, "A")
        other = await create_embeddings(cfg, small, "B")
        await asyncio.gather(*flood)
        return refused.value, other

    refused, other = asyncio.run(main())
    assert refused.status == 429 and "for this API key" in str(refused)
    assert int(refused.headers()["retry-after"]) > 0
    assert len(other.data) == 1


def test_token_id_arrays_embed_like_the_text_they_encode():
    """langchain-openai sends token-id arrays by default (vLLM takes them in the model's own
    vocabulary): a text's MiniLM ids, [CLS] and [SEP] included, give the text's vector and count."""
    cfg = EmbeddingsConfig()
    texts = ["A man is playing a guitar.", "Interest rates rose sharply in the spring of that year."]
    ids = [embeddings._model().tokenizer(t)["input_ids"] for t in texts]
    by_ids = asyncio.run(create_embeddings(cfg, EmbeddingRequest(model=cfg.model_id, input=ids)))
    np.testing.assert_allclose([d.embedding for d in by_ids.data], embeddings.embed(texts), atol=1e-5)
    assert by_ids.usage.prompt_tokens == sum(map(len, ids))
    one = asyncio.run(create_embeddings(cfg, EmbeddingRequest(model=cfg.model_id, input=ids[1])))
    np.testing.assert_allclose(one.data[0].embedding, by_ids.data[1].embedding, atol=1e-6)


def test_base64_vectors_are_the_float_vectors_bytes():
    cfg = EmbeddingsConfig()
    texts = [f"sentence number {i}" for i in range(TURN_TEXTS + 3)]  # two turns
    floats = asyncio.run(create_embeddings(cfg, EmbeddingRequest(model=cfg.model_id, input=texts)))
    packed = asyncio.run(
        create_embeddings(cfg, EmbeddingRequest(model=cfg.model_id, input=texts, encoding_format="base64"))
    )
    decoded = [np.frombuffer(base64.b64decode(d.embedding), "<f4") for d in packed.data]
    np.testing.assert_array_equal(decoded, np.array([d.embedding for d in floats.data], "<f4"))
    assert [d.index for d in packed.data] == list(range(len(texts)))


def test_a_capped_call_stops_at_the_turn_that_passes_its_cap():
    """A batch line's embeddings stop computing once their JSON passes the line's cap (a 2,048-input
    line makes ~15 MB): the error tells the size reached, one turn's worth, not the whole call's."""
    cfg = EmbeddingsConfig()
    texts = [f"text {i}" for i in range(4 * TURN_TEXTS)]
    request = EmbeddingRequest(model=cfg.model_id, input=texts)
    whole, _ = asyncio.run(gateway_embeddings.create_embeddings(cfg, request))
    with pytest.raises(gateway_embeddings.ResultTooLarge) as stopped:
        asyncio.run(gateway_embeddings.create_embeddings(cfg, request, max_bytes=1000))
    assert 1000 < stopped.value.size < len(whole) / 3
    assert stopped.value.tokens == sum(embeddings.count_tokens(texts[:TURN_TEXTS]))  # what it charges
