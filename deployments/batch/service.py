"""The Batch API's actor: files and batches kept in SQLite (deployments/batch/store.py), and the
runner that sends a batch's lines through the gateway as the lowest tier.

One **detached named Ray actor** per app, as the response store: every gateway replica finds it by
name, and it outlives them. Its records are on disk, so nothing is lost when it dies: Ray restarts
it, the `run` call that drives it is retried (and every gateway replica makes one when it starts),
and each batch not yet ended is taken up where it stood, running only the lines without a result.

Spare capacity: a line goes to the gateway's `run_batch_line`, which serves it like an HTTP request
of the app's lowest tier (`batch`: below every interactive tier, sheddable, holding at most
`batch.max_pool_share` of a pool's slots; the engine schedules it last). How many lines are in
flight, over all batches, is a window that grows by one line per window of lines answered while no
other tier used the pool, and halves as soon as a line finds interactive requests on it or is
turned away (additive increase, multiplicative decrease, as TCP does with a network): batches fill
what is idle and step back at once when interactive traffic comes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any

from raylane.config.batch import BatchConfig
from raylane.deployments.batch.lines import (
    InputLine,
    add_usage,
    dispatch_order,
    error_line,
    output_line,
    read_input,
)
from raylane.deployments.batch.store import BatchStore, is_postgresql, now
from raylane.deployments.detached import detached_actor
from raylane.deployments.metrics.batch import BatchMetrics, batch_reporter
from raylane.deployments.protocol.errors import OpenAIError

logger = logging.getLogger(__name__)
WINDOW_24H = 24 * 3600
RETRY_S = (1.0, 30.0)  # a line turned away for load waits this long (doubling) before its next try


def _error(status: int, message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    """A client's mistake: the gateway answers it as it is."""
    return OpenAIError(message, status=status, param=param, code=code)


class Window:
    """How many lines may be in flight: additive increase while pools are idle, halved when busy;
    and after a line that found other tiers on its pool, no new line for as long as it took (while
    interactive traffic lasts, batches hold a slot at most half the time)."""

    def __init__(self, limit: int) -> None:
        self.max, self.size, self.in_flight = limit, 1.0, 0
        self.resume_at = 0.0  # monotonic time before which no line starts
        self._changed = asyncio.Condition()

    async def acquire(self) -> None:
        while True:
            async with self._changed:
                await self._changed.wait_for(lambda: self.in_flight < int(self.size))
                pause = self.resume_at - time.monotonic()
                if pause <= 0:
                    self.in_flight += 1
                    return
            await asyncio.sleep(pause)

    async def release(self, idle: bool | None, held_s: float = 0.0) -> None:
        """`idle`: the pool served nobody else (grow), was busy or refused (shrink and pause for
        `held_s`, the time the line took), None: unknown."""
        async with self._changed:
            self.in_flight -= 1
            if idle is True:
                self.size = min(self.max, self.size + 1 / int(self.size))
            elif idle is False:
                self.size = max(1.0, self.size / 2)
                self.resume_at = max(self.resume_at, time.monotonic() + held_s)
            self._changed.notify_all()


class BatchService:
    def __init__(self, app_name: str, config: dict[str, Any], max_body_bytes: int) -> None:
        self.app_name, self.max_body_bytes = app_name, max_body_bytes
        self.config = BatchConfig.model_validate(config)
        self.store = BatchStore(*store_location(app_name, self.config), app_name)
        self.tasks: dict[str, asyncio.Task] = {}
        self.metrics = BatchMetrics()
        self._window: Window | None = None
        self._wake: asyncio.Event | None = None
        self._driver: asyncio.Task | None = None
        self._gateway = None
        self._calls: dict[int, float] = {}  # the gateway calls in flight (by id): when each started
        self._retrying = 0  # lines sleeping before their next try

    # -- driving ------------------------------------------------------------------------------------

    async def run(self) -> None:
        """Drive the batches; ends only with the actor. Every gateway replica keeps one call pending,
        so when the actor dies and Ray restarts it, Ray retries those calls and driving resumes."""
        await asyncio.shield(self._drive())

    def _drive(self) -> asyncio.Task:
        """The one task that takes up every batch not yet ended, and each new one as it comes."""
        if self._driver is None:
            self._wake, self._window = asyncio.Event(), Window(self.config.max_concurrency)
            batch_reporter(self.metrics, self.app_name, self.store.count_by_status).start()
            self._driver = asyncio.create_task(self._loop())
        return self._driver

    async def _loop(self) -> None:
        while True:
            try:
                for batch_id, _owner, key_id in self.store.active():
                    if batch_id not in self.tasks:
                        task = asyncio.create_task(self._run_batch(batch_id, key_id))
                        self.tasks[batch_id] = task
                        task.add_done_callback(lambda _, b=batch_id: self.tasks.pop(b, None))
                for file_id, owner in self.store.expired_files(now()):
                    self.store.delete_file(file_id, owner)
            except Exception:  # the database away for a moment: look again at the next wake
                logger.exception("the batch runner could not read its records")
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 60)

    @property
    def gateway(self):
        if self._gateway is None:
            from ray import serve

            self._gateway = serve.get_deployment_handle("Gateway", self.app_name)
        return self._gateway

    # -- files ----------------------------------------------------------------------------------------

    async def create_file(self, owner: str, filename: str, purpose: str, content: bytes) -> dict:
        if self.store.count_files(owner) >= self.config.max_files_per_key:
            limit = self.config.max_files_per_key
            raise _error(429, f"This API key keeps {limit} files already; delete some first.")
        return await self._add_file(owner, filename, purpose, content)

    async def _add_file(self, owner: str, filename: str, purpose: str, content: bytes) -> dict:
        created = now()
        record = {
            "id": f"file-{uuid.uuid4().hex}",
            "purpose": purpose,
            "filename": filename,
            "bytes": len(content),
            "created_at": created,
            "expires_at": created + int(self.config.file_ttl_s),
        }
        await asyncio.to_thread(self.store.add_file, record, owner, content)
        return self.store.file(record["id"], owner)

    def file(self, owner: str, file_id: str) -> dict:
        record = self.store.file(file_id, owner)
        if record is None:
            raise _error(404, f"No file with id {file_id!r}.", "file_id", "not_found")
        return record

    def files(self, owner: str, purpose: str | None, limit: int, after: str | None, order: str) -> list[dict]:
        return self.store.files(owner, purpose, limit, after, order == "desc")

    async def file_content(self, owner: str, file_id: str) -> bytes:
        self.file(owner, file_id)
        return await asyncio.to_thread(self.store.path_of(file_id).read_bytes)

    def delete_file(self, owner: str, file_id: str) -> dict:
        if not self.store.delete_file(file_id, owner):
            raise _error(404, f"No file with id {file_id!r}.", "file_id", "not_found")
        return {"id": file_id, "object": "file", "deleted": True}

    # -- batches --------------------------------------------------------------------------------------

    def create_batch(
        self, owner: str, key_id: str, input_file_id: str, endpoint: str, metadata: dict | None
    ) -> dict:
        source = self.store.file(input_file_id, owner)
        if source is None:
            raise _error(404, f"No file with id {input_file_id!r}.", "input_file_id", "not_found")
        if source["purpose"] != "batch":
            raise _error(400, "The input file's purpose must be 'batch'.", "input_file_id")
        if len(self.store.active(owner)) >= self.config.max_active_batches_per_key:
            limit = self.config.max_active_batches_per_key
            raise _error(429, f"This API key has {limit} batches running already; wait for one to end.")
        created = now()
        batch = {
            "id": f"batch_{uuid.uuid4().hex}",
            "object": "batch",
            "endpoint": endpoint,
            "errors": None,
            "input_file_id": input_file_id,
            "completion_window": "24h",
            "status": "validating",
            "output_file_id": None,
            "error_file_id": None,
            "created_at": created,
            "in_progress_at": None,
            "expires_at": created + WINDOW_24H,
            "finalizing_at": None,
            "completed_at": None,
            "failed_at": None,
            "expired_at": None,
            "cancelling_at": None,
            "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "metadata": metadata,
        }
        self.store.put_batch(batch, owner, key_id)
        self._drive()
        self._wake.set()
        return batch

    def batch(self, owner: str | None, batch_id: str) -> dict:
        batch = self.store.batch(batch_id, owner)
        if batch is None:
            raise _error(404, f"No batch with id {batch_id!r}.", "batch_id", "not_found")
        if batch["status"] in ("in_progress", "cancelling"):
            completed, failed = self.store.line_counts(batch_id)
            batch["request_counts"] |= {"completed": completed, "failed": failed}
        return batch

    def batches(self, owner: str, limit: int, after: str | None) -> list[dict]:
        return [self.batch(owner, b["id"]) for b in self.store.batches(owner, limit, after)]

    def cancel_batch(self, owner: str, batch_id: str) -> dict:
        batch = self.batch(owner, batch_id)
        if batch["status"] not in ("validating", "in_progress"):
            raise _error(409, f"The batch is {batch['status']}: it cannot be cancelled.", "batch_id")
        self._set(batch, "cancelling")
        if batch_id not in self.tasks:
            self._drive()
            self._wake.set()  # not running here yet: the runner takes it up to finish it
        return batch

    def active_batches(self) -> list[dict]:
        """Every batch not yet ended, with its progress (`raylane status`)."""
        return [self.batch(None, batch_id) for batch_id, _, _ in self.store.active()]

    # -- running ----------------------------------------------------------------------------------------

    def _set(self, batch: dict, status: str) -> None:
        batch["status"] = status
        batch[f"{status}_at"] = now()
        self.store.put_batch(batch, *self.store.owner_of(batch["id"]))

    async def _run_batch(self, batch_id: str, key_id: str) -> None:
        try:
            await self._run_lines(batch_id, key_id)
        except Exception:
            logger.exception("batch %s could not be run", batch_id)
            batch = self.store.batch(batch_id)
            error = {
                "code": "internal_error",
                "message": "The batch could not be run.",
                "param": None,
                "line": None,
            }
            batch["errors"] = {"object": "list", "data": [error]}
            self._set(batch, "failed")

    async def _run_lines(self, batch_id: str, key_id: str) -> None:
        batch = self.store.batch(batch_id)
        content = await asyncio.to_thread(self.store.path_of(batch["input_file_id"]).read_bytes)
        read = await asyncio.to_thread(read_input, content, self.config.max_lines, self.max_body_bytes)
        batch = self.store.batch(batch_id)  # cancelled while the file was read: not in progress
        if batch["status"] == "validating":
            if read.errors:
                batch["errors"] = {"object": "list", "data": read.errors}
                self._set(batch, "failed")
                return
            for number, custom_id, code, message in read.rejected:  # to the error file, unsent
                record = error_line(custom_id, code, message)
                if self.store.finish_line(batch_id, number, 400, record):
                    self._count(batch["endpoint"], 400, record)
            batch["request_counts"]["total"] = len(read.lines) + len(read.rejected)
            self._set(batch, "in_progress")
        lines = read.lines
        done = self.store.done_lines(batch_id)
        in_flight: set[asyncio.Task] = set()
        for line in dispatch_order([line for line in lines if line.number not in done]):
            await self._window.acquire()
            if self.store.batch(batch_id)["status"] == "cancelling" or time.time() >= batch["expires_at"]:
                await self._window.release(None)
                break
            task = asyncio.create_task(self._run_line(batch, key_id, line))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
        if in_flight:
            await asyncio.wait(in_flight)
        await self._finish(batch_id, lines)

    async def _run_line(self, batch: dict, key_id: str, line: InputLine) -> None:
        """One line, holding a place in the window (taken by the caller) while it runs, and tried
        again later while it is turned away for load; its result is recorded once."""
        wait_s, held, idle, started = RETRY_S[0], True, None, time.monotonic()
        try:
            for attempt in range(self.config.line_retries + 1):
                started = time.monotonic()
                status, body, busy = await self._call_gateway(batch["id"], key_id, line)
                if status not in (429, 503) or attempt == self.config.line_retries:
                    break
                held = False
                await self._window.release(False)  # step back while it waits
                self._retrying += 1
                try:
                    await asyncio.sleep(wait_s)
                finally:
                    self._retrying -= 1
                wait_s = min(RETRY_S[1], wait_s * 2)
                await self._window.acquire()
                held = True
            if body is None:
                record = error_line(
                    line.custom_id, "service_unavailable", "The gateway could not be reached."
                )
            else:
                record = output_line(line.custom_id, status, json.loads(body))
            if self.store.finish_line(batch["id"], line.number, status, record):
                self._count(line.url, status, record)
            idle = not busy and status not in (429, 503)
        finally:
            if held:
                await self._window.release(idle, time.monotonic() - started)

    async def _call_gateway(
        self, batch_id: str, key_id: str, line: InputLine
    ) -> tuple[int, str | None, bool]:
        """One try of a line: (status, JSON body or None when no gateway answered, busy). A call
        unanswered after `line_timeout_s` is cancelled (Serve cancels the request in the gateway)."""
        response = self.gateway.run_batch_line.remote(key_id, line.url, line.body)
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
        return 503, None, True

    def runner_state(self) -> dict:
        """The window and the lines' calls (`raylane status`): lines in flight, the window's size and
        limit, lines sleeping before their next try, the pause before the next line may start and how
        long the oldest call in flight has waited."""
        if self._window is None:
            return {}
        now_s = time.monotonic()
        w = self._window
        return {
            "in_flight": w.in_flight,
            "window": int(w.size),
            "max_concurrency": w.max,
            "waiting_to_retry": self._retrying,
            "paused_s": round(max(0.0, w.resume_at - now_s), 1),
            "oldest_call_s": round(now_s - min(self._calls.values(), default=now_s), 1),
        }

    def _count(self, endpoint: str, status: int, record: dict) -> None:
        self.metrics.lines.labels(endpoint=endpoint, result="completed" if status < 400 else "failed").inc()
        usage = {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0}
        if record["response"] is not None:
            add_usage(usage, record["response"]["body"])
        for kind in ("input", "output"):
            self.metrics.tokens.labels(kind=kind).inc(usage[f"{kind}_tokens"])

    async def _finish(self, batch_id: str, lines: list[InputLine]) -> None:
        """Write the output and error files and end the batch: completed, cancelled or expired."""
        batch = self.store.batch(batch_id)
        if batch["status"] == "cancelling":
            ending = "cancelled"
        elif time.time() >= batch["expires_at"]:
            ending = "expired"
        else:
            ending = "completed"
            self._set(batch, "finalizing")
        output, failed, done = [], [], set()
        usage = {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0}
        for number, status_code, text in self.store.results(batch_id):
            done.add(number)
            (output if status_code < 400 else failed).append(text)
            response = json.loads(text)["response"]
            if response is not None:
                add_usage(usage, response["body"])
        if ending == "expired":
            message = "The request was not run within the batch's completion window."
            for line in lines:
                if line.number not in done:
                    failed.append(json.dumps(error_line(line.custom_id, "batch_expired", message)))
        owner, _ = self.store.owner_of(batch_id)
        for field, kind, records in (
            ("output_file_id", "output", output),
            ("error_file_id", "errors", failed),
        ):
            if records:
                content = ("\n".join(records) + "\n").encode()
                name = f"{batch_id}_{kind}.jsonl"
                batch[field] = (await self._add_file(owner, name, "batch_output", content))["id"]
        total = batch["request_counts"]["total"]
        batch["request_counts"] = {"total": total, "completed": len(output), "failed": len(failed)}
        details = {
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0},
        }
        batch["usage"] = usage | details
        self._set(batch, ending)
        self.store.forget_lines(batch_id)  # the output files hold them now


def store_location(app_name: str, config: BatchConfig) -> tuple[str, Path]:
    """The database (a SQLite path or a PostgreSQL URL) and the files' directory of an app's batches."""
    cache = Path(os.environ.get("RAYLANE_CACHE_DIR", "~/.cache/raylane")).expanduser() / "batch"
    store = config.store or str(cache / f"{app_name}.sqlite3")
    files = Path(config.files_dir).expanduser() if config.files_dir else cache / f"{app_name}-files"
    return store, files


def may_hold_batches(app_name: str, config: BatchConfig) -> bool:
    """Whether an earlier run may have left batches to take up: a SQLite file that exists (checked
    on this node), or any PostgreSQL database."""
    store, _ = store_location(app_name, config)
    return is_postgresql(store) or Path(store).expanduser().exists()


def service_name(app_name: str) -> str:
    return f"raylane-batch-{app_name}"


def batch_service(app_name: str, config: BatchConfig, max_body_bytes: int):
    """The app's batch actor handle, created by the first gateway replica that asks. Its pending
    calls are retried when Ray restarts it (`run` among them: see `BatchService.run`)."""
    args = (app_name, config.model_dump(), max_body_bytes)
    return detached_actor(BatchService, service_name(app_name), *args, max_task_retries=-1)
