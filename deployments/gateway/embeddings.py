"""`/v1/embeddings`, computed in the gateway (MiniLM, from `raylane.router.embeddings`), so no pool is
needed."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ctypes
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from raylane.config import EmbeddingsConfig
from raylane.deployments.gateway.routing import torch_on_one_thread
from raylane.deployments.protocol.errors import invalid, model_not_found
from raylane.deployments.protocol.openai_schemas import Embedding, EmbeddingRequest, EmbeddingResponse, Usage

_executor: ThreadPoolExecutor | None = None
EMBEDDINGS_NICE = 10
TRIM_AFTER_TEXTS = 32
# Texts per turn on the embeddings thread: a call of 2,048 texts takes it in 64 turns, and a call
# arriving meanwhile waits for at most one turn, not for the whole call. A turn took 0.09 s for 32
# short texts and 2.0 s for 32 texts of MiniLM's whole 256 tokens (AMD EPYC family 25, 2 cores).
TURN_TEXTS = 32
try:
    _libc = ctypes.CDLL("libc.so.6")
except OSError:  # not glibc: nothing to trim
    _libc = None
M_MMAP_THRESHOLD = -3  # mallopt(3)
MMAP_THRESHOLD_BYTES = 256 * 1024


def return_large_buffers() -> None:
    """Blocks of 256 KiB and more (request bodies, MiniLM's activations) get their own mapping,
    given back to the system when freed. glibc's default raises that threshold to the largest block
    freed so far (up to 32 MiB), after which such blocks come from the heap, which keeps its pages.
    (Measured once against test_noisy_neighbour's gateway growth: within its run-to-run spread.)"""
    if _libc is not None:
        _libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)


async def create_embeddings(cfg: EmbeddingsConfig, req: EmbeddingRequest) -> EmbeddingResponse:
    """The response to an authenticated, rate-checked and validated request; its `usage` counts the
    tokens MiniLM read."""

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
    vectors, counts = await _take_turns(texts)
    if req.dimensions is not None and req.dimensions != vectors.shape[1]:
        raise invalid("dimensions", f"{cfg.model_id} returns {vectors.shape[1]} dimensions only.")
    data = [
        Embedding(index=i, embedding=_encode_vector(v, req.encoding_format)) for i, v in enumerate(vectors)
    ]
    usage = Usage(prompt_tokens=sum(counts), total_tokens=sum(counts))
    return EmbeddingResponse(data=data, model=cfg.model_id, usage=usage)


async def _take_turns(texts: list[str]) -> tuple[np.ndarray, list[int]]:
    """`_embed` of `texts`, TURN_TEXTS at a time, each turn queued on the one embeddings thread after
    the last one ends: calls arriving together are served turn by turn (the thread's queue is first
    come, first served), and a call whose client has gone (the request task is cancelled) stops
    after its current turn."""
    loop = asyncio.get_running_loop()
    vectors, counts = [], []
    for start in range(0, len(texts), TURN_TEXTS):
        trim = start + TURN_TEXTS >= len(texts) and len(texts) >= TRIM_AFTER_TEXTS  # its last turn
        part, part_counts = await loop.run_in_executor(
            _embedder(), _embed, texts[start : start + TURN_TEXTS], trim
        )
        vectors.append(part)
        counts += part_counts
    return np.concatenate(vectors), counts


def _embedder() -> ThreadPoolExecutor:
    """One thread of its own: MiniLM runs one call at a time anyway (raylane.router.embeddings' lock), and
    a flood of embeddings waiting for it must not hold the threads of the shared default executor,
    which runs the classifier of every other `auto` request. The thread runs below the gateway's
    priority: a client's 2,048 texts take seconds of a core, which the requests of every other key
    passing through this gateway need first."""
    global _executor
    if _executor is None:
        _executor = ThreadPoolExecutor(1, thread_name_prefix="raylane-embeddings", initializer=_start_thread)
    return _executor


def _embed(texts: list[str], trim: bool) -> tuple[np.ndarray, list[int]]:
    """(vectors, token counts). With `trim` (the end of a call of a batch or more), the heap's free
    memory goes back to the system: glibc keeps what MiniLM's activations took (over 150 MB after a
    few calls of 256 long texts, in a gateway that otherwise holds tens of MB) unless asked."""
    from raylane.router import embeddings

    result = embeddings.embed(texts), embeddings.count_tokens(texts)
    if trim and _libc is not None:
        _libc.malloc_trim(0)
    return result


def _start_thread() -> None:
    """Nice this thread (on Linux a thread is a task of its own) by `EMBEDDINGS_NICE`; torch on one
    thread, as for the classifier."""
    torch_on_one_thread()
    with contextlib.suppress(AttributeError, OSError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + EMBEDDINGS_NICE)


def _encode_vector(vector, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return vector.tolist()
