"""/v1/embeddings in the gateway (the real MiniLM): one thread computes them for every key, so a call
of many texts takes it turn by turn and a call from another key is answered between two turns."""

import asyncio

import numpy as np

from raylane.config import EmbeddingsConfig
from raylane.deployments.gateway.embeddings import TURN_TEXTS, create_embeddings
from raylane.deployments.protocol.openai_schemas import EmbeddingRequest
from raylane.router import embeddings


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
