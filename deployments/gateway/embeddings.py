"""`/v1/embeddings` for the gateway (MiniLM, from `raylane.router.embeddings`), so no pool is needed:
computed in a bounded worker process beside the gateway, never on its event loop or under its GIL."""

from __future__ import annotations

import json

from raylane.bounded_worker import BoundedWorker, WorkerBusy, WorkerTimeout
from raylane.config import EmbeddingsConfig
from raylane.deployments.protocol.errors import invalid, model_not_found, unavailable
from raylane.deployments.protocol.openai_schemas import EmbeddingRequest, Usage
from raylane.router.embeddings import DIMENSIONS, embed_items_json, start_worker, vocab_size
from raylane.router.errors import OverloadedError

# Texts per turn on the embeddings worker: a call of 2,048 texts takes it in 64 turns, and a call
# arriving meanwhile waits for at most one turn, not for the whole call. A turn took 0.09 s for 32
# short texts and 2.0 s for 32 texts of MiniLM's whole 256 tokens (AMD EPYC family 25, 2 cores).
TURN_TEXTS = 32
TURN_TIMEOUT_S = 60.0  # one turn's CPU time in the worker: 30x the longest measured
MAX_CALLS_PER_KEY = 2  # calls one API key may have queued or running in a gateway replica
# What the embeddings worker imports: the gateway's forkserver loads it once (with the grammar
# workers' imports), so a worker's start costs the model's load, not `import torch`.
EMBEDDINGS_PRELOAD = ("raylane.router.embeddings", "sentence_transformers")
_embeddings_worker: BoundedWorker | None = None


class ResultTooLarge(Exception):
    """The response would pass the caller's `max_bytes` (a batch line's cap): `size` bytes made so far,
    from `tokens` tokens read (what the caller charges: the work was done)."""

    def __init__(self, size: int, tokens: int) -> None:
        super().__init__(f"{size} bytes")
        self.size, self.tokens = size, tokens


async def create_embeddings(
    cfg: EmbeddingsConfig, req: EmbeddingRequest, key: str = "", max_bytes: int | None = None
) -> tuple[str, int]:
    """The JSON of the `EmbeddingResponse` to an authenticated, rate-checked and validated request from
    API key `key`, and the tokens MiniLM read (its `usage`). Past `max_bytes` of vectors, ResultTooLarge
    at the end of that turn: the rest is never computed."""

    if not cfg.enabled or req.model != cfg.model_id:
        raise model_not_found(req.model)
    inputs = _inputs(req.input)
    if len(inputs) > cfg.max_inputs:
        raise invalid("input", f"At most {cfg.max_inputs} inputs per request, got {len(inputs)}.")
    if isinstance(inputs[0], list):
        _check_token_ids(inputs, cfg.model_id)
    if req.dimensions is not None and req.dimensions != DIMENSIONS:
        raise invalid("dimensions", f"{cfg.model_id} returns {DIMENSIONS} dimensions only.")
    items, counts = await _take_turns(inputs, key, req.encoding_format, max_bytes)
    usage = Usage(prompt_tokens=sum(counts), total_tokens=sum(counts))
    # EmbeddingResponse's JSON, its items as the worker wrote them: joined here, not parsed again.
    body = (
        f'{{"object":"list","data":[{",".join(items)}],"model":{json.dumps(cfg.model_id)},'
        f'"usage":{usage.to_json()}}}'
    )
    return body, usage.prompt_tokens


def _inputs(value: str | list) -> list[str] | list[list[int]]:
    """OpenAI's four shapes of `input` as a list of texts or of token-id arrays, none empty."""
    if isinstance(value, str) or (value and isinstance(value[0], int)):
        value = [value]
    if not value:
        raise invalid("input", "input must not be empty.")
    if not all(value):
        raise invalid("input", "inputs must not be empty strings or arrays.")
    return value


def _check_token_ids(rows: list[list[int]], model_id: str) -> None:
    """Token ids are the embedding model's own (as in vLLM; a tiktoken id means nothing to MiniLM):
    one outside its vocabulary is the client's 400, naming where it is."""
    size = vocab_size()
    for i, row in enumerate(rows):
        for j, token in enumerate(row):
            if not 0 <= token < size:
                raise invalid(
                    f"input[{i}][{j}]",
                    f"Token id {token} is outside {model_id}'s vocabulary of {size} ids: token arrays "
                    f"must hold {model_id}'s own ids (send text otherwise).",
                )


async def _take_turns(
    texts: list[str] | list[list[int]], key: str, encoding_format: str, max_bytes: int | None
) -> tuple[list[str], list[int]]:
    """The response items (JSON, `embed_items_json`) and token counts of `texts`, TURN_TEXTS at a
    time, each turn queued on the embeddings worker after the last one ends: calls arriving together
    are served turn by turn (the worker's queue is first come, first served), and a call whose client
    has gone (the request task is cancelled) stops after its current turn. API key `key` holds at
    most `MAX_CALLS_PER_KEY` calls in a replica's queue; past that, or when the machine starves the
    worker, a 429 with Retry-After."""
    items, counts = [], []
    for start in range(0, len(texts), TURN_TEXTS):
        try:
            part, part_counts = await _worker().run(
                embed_items_json, texts[start : start + TURN_TEXTS], start, encoding_format, key=key
            )
        except WorkerBusy as e:
            raise OverloadedError(
                f"Embeddings cannot be computed now: {e}. Retry later, or send fewer calls at once.",
                retry_after=e.retry_after,
                reason="embeddings_queue",
            ) from None
        except WorkerTimeout as e:  # 32 texts of at most 256 tokens each: not the client's doing
            raise unavailable(f"Computing embeddings failed: {e}.") from None
        items.append(part)
        counts += part_counts
        if max_bytes is not None and (size := sum(map(len, items))) > max_bytes:
            raise ResultTooLarge(size, sum(counts))
    return items, counts


def _worker() -> BoundedWorker:
    """A process of its own, below serving (SCHED_IDLE): a client's 2,048 texts take seconds of a core,
    which the requests of every other key passing through this gateway need first. In a thread of the
    gateway, niced, the embeddings held the gateway's GIL between torch's ops, which the event loop
    serving every other key needs (test_noisy_neighbour: the victim's p95 1.3-1.5x, up to 2.4x on an
    AMD EPYC, under one key's large embeddings calls)."""
    global _embeddings_worker
    if _embeddings_worker is None:
        _embeddings_worker = BoundedWorker(
            start_worker,
            timeout_s=TURN_TIMEOUT_S,
            preload=EMBEDDINGS_PRELOAD,
            max_pending_per_key=MAX_CALLS_PER_KEY,
        )
    return _embeddings_worker
