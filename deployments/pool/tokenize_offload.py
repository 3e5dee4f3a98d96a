"""Tokenizing a large prompt off the pool replica's event loop.

The replica's loop streams every other request's tokens and answers Serve's health checks; the
chat template and the tokenizer on a 2 MB prompt take about a second, which on that loop would stall
them all. A prompt with more than `INLINE_MAX_CHARS` of text is rendered and encoded in one of a few
threads (the HF tokenizers release the GIL while they encode); a small one stays inline, where a
thread hop would cost more than the work. Deciding costs a walk of at most a few hundred nodes of
the request, however many it has: each node counts `NODE_CHARS`, and the walk stops at the bound.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from pydantic import BaseModel

INLINE_MAX_CHARS = 4096  # a few KB: under a millisecond of template and tokenizer work
NODE_CHARS = 16  # what a message, list or number counts: many tiny parts are a large prompt too
MAX_THREADS = 2  # concurrent large prompts of one replica; more wait their turn

T = TypeVar("T")
_executor: ThreadPoolExecutor | None = None


def is_large(value: Any, limit: int = INLINE_MAX_CHARS) -> bool:
    """Whether `value` (strings, lists, dicts and pydantic models of them) holds more than `limit`
    characters of text, counting each node as at least `NODE_CHARS`."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        total += len(item) if isinstance(item, str) else NODE_CHARS
        if total > limit:
            return True
        if isinstance(item, BaseModel):
            stack.extend(item.__dict__.values())
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return False


async def tokenize_off_loop(work: Callable[[], T], *inputs: Any) -> T:
    """`work()`: inline when `inputs` (what it renders and encodes) are small, else in a thread."""
    if not is_large(inputs):
        return work()
    return await asyncio.get_running_loop().run_in_executor(_threads(), work)


def _threads() -> ThreadPoolExecutor:
    global _executor
    if _executor is None:
        _executor = ThreadPoolExecutor(MAX_THREADS, thread_name_prefix="raylane-tokenize")
    return _executor
