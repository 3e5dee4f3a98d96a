"""Running a batch: its input read into a line index, each line sent through the gateway as the
`batch` tier while a window of lines in flight allows, each result recorded once (within the key's
quota and the per-line cap), then the output written (deployments/batch/output.py).

How many lines are in flight, over all batches, is a window (window.py): batches fill what is idle
and step back at once when interactive traffic comes.

A batch stops early, at its next line, when its key may no longer run it (the key is gone from the
config or its Secret, or its tier no longer allows batches: cancelled, with the lines done so far
in its output) or when its results would pass the key's `batch.max_bytes_per_key` (failed, its
results dropped).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from raylane import heap, tracing
from raylane.config.batch import BatchConfig
from raylane.deployments.batch.lines import (
    InputFile,
    LineCaps,
    LineRef,
    error_line,
    load_line,
    output_record_text,
    read_input,
    record_text,
)
from raylane.deployments.batch.output import OutputWriter
from raylane.deployments.batch.quota import OUTPUT_FILES, QuotaError, StorageQuota
from raylane.deployments.batch.store import BatchStore
from raylane.deployments.batch.window import Window
from raylane.deployments.metrics.batch import BatchMetrics
from raylane.deployments.protocol.batch_answers import (
    BUDGET_EXCEEDED,
    LINE_TOO_LARGE,
    NO_USAGE,
    STOPS_BATCH,
    LineUsage,
    line_too_large,
)

logger = logging.getLogger(__name__)
RETRY_S = (1.0, 30.0)  # a line turned away for load waits this long (doubling) before its next try


class StopBatch(Exception):
    """A batch cannot go on: `error` is its OpenAI batch error, `ending` what it becomes."""

    def __init__(self, ending: str, error: dict[str, Any]) -> None:
        super().__init__(error["message"])
        self.ending, self.error = ending, error


class BatchRunner:
    def __init__(
        self,
        store: BatchStore,
        quota: StorageQuota,
        config: BatchConfig,
        caps: LineCaps,
        gateway: Callable[[], Any],
        metrics: BatchMetrics,
    ) -> None:
        self.store, self.quota, self.config, self.caps = store, quota, config, caps
        self.gateway, self.metrics = gateway, metrics
        self.writer = OutputWriter(store, quota, config.file_ttl_s)
        self.window = Window(config.max_concurrency)
        self.stopped: dict[str, StopBatch] = {}  # batches told to stop, by id
        self._reading = asyncio.Lock()  # one input file read at a time: its index is what it costs
        self._calls: dict[int, float] = {}  # the gateway calls in flight (by id): when each started
        self._retrying = 0  # lines sleeping before their next try
        self._traces: dict[str, dict[str, str] | None] = {}  # batch id -> its span's carrier (traced)

    async def run(self, batch_id: str, key_id: str) -> None:
        """Run a batch to its end. Traced, it is one span (`batch`, from this run of it to its end),
        the parent of every line's request (the gateway's `run_batch_line` continues its carrier)."""
        attributes = {"raylane.batch_id": batch_id, "raylane.api_key.id": key_id}
        span = tracing.start("batch", attributes=attributes)
        self._traces[batch_id] = tracing.carrier(span)
        try:
            await self._run(batch_id, key_id)
        except Exception:
            logger.exception("batch %s could not be run", batch_id)
            error = {"code": "internal_error", "message": "The batch could not be run.", "param": None}
            self._fail(batch_id, error | {"line": None})
        finally:
            self.stopped.pop(batch_id, None)
            self._traces.pop(batch_id, None)
            tracing.end(span)
            heap.trim_soon()  # its lines' results (up to max_line_result_bytes each) passed here

    async def _run(self, batch_id: str, key_id: str) -> None:
        batch = self.store.batch(batch_id)
        path = self.store.path_of(batch["input_file_id"])
        finishing = batch["status"] in ("finalizing", "cancelling") or self.store.output_state(batch_id)
        if finishing:  # nothing more to send: the input is read only if lines expired
            await self.writer.finish(batch_id, lambda: self._lines(path))
            return
        read = await self._read(path)
        batch = self.store.batch(batch_id)  # cancelled while the file was read: not in progress
        if batch["status"] == "validating" and not self._validated(batch, read):
            return
        refs = read.lines
        del read  # the rest of what was read goes; the index stays for the run
        await self._run_lines(batch, key_id, path, refs)
        stop = self.stopped.get(batch_id)
        if stop is not None and stop.ending == "failed":
            self._fail(batch_id, stop.error)
            return
        if stop is not None:  # cancelled: the lines done so far are its output
            batch = self.store.batch(batch_id)
            batch["errors"] = {"object": "list", "data": [stop.error]}
            self.store.set_status(batch, "cancelling")

        async def input_lines() -> list[LineRef]:
            return refs

        await self.writer.finish(batch_id, input_lines)

    async def _lines(self, path: Path) -> list[LineRef]:
        return (await self._read(path)).lines

    async def _read(self, path: Path) -> InputFile:
        async with self._reading:
            return await asyncio.to_thread(self._read_file, path)

    def _read_file(self, path: Path) -> InputFile:
        limits = (self.config.max_lines, self.caps.max_body_bytes, self.caps)
        with path.open("rb") as source:
            return read_input(source, *limits)

    def _validated(self, batch: dict, read: InputFile) -> bool:
        """Start a batch whose input was read: its lines that cannot be sent go to its error file,
        or, when the file cannot be run whole, the batch fails. Whether it runs."""
        if read.errors:
            batch["errors"] = {"object": "list", "data": read.errors}
            self._fail(batch["id"], None, batch)
            return False
        for number, custom_id, code, message in read.rejected:  # to the error file, unsent
            self._record(
                batch, number, 400, record_text(error_line(custom_id, code, message)), batch["endpoint"]
            )
        batch["request_counts"]["total"] = len(read.lines) + len(read.rejected)
        self.store.set_status(batch, "in_progress")
        return True

    async def _run_lines(self, batch: dict, key_id: str, path: Path, refs: list[LineRef]) -> None:
        batch_id = batch["id"]
        done = await asyncio.to_thread(self.store.done_lines, batch_id)
        in_flight: set[asyncio.Task] = set()
        with path.open("rb") as source:  # open for the run: bodies are read from it as lines go
            try:
                for ref in refs:
                    if ref.number in done:
                        continue
                    await self.window.acquire()
                    if self._should_stop(batch):
                        await self.window.release(None)
                        break
                    task = asyncio.create_task(self._run_line(batch, key_id, source.fileno(), ref))
                    in_flight.add(task)
                    task.add_done_callback(in_flight.discard)
            finally:
                if in_flight:
                    await asyncio.wait(in_flight)

    def _should_stop(self, batch: dict) -> bool:
        if batch["id"] in self.stopped:
            return True
        status = self.store.batch(batch["id"])["status"]
        return status == "cancelling" or time.time() >= batch["expires_at"]

    async def _run_line(self, batch: dict, key_id: str, fd: int, ref: LineRef) -> None:
        """One line, holding a place in the window (taken by the caller) while it runs, and tried
        again later while it is turned away for load or waits for its key's budget; its result is
        recorded once."""
        wait_s, held, idle, started = RETRY_S[0], True, None, time.monotonic()
        try:
            line, (_, code, message) = await asyncio.to_thread(load_line, fd, ref, self.caps)
            if line is None:  # the file changed under the batch: the line cannot be sent now
                text = record_text(error_line(ref.custom_id, code, message))
                self._record(batch, ref.number, 400, text, batch["endpoint"])
                return
            attempt = 0
            while True:
                started = time.monotonic()
                status, body, busy, usage = await self._call_gateway(batch["id"], key_id, line)
                error_code = _error_code(status, body)
                if error_code in STOPS_BATCH:
                    self.stopped.setdefault(batch["id"], _stop_for_key(error_code, json.loads(body)))
                    return
                waiting = error_code == BUDGET_EXCEEDED  # the key's budget: the batch waits for it
                if status not in (429, 503) or (attempt >= self.config.line_retries and not waiting):
                    break
                if waiting and self._should_stop(batch):
                    return  # cancelled or expired while it waited: never run
                attempt += 0 if waiting else 1
                held = False
                await self.window.release(False)  # step back while it waits
                self._retrying += 1
                try:
                    await asyncio.sleep(wait_s)
                finally:
                    self._retrying -= 1
                wait_s = min(RETRY_S[1], wait_s * 2)
                await self.window.acquire()
                held = True
            if batch["id"] in self.stopped:
                return  # the batch stopped meanwhile: what it keeps is decided already
            if body is None:
                text = record_text(
                    error_line(line.custom_id, "service_unavailable", "The gateway could not be reached.")
                )
            elif error_code == LINE_TOO_LARGE or len(body) > self.config.max_line_result_bytes:
                error = line_too_large(len(body), self.config) if not error_code else None
                message = error.message if error else json.loads(body)["error"]["message"]
                status, text = 413, record_text(error_line(line.custom_id, LINE_TOO_LARGE, message))
            else:
                text = output_record_text(line.custom_id, status, body)
            self._record(batch, line.number, status, text, line.url, usage if status < 400 else NO_USAGE)
            idle = not busy and status not in (429, 503)
        finally:
            if held:
                await self.window.release(idle, time.monotonic() - started)

    def _record(
        self, batch: dict, number: int, status: int, text: str, endpoint: str, usage: LineUsage = NO_USAGE
    ) -> None:
        """A line's result, written once, within the key's quota (past which the batch stops,
        failed)."""
        size = len(text.encode())
        owner, _ = self.store.owner_of(batch["id"])
        try:
            self.quota.reserve(owner, 0, size)
        except QuotaError as e:
            error = {"code": "storage_quota_exceeded", "message": str(e), "param": e.field, "line": number}
            self.stopped.setdefault(batch["id"], StopBatch("failed", error))
            return
        if self.store.finish_line(batch["id"], number, status, text, usage):
            self._count(endpoint, status, usage)
        else:
            self.quota.release(owner, 0, size)

    def _fail(self, batch_id: str, error: dict | None, batch: dict | None = None) -> None:
        """End a batch as failed: its results (and any output written) dropped, its output files'
        places in the quota freed."""
        batch = batch or self.store.batch(batch_id)
        if error is not None:
            batch["errors"] = {"object": "list", "data": [error]}
        owner, _ = self.store.owner_of(batch_id)
        written = self.writer.discard(batch_id)
        self.quota.release(owner, OUTPUT_FILES, self.store.line_bytes(batch_id) + written)
        self.store.forget_lines(batch_id)
        self.store.set_status(batch, "failed")

    async def _call_gateway(
        self, batch_id: str, key_id: str, line
    ) -> tuple[int, str | None, bool, LineUsage]:
        """One try of a line: (status, JSON body or None when no gateway answered, busy, usage). A call
        unanswered after `line_timeout_s` is cancelled (Serve cancels the request in the gateway)."""
        trace = self._traces.get(batch_id)
        extra = {"trace": trace} if trace is not None else {}
        response = self.gateway().run_batch_line.remote(key_id, line.url, line.body, **extra)
        self._calls[id(response)] = time.monotonic()
        try:
            return await asyncio.wait_for(response, self.config.line_timeout_s)
        except TimeoutError:
            response.cancel()
            logger.warning(
                "batch %s line %d: no answer from the gateway in %g s: tried again",
                batch_id, line.number, self.config.line_timeout_s,
            )  # fmt: skip
        except Exception as e:  # the gateway replica died or is being replaced: not the line's
            logger.warning("batch %s line %d: the gateway failed: %s", batch_id, line.number, e)
        finally:
            del self._calls[id(response)]
        return 503, None, True, NO_USAGE

    def state(self) -> dict:
        """The window and the lines' calls (`raylane status`): lines in flight, the window's size and
        limit, lines sleeping before their next try, the pause before the next line may start and how
        long the oldest call in flight has waited."""
        now_s = time.monotonic()
        w = self.window
        return {
            "in_flight": w.in_flight,
            "window": int(w.size),
            "max_concurrency": w.max,
            "waiting_to_retry": self._retrying,
            "paused_s": round(max(0.0, w.resume_at - now_s), 1),
            "oldest_call_s": round(now_s - min(self._calls.values(), default=now_s), 1),
        }

    def _count(self, endpoint: str, status: int, usage: LineUsage) -> None:
        self.metrics.lines.labels(endpoint=endpoint, result="completed" if status < 400 else "failed").inc()
        self.metrics.tokens.labels(kind="input").inc(usage.input_tokens)
        self.metrics.tokens.labels(kind="output").inc(usage.output_tokens)


def _error_code(status: int, body: str | None) -> str | None:
    """The OpenAI error code of a line's answer, if it is an error."""
    if status < 400 or body is None:
        return None
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return None
    return error.get("code") if isinstance(error, dict) else None


def _stop_for_key(code: str, body: dict) -> StopBatch:
    message = body["error"]["message"] + " The batch was stopped; the lines done before are its output."
    return StopBatch("cancelled", {"code": code, "message": message, "param": None, "line": None})
