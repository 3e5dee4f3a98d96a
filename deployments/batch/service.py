"""The Batch API's actor: files and batches kept in the store (deployments/batch/store.py), uploads
received in chunks (uploads.py), each key's files and bytes counted (quota.py), and the runner that
sends a batch's lines through the gateway as the lowest tier (runner.py) and writes its output
(output.py).

One **detached named Ray actor** per app, as the response store: every gateway replica finds it by
name, and it outlives them. Its records are on disk, so nothing is lost when it dies: Ray restarts
it, the `run` call that drives it is retried (and every gateway replica makes one when it starts),
and each batch not yet ended is taken up where it stood, running only the lines without a result
(and writing only the output pages not yet written).

Spare capacity: a line goes to the gateway's `run_batch_line`, which serves it like an HTTP request
of the app's lowest tier (`batch`: below every interactive tier, sheddable, holding at most
`batch.max_pool_share` of a pool's sequences; the engine schedules it last and preempts it for any
interactive request).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import uuid
from pathlib import Path
from typing import Any

from raylane import heap, tracing
from raylane.config.batch import BatchConfig
from raylane.deployments.batch.lines import LineCaps
from raylane.deployments.batch.quota import OUTPUT_FILES, QuotaError, StorageQuota
from raylane.deployments.batch.runner import BatchRunner
from raylane.deployments.batch.store import BatchStore, is_postgresql, now
from raylane.deployments.batch.uploads import UploadBudget, Uploads, quota_error, upload_prefix
from raylane.deployments.detached import detached_actor
from raylane.deployments.metrics.batch import BatchMetrics, batch_reporter
from raylane.deployments.protocol.errors import OpenAIError

logger = logging.getLogger(__name__)
WINDOW_24H = 24 * 3600
MAX_PAGE_BYTES = 4 * 2**20  # of a file's content handed out in one call


def _error(status: int, message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    """A client's mistake: the gateway answers it as it is."""
    return OpenAIError(message, status=status, param=param, code=code)


def _not_found(file_id: str, param: str = "file_id") -> OpenAIError:
    return _error(404, f"No file with id {file_id!r}.", param, "not_found")


class BatchService:
    def __init__(
        self, app_name: str, config: dict[str, Any], max_body_bytes: int, tracing_settings: dict | None = None
    ) -> None:
        self.app_name, self.max_body_bytes = app_name, max_body_bytes
        tracing.configure(tracing_settings, f"batch:{app_name}")
        self.config = BatchConfig.model_validate(config)
        self.store = BatchStore(*store_location(app_name, self.config), app_name)
        for left in self.store.files_dir.glob(f"{upload_prefix(app_name)}*"):  # an earlier actor's uploads
            left.unlink(missing_ok=True)
        self.quota = StorageQuota(self.store, self.config.max_files_per_key, self.config.max_bytes_per_key)
        max_file = self.config.max_file_bytes
        self.uploads = Uploads(
            self.store,
            self.quota,
            self.config.max_concurrent_uploads_per_key,
            max_file,
            UploadBudget(self.config.max_upload_bytes_per_minute_per_key),
            self.config.max_concurrent_uploads,
        )
        self.tasks: dict[str, asyncio.Task] = {}
        self.metrics = BatchMetrics()
        caps = LineCaps(max_body_bytes, self.config.max_line_n, self.config.max_line_tokens)
        self._runner: BatchRunner | None = None
        self._caps = caps
        self._wake: asyncio.Event | None = None
        self._driver: asyncio.Task | None = None
        self._gateway = None

    # -- driving ------------------------------------------------------------------------------------

    async def run(self) -> None:
        """Drive the batches; ends only with the actor. Every gateway replica keeps one call pending,
        so when the actor dies and Ray restarts it, Ray retries those calls and driving resumes."""
        await asyncio.shield(self._drive())

    async def answer(self, method: str, *args: Any) -> Any:
        """`method(*args)` for a gateway, a client's error (a 4xx) returned, not raised: Ray formats
        the traceback of every exception an actor method raises (Python 3.11 parses each frame's
        source for its carets), and refused uploads and batches come as fast as a key sends them."""
        try:
            result = getattr(self, method)(*args)
            return await result if inspect.isawaitable(result) else result
        except OpenAIError as e:
            if e.is_client_error:
                return e
            raise

    @property
    def runner(self) -> BatchRunner:
        if self._runner is None:  # made on the actor's event loop (its window's condition)
            args = (self.store, self.quota, self.config, self._caps, lambda: self.gateway, self.metrics)
            self._runner = BatchRunner(*args)
        return self._runner

    def _drive(self) -> asyncio.Task:
        """The one task that takes up every batch not yet ended, and each new one as it comes."""
        if self._driver is None:
            self._wake = asyncio.Event()
            batch_reporter(self.metrics, self.app_name, self.store.count_by_status).start()
            self._driver = asyncio.create_task(self._loop())
        return self._driver

    async def _loop(self) -> None:
        while True:
            try:
                for batch_id, _owner, key_id in self.store.active():
                    if batch_id not in self.tasks:
                        task = asyncio.create_task(self.runner.run(batch_id, key_id))
                        self.tasks[batch_id] = task
                        task.add_done_callback(lambda _, b=batch_id: self.tasks.pop(b, None))
                self._delete_expired_files()
                self.uploads.drop_idle()
            except Exception:  # the database away for a moment: look again at the next wake
                logger.exception("the batch runner could not read its records")
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 60)

    def _delete_expired_files(self) -> None:
        inputs = self._inputs_in_use()
        for file_id, owner in self.store.expired_files(now()):
            if file_id not in inputs:  # kept until the batch reading it ends
                self._delete(owner, file_id)

    @property
    def gateway(self):
        if self._gateway is None:
            from ray import serve

            self._gateway = serve.get_deployment_handle("Gateway", self.app_name)
        return self._gateway

    # -- files ----------------------------------------------------------------------------------------

    def begin_upload(self, owner: str, key_id: str, declared_bytes: int | None) -> str:
        """Before the gateway reads an upload's body: a place among the key's uploads and its file
        and bytes reserved in its quota (429 when either is full), in one step."""
        return self.uploads.begin(owner, key_id, declared_bytes)

    async def upload_chunk(self, upload_id: str, chunk: bytes) -> None:
        await self.uploads.write(upload_id, chunk)

    async def finish_upload(self, upload_id: str, filename: str, purpose: str) -> dict:
        try:
            return await self.uploads.finish(upload_id, filename, purpose, self.config.file_ttl_s)
        finally:
            heap.trim_soon()  # the file's chunks passed through here (raylane/heap.py)

    async def abort_upload(self, upload_id: str) -> None:
        self.uploads.abort(upload_id)
        heap.trim_soon()

    def file(self, owner: str, file_id: str) -> dict:
        record = self.store.file(file_id, owner)
        if record is None:
            raise _not_found(file_id)
        return record

    def files(self, owner: str, purpose: str | None, limit: int, after: str | None, order: str) -> list[dict]:
        return self.store.files(owner, purpose, limit, after, order == "desc")

    async def file_page(self, owner: str, file_id: str, offset: int, size: int) -> bytes:
        """Up to `size` bytes (at most `MAX_PAGE_BYTES`) of a file's content from `offset`: the
        gateway streams a file in such pages, and neither side holds more of it."""
        self.file(owner, file_id)
        return await asyncio.to_thread(self.store.read_page, file_id, offset, min(size, MAX_PAGE_BYTES))

    def delete_file(self, owner: str, file_id: str) -> dict:
        if file_id in self._inputs_in_use(owner):
            raise _error(409, "A batch not yet ended reads this file: cancel it first.", "file_id")
        if not self._delete(owner, file_id):
            raise _not_found(file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    def _delete(self, owner: str, file_id: str) -> bool:
        record = self.store.file(file_id, owner)
        self.quota.usage(owner)  # counted before the store changes (a first count reads the store)
        if record is None or not self.store.delete_file(file_id, owner):
            return False
        self.quota.release(owner, 1, record["bytes"])
        return True

    def _inputs_in_use(self, owner: str | None = None) -> set[str]:
        """The input files of the batches not yet ended (of `owner`)."""
        return {self.store.batch(batch_id)["input_file_id"] for batch_id, _, _ in self.store.active(owner)}

    # -- batches --------------------------------------------------------------------------------------

    def create_batch(
        self, owner: str, key_id: str, input_file_id: str, endpoint: str, metadata: dict | None
    ) -> dict:
        source = self.store.file(input_file_id, owner)
        if source is None:
            raise _not_found(input_file_id, "input_file_id")
        if source["purpose"] != "batch":
            raise _error(400, "The input file's purpose must be 'batch'.", "input_file_id")
        self._check_active(owner)
        try:  # its output and error files: a batch that could not keep them is refused now
            self.quota.reserve(owner, OUTPUT_FILES, 0)
        except QuotaError as e:
            raise quota_error(e) from None
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

    def _check_active(self, owner: str) -> None:
        if len(self.store.active(owner)) >= self.config.max_active_batches_per_key:
            limit = self.config.max_active_batches_per_key
            raise _error(
                429,
                f"This API key has {limit} batches running already (batch.max_active_batches_per_key); "
                "wait for one to end.",
                code="too_many_batches",
            )
        if len(self.store.active()) >= self.config.max_active_batches:
            limit = self.config.max_active_batches
            raise OpenAIError(
                f"The cluster runs {limit} batches already (batch.max_active_batches); retry later.",
                status=429,
                code="too_many_batches",
                retry_after=60.0,
            )

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
        self.store.set_status(batch, "cancelling")
        if batch_id not in self.tasks:
            self._drive()
            self._wake.set()  # not running here yet: the runner takes it up to finish it
        return batch

    def active_batches(self) -> list[dict]:
        """Every batch not yet ended, with its progress (`raylane status`)."""
        return [self.batch(None, batch_id) for batch_id, _, _ in self.store.active()]

    def runner_state(self) -> dict:
        """The runner's window and calls (`raylane status`); nothing before it first ran."""
        return self._runner.state() if self._runner is not None else {}


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


def batch_service(
    app_name: str, config: BatchConfig, max_body_bytes: int, tracing_settings: dict | None = None
):
    """The app's batch actor handle, created by the first gateway replica that asks. Its pending
    calls are retried when Ray restarts it (`run` among them: see `BatchService.run`).
    `tracing_settings`: the cluster's `observability.tracing` (a batch's span is its lines' parent)."""
    args = (app_name, config.model_dump(), max_body_bytes, tracing_settings)
    return detached_actor(BatchService, service_name(app_name), *args, max_task_retries=-1)
