"""`/v1/embeddings`, computed in the gateway (MiniLM, from `router.embeddings`), so no pool is needed."""

from __future__ import annotations

import asyncio
import base64
from concurrent.futures import ThreadPoolExecutor

from cluster.config import EmbeddingsConfig
from deployments.errors import invalid, model_not_found
from deployments.openai_schemas import Embedding, EmbeddingRequest, EmbeddingResponse, Usage

_executor: ThreadPoolExecutor | None = None


async def create_embeddings(cfg: EmbeddingsConfig, req: EmbeddingRequest) -> EmbeddingResponse:
    """The response to an authenticated, rate-checked and validated request; its `usage` counts the
    tokens MiniLM read."""
    from router import embeddings

    if not cfg.enabled or req.model != cfg.model_id:
        raise model_not_found(req.model)
    texts = [req.input] if isinstance(req.input, str) else req.input
    if not texts:
        raise invalid("input", "input must not be empty.")
    if not all(isinstance(t, str) for t in texts):
        raise invalid("input", f"{cfg.model_id} takes text; token arrays are not supported.")
    if len(texts) > cfg.max_inputs:
        raise invalid("input", f"At most {cfg.max_inputs} inputs per request, got {len(texts)}.")
    if not all(texts):
        raise invalid("input", "input strings must not be empty.")
    vectors, counts = await asyncio.get_running_loop().run_in_executor(
        _embedder(), lambda: (embeddings.embed(texts), embeddings.count_tokens(texts))
    )
    if req.dimensions is not None and req.dimensions != vectors.shape[1]:
        raise invalid("dimensions", f"{cfg.model_id} returns {vectors.shape[1]} dimensions only.")
    data = [
        Embedding(index=i, embedding=_encode_vector(v, req.encoding_format)) for i, v in enumerate(vectors)
    ]
    usage = Usage(prompt_tokens=sum(counts), total_tokens=sum(counts))
    return EmbeddingResponse(data=data, model=cfg.model_id, usage=usage)


def _embedder() -> ThreadPoolExecutor:
    """One thread of its own: MiniLM runs one call at a time anyway (router.embeddings' lock), and
    a flood of embeddings waiting for it must not hold the threads of the shared default executor,
    which runs the classifier of every other `auto` request."""
    global _executor
    if _executor is None:
        _executor = ThreadPoolExecutor(1, thread_name_prefix="raylane-embeddings")
    return _executor


def _encode_vector(vector, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return vector.tolist()
