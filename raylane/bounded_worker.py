"""A worker process that runs calls a client controls within a bound: off the event loop, one at a
time, killed past its time limit, with a bounded queue per key.

A call that passes its limit kills the worker (a C++ grammar compile cannot be interrupted any
other way) and raises `WorkerTimeout`; the next call starts a fresh worker, forked from a
forkserver that has imported what the calls need (`preload`), so a restart is cheap next to a cold
`import torch`. The limit is CPU time of the worker (`timeout_s`), so a call that is fine on an idle
machine is fine at a peak too, and `WALL_FACTOR` times that in wall-clock time whatever the load: a
call that reaches the wall-clock bound before its CPU bound was starved by a busy machine, not too
costly, and gets `WorkerStarved` (a `WorkerBusy`: the client may retry), not `WorkerTimeout`.
The worker runs SCHED_IDLE (see `run_below_serving`): a client's work takes what the cores leave.
The queue is bounded in all (`max_pending`) and per API key (`max_pending_per_key`): a call that
finds either full gets `WorkerBusy` at once, never a silent wait.

Used for grammars, where the gateway checks a request's grammar (deployments/gateway/core.py) and
a pool compiles it (engine/grammar_compiler.py), and for /v1/embeddings in the gateway
(deployments/gateway/embeddings.py). It imports nothing of raylane; its forkserver imports
raylane.below_serving first, which puts it below the serving processes before its preload.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

WALL_FACTOR = 4  # a call may take this many times its CPU bound in wall-clock time
WORKER_NICE = 10  # where SCHED_IDLE is missing: the workers' niceness, added to their parent's
MAX_PENDING = 16  # calls queued or running in one worker, all keys
MAX_PENDING_PER_KEY = 2  # of which one API key's
START_TIMEOUT_S = 180.0  # a cold forkserver imports torch + xgrammar: slow on a busy machine

logger = logging.getLogger(__name__)


class WorkerTimeout(Exception):
    """The call did not finish within its limit; the worker that ran it was killed."""


class WorkerBusy(Exception):
    """The worker's queue (or the key's share of it) is full; `retry_after`: seconds until a place is
    likely free."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class WorkerStarved(WorkerBusy):
    """The call reached its wall-clock bound with CPU time to spare: the machine's other work kept the
    worker off the cores. Not the call's fault; the worker that ran it was killed."""


class BoundedWorker:
    """One worker process running picklable calls `fn(*args)` with a time limit, one at a time.

    Calls queue on one thread of their own, which sends each to the worker and waits for its answer,
    so an event loop that awaits `run` keeps serving, and a caller that is cancelled (its client
    left) cannot let the next call cross its answer on the pipe: the thread finishes the exchange.
    `initializer(*initargs)` runs once in each new worker.
    """

    def __init__(
        self,
        initializer=None,
        initargs: tuple = (),
        *,
        timeout_s: float,
        preload: tuple[str, ...] = (),
        max_pending: int = MAX_PENDING,
        max_pending_per_key: int = MAX_PENDING_PER_KEY,
    ):
        """`preload`: modules the forkserver imports once (the first worker of the process sets it).
        `max_pending`, `max_pending_per_key`: calls queued or running at once, in all and per key."""
        self.initializer, self.initargs, self.timeout_s = initializer, initargs, timeout_s
        self.preload = preload
        self.max_pending, self.max_pending_per_key = max_pending, max_pending_per_key
        self.pending: dict[str, int] = {}  # calls queued or running per key (none: absent)
        self._call_s: float | None = None  # smoothed time a call holds the worker
        self._lock = threading.Lock()
        self._process = None
        self._conn = None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="bounded-worker")
        self.restarts = 0  # workers killed for running past their limit

    async def run(self, fn, *args, timeout_s: float | None = None, key: str = "") -> Any:
        """`fn(*args)` in the worker; its exception is re-raised here; WorkerTimeout past the limit;
        WorkerBusy at once when the queue, or API key `key`'s share of it, is full. A call counts
        until the worker is done with it, even if its caller went away (it still holds the worker)."""
        with self._lock:
            total, own = sum(self.pending.values()), self.pending.get(key, 0)
            if total >= self.max_pending or own >= self.max_pending_per_key:
                whose = "in all" if total >= self.max_pending else "for this API key"
                held = total if total >= self.max_pending else own
                raise WorkerBusy(
                    f"{held} calls are already queued {whose}, the most allowed",
                    retry_after=held * (self._call_s or self.timeout_s),
                )
            self.pending[key] = own + 1
        submitted = time.monotonic()

        def done(_) -> None:  # in the worker's thread, or here if cancelled before it ran
            with self._lock:
                self._release(key)
                # What a call ahead costs the ones behind it: its wait and run, over the calls it waited for.
                cost = (time.monotonic() - submitted) / (total + 1)
                self._call_s = cost if self._call_s is None else self._call_s + 0.2 * (cost - self._call_s)

        future = self._thread.submit(self._call, fn, args, timeout_s or self.timeout_s)
        future.add_done_callback(done)
        return await asyncio.wrap_future(future)

    def hold(self, key: str, seconds: float) -> None:
        """Charge API key `key` one place of its share for `seconds` more (from an event loop): a call
        of its that ran out its time limit took the worker that long from every other key, and the
        key's next ones wait out as much before they may take its place again."""
        with self._lock:
            self.pending[key] = self.pending.get(key, 0) + 1

        def release() -> None:
            with self._lock:
                self._release(key)

        asyncio.get_running_loop().call_later(seconds, release)

    def _release(self, key: str) -> None:
        """One place of `key` given back (the lock held)."""
        n = self.pending[key] - 1
        if n:
            self.pending[key] = n
        else:
            del self.pending[key]

    def _call(self, fn, args: tuple, timeout_s: float) -> Any:
        if self._process is None or not self._process.is_alive():
            self._start()
        self._conn.send((fn, args))
        if (used := self._cpu_until_answer(timeout_s)) is not None:
            self._kill()
            self.restarts += 1
            wall_s = WALL_FACTOR * timeout_s
            if used < timeout_s:
                raise WorkerStarved(
                    f"the server is too busy: the call had {used:.1f} s of CPU time in {wall_s:g} s",
                    retry_after=wall_s,
                )
            raise WorkerTimeout(f"not done within {timeout_s:g} s")
        ok, value = self._conn.recv()
        if not ok:
            raise value
        return value

    def _cpu_until_answer(self, timeout_s: float) -> float | None:
        """None when the worker answers before it has used `timeout_s` of CPU time and within
        `WALL_FACTOR` x `timeout_s` of wall-clock time; else the CPU seconds it had used (where its CPU
        time cannot be read, the bound is `timeout_s` of wall-clock time)."""
        pid = self._process.pid
        start = _cpu_seconds(pid)
        if start is None:
            return None if self._conn.poll(timeout_s) else timeout_s
        deadline = time.monotonic() + WALL_FACTOR * timeout_s
        while not self._conn.poll(CPU_POLL_S):
            used = _cpu_seconds(pid)
            if used is None or used - start >= timeout_s or time.monotonic() >= deadline:
                if self._conn.poll(0):
                    return None
                return timeout_s if used is None else used - start
        return None

    def _start(self) -> None:
        ctx = _context(self.preload)
        parent, child = ctx.Pipe()
        self._process = ctx.Process(
            target=_serve, args=(child, self.initializer, self.initargs), daemon=True, name="bounded-worker"
        )
        self._process.start()
        child.close()
        self._conn = parent
        if not parent.poll(START_TIMEOUT_S):  # the initializer's "ready"
            self._kill()
            raise RuntimeError(f"the worker did not start within {START_TIMEOUT_S:g} s")
        parent.recv()

    def _kill(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.join(5)
        if self._conn is not None:
            self._conn.close()
        self._process = self._conn = None

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
        self._kill()


CPU_POLL_S = 0.05  # how often a waiting call reads its worker's CPU time
try:
    _libc = ctypes.CDLL("libc.so.6")
except OSError:  # not glibc: nothing to trim
    _libc = None
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` (Linux /proc); None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # after the command name, which may hold spaces
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime, stime: fields 14, 15 of stat(5)


_ctx_lock = threading.Lock()
_ctx = None


def _context(preload: tuple[str, ...]):
    """A forkserver context that preloads `preload`: new workers are forks of a process that has it."""
    global _ctx
    with _ctx_lock:
        if _ctx is None:
            _ctx = multiprocessing.get_context("forkserver")
            _ctx.set_forkserver_preload(["raylane.below_serving", *preload])
        return _ctx


def start_forkserver(preload: tuple[str, ...]) -> None:
    """Start this process's forkserver now, in the background, rather than for the first call.

    The forkserver imports `preload` (for grammars: torch and xgrammar): seconds of CPU, over thirty
    on a busy two-core machine. Started lazily, that wait fell on the first request with a grammar a
    replica met, and on a structured stream resumed on a replica that had not had one yet."""

    def start() -> None:
        try:
            _context(preload)
            multiprocessing.forkserver.ensure_running()
        except Exception as e:  # the first grammar starts it then, as before
            logger.warning("the bounded workers' forkserver did not start: %r", e)

    threading.Thread(target=start, daemon=True, name="bounded-worker-forkserver").start()


def run_below_serving() -> None:
    """SCHED_IDLE: the worker gets only CPU time that no ordinary task wants, and an ordinary task that
    wakes takes the core from it at once. A nice value is not enough: Ray starts its workers (the
    serving processes) at nice 15, so +10 lands at 19, a weight of 15 against their 36 (under another
    key's compiles, test_noisy_neighbour's victim p95 reached 3.5-4.3x on an AMD EPYC). Where the
    policy is missing (not Linux), `WORKER_NICE`."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        with contextlib.suppress(OSError):
            os.nice(WORKER_NICE)


def _serve(conn, initializer, initargs) -> None:
    # The objects this fork shares with its forkserver (the preloaded torch, ...) leave the garbage
    # collector's reach: a full collection writes to every object it scans, which copies the
    # shared pages they sit on into this process.
    gc.freeze()
    run_below_serving()
    if initializer is not None:
        initializer(*initargs)
    conn.send("ready")
    while True:
        try:
            fn, args = conn.recv()
        except EOFError:
            return
        try:
            result = (True, fn(*args))
        except Exception as e:
            result = (False, e)
        try:
            conn.send(result)
        except Exception:  # a result or exception that does not pickle: its text
            conn.send((False, RuntimeError(f"{type(result[1]).__name__}: {result[1]}")))
        del result
        if _libc is not None:  # glibc keeps what a call freed (MiniLM's activations) unless asked
            _libc.malloc_trim(0)
