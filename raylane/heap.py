"""Giving freed memory back to the system after the large, short-lived buffers an upload or a batch
leaves behind. glibc's malloc keeps what Python frees in its heaps; after a 64 MiB upload (whose
body Serve's replica buffers as fast as the proxy sends it) a gateway replica stayed ~50-80 MiB
larger for good, and a bare Serve replica too (about 110 MiB after two parallel uploads, of which
`malloc_trim` returned all but ~50). Elsewhere than glibc this does nothing."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import threading
import time

MIN_INTERVAL_S = 1.0  # a trim walks every heap: at most one a second, however many uploads end
_lock = threading.Lock()
_last = 0.0


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


def trim() -> bool:
    """`malloc_trim(0)` unless one ran in the last MIN_INTERVAL_S (or there is no glibc): whether it ran."""
    global _last
    trim_fn = _malloc_trim()
    if trim_fn is None:
        return False
    with _lock:
        if time.monotonic() - _last < MIN_INTERVAL_S:
            return False
        _last = time.monotonic()
    trim_fn(0)
    return True


async def trim_off_loop() -> None:
    """`trim` on a thread: it takes milliseconds per heap, not the event loop's to give."""
    await asyncio.to_thread(trim)


_pending: set[asyncio.Task] = set()


def trim_soon(delay_s: float = 1.0) -> None:
    """`trim_off_loop` in `delay_s`, once however often it is asked meanwhile: after the request that
    asks has ended, and its buffers with it (Serve frees a body's messages when the request is over)."""
    if _pending:
        return

    async def later() -> None:
        await asyncio.sleep(delay_s)
        _pending.clear()
        await trim_off_loop()

    task = asyncio.get_running_loop().create_task(later())
    _pending.add(task)
