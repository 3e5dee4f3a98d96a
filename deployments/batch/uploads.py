"""Uploads to `/v1/files` in progress, in the batch actor: the file's bytes arrive in chunks, as the
gateway reads them from the client, and go straight to disk. Neither the gateway nor the actor ever
holds a whole file.

`begin` comes before the gateway reads a byte of the body: it takes one of the key's
`batch.max_concurrent_uploads_per_key` places (a 429 with Retry-After past it) and reserves the
file and its declared size in the key's quota (deployments/batch/quota.py), both in one
synchronous step of the actor's event loop, so no two uploads can pass the same last place; it
also takes the declared size from the key's upload budget (`UploadBudget`). An upload that sends
nothing for `IDLE_S` (its gateway replica died) is dropped, with its place and its reservation.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from raylane.deployments.batch.quota import QuotaError, StorageQuota
from raylane.deployments.batch.store import BatchStore, now
from raylane.deployments.protocol.batch_answers import UPLOAD_RATE_EXCEEDED
from raylane.deployments.protocol.errors import OpenAIError

IDLE_S = 120.0  # an upload with no chunk for this long is dropped
RETRY_AFTER_S = 5.0  # told to an upload turned away for the key's uploads in progress


@dataclass(slots=True)
class Upload:
    owner: str
    key_id: str
    path: Path  # where its bytes go until it is a file
    reserved: int  # bytes counted against the owner's quota
    written: int = 0
    touched: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # its chunks are written in order


class UploadBudget:
    """Bytes each key may upload a minute (`batch.max_upload_bytes_per_minute_per_key`), as a bucket
    that refills continuously: an upload takes its declared size (the largest file when it declares
    none) before its body is read, and gets back what it did not send. Serve's proxy reads a body as
    fast as the client sends it, whatever the gateway does with it, so what bounds the CPU one key's
    uploads take from everyone (~11 ms of the proxy's and the gateway's per MiB on 2 cores) is how
    many bytes it may start sending."""

    def __init__(self, per_minute: int) -> None:
        self.per_minute = per_minute
        self._level: dict[str, tuple[float, float]] = {}  # key -> (bytes left, when)

    def take(self, key_id: str, size: int) -> None:
        left = self._left(key_id)
        if size > left:
            wait = (min(size, self.per_minute) - left) * 60 / self.per_minute
            raise OpenAIError(
                f"This API key may upload {self.per_minute} bytes a minute "
                f"(batch.max_upload_bytes_per_minute_per_key); this upload declares {size}: retry in "
                f"{wait:.0f} s.",
                status=429,
                code=UPLOAD_RATE_EXCEEDED,
                retry_after=max(1.0, wait),
            )
        self._level[key_id] = (left - size, time.monotonic())

    def give_back(self, key_id: str, size: int) -> None:
        self._level[key_id] = (self._left(key_id) + size, time.monotonic())

    def _left(self, key_id: str) -> float:
        left, when = self._level.get(key_id, (self.per_minute, 0.0))
        return min(self.per_minute, left + (time.monotonic() - when) * self.per_minute / 60)


def quota_error(e: QuotaError) -> OpenAIError:
    return OpenAIError(str(e), status=429, param=e.field, code="storage_quota_exceeded")


class Uploads:
    def __init__(
        self,
        store: BatchStore,
        quota: StorageQuota,
        max_per_key: int,
        max_bytes: int,
        budget: UploadBudget,
        max_uploads: int,
    ) -> None:
        self.store, self.quota, self.max_per_key, self.max_bytes = store, quota, max_per_key, max_bytes
        self.budget, self.max_uploads = budget, max_uploads
        self._uploads: dict[str, Upload] = {}

    def begin(self, owner: str, key_id: str, declared: int | None) -> str:
        """An upload's id, its place and `declared` bytes (unknown: the largest file) reserved."""
        self.drop_idle()
        if len(self._uploads) >= self.max_uploads:
            raise OpenAIError(
                f"{self.max_uploads} uploads are in progress on this cluster (batch.max_concurrent_uploads): "
                "retry when one has finished.",
                status=429,
                code="too_many_uploads",
                retry_after=RETRY_AFTER_S,
            )
        if sum(1 for u in self._uploads.values() if u.key_id == key_id) >= self.max_per_key:
            raise OpenAIError(
                f"This API key has {self.max_per_key} uploads in progress already "
                "(batch.max_concurrent_uploads_per_key): retry when one has finished.",
                status=429,
                code="too_many_uploads",
                retry_after=RETRY_AFTER_S,
            )
        reserved = min(declared, self.max_bytes) if declared is not None else self.max_bytes
        self.budget.take(key_id, reserved)
        try:
            self.quota.reserve(owner, 1, reserved)
        except QuotaError as e:
            self.budget.give_back(key_id, reserved)
            raise quota_error(e) from None
        upload_id = uuid.uuid4().hex
        path = self.store.files_dir / f"{upload_prefix(self.store.app)}{upload_id}"
        self._uploads[upload_id] = Upload(owner, key_id, path, reserved)
        return upload_id

    async def write(self, upload_id: str, chunk: bytes) -> None:
        upload = self._get(upload_id)
        async with upload.lock:
            if upload.written + len(chunk) > self.max_bytes:
                self.abort(upload_id)
                raise OpenAIError(
                    f"The file is larger than {self.max_bytes} bytes (batch.max_file_bytes).",
                    status=413,
                    param="file",
                    code="file_too_large",
                )
            if upload.written + len(chunk) > upload.reserved:  # sent more than it said: count it now
                try:
                    self.quota.reserve(upload.owner, 0, upload.written + len(chunk) - upload.reserved)
                except QuotaError as e:
                    self.abort(upload_id)
                    raise quota_error(e) from None
                upload.reserved = upload.written + len(chunk)
            await asyncio.to_thread(_append, upload.path, chunk)
            upload.written += len(chunk)
            upload.touched = time.monotonic()

    async def finish(self, upload_id: str, filename: str, purpose: str, ttl_s: float) -> dict:
        """The upload made a file: its record."""
        upload = self._get(upload_id)
        async with upload.lock:
            del self._uploads[upload_id]
            self.quota.release(upload.owner, 0, upload.reserved - upload.written)
            self.budget.give_back(upload.key_id, upload.reserved - upload.written)
            created = now()
            record = {
                "id": f"file-{uuid.uuid4().hex}",
                "purpose": purpose,
                "filename": filename,
                "bytes": upload.written,
                "created_at": created,
                "expires_at": created + int(ttl_s),
            }
            try:
                await asyncio.to_thread(self._keep, upload, record)
            except Exception:
                self.quota.release(upload.owner, 1, upload.written)
                upload.path.unlink(missing_ok=True)
                raise
        return self.store.file(record["id"], upload.owner)

    def _keep(self, upload: Upload, record: dict) -> None:
        upload.path.touch()  # an empty file sent no chunk
        upload.path.replace(self.store.path_of(record["id"]))
        self.store.add_file(record, upload.owner)

    def abort(self, upload_id: str) -> None:
        """The upload failed (a bad form, the client gone): its place, bytes and reservation go."""
        upload = self._uploads.pop(upload_id, None)
        if upload is not None:
            self.quota.release(upload.owner, 1, upload.reserved)
            self.budget.give_back(upload.key_id, upload.reserved - upload.written)
            upload.path.unlink(missing_ok=True)

    def drop_idle(self) -> None:
        cutoff = time.monotonic() - IDLE_S
        for upload_id in [i for i, u in self._uploads.items() if u.touched < cutoff and not u.lock.locked()]:
            self.abort(upload_id)

    def _get(self, upload_id: str) -> Upload:
        upload = self._uploads.get(upload_id)
        if upload is None:
            raise OpenAIError(
                "The upload was dropped (nothing arrived for too long): send the file again.",
                status=408,
                param="file",
                code="upload_expired",
            )
        return upload


def upload_prefix(app: str) -> str:
    """How an app's uploads under way are named in the files' directory (apps may share it)."""
    return f".upload-{app}-"


def _append(path: Path, chunk: bytes) -> None:
    with path.open("ab") as f:
        f.write(chunk)
