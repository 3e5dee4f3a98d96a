"""The gateway's side of the Batch API (`/v1/files`, `/v1/batches`): uploads and downloads streamed
to and from the app's batch actor (deployments/batch/service.py), which keeps the records and runs
the lines, and calls to it.

An upload is bounded before a byte of it is read: the key's tier must allow batches (403), its
Content-Length within `batch.max_file_bytes` (413), and the actor has given it one of the key's
`batch.max_concurrent_uploads_per_key` places and reserved its file and bytes in the key's quota
(429 when either is full: nothing between that check and the file's record can let another upload
pass it). The body is then parsed as it arrives (deployments/gateway/upload_form.py) and the file's
bytes go to the actor in 1 MiB chunks, which it appends to disk: neither side holds the file whole.
A file's content is streamed back the same way, in pages. Records belong to the API key that made
them (its key id; every caller shares one owner in open mode); another key's id is a 404, as if it
did not exist.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from starlette.responses import StreamingResponse

from raylane import heap
from raylane.config import ClusterConfig
from raylane.deployments.gateway.request_body import body_too_large, parse_bytes
from raylane.deployments.gateway.responses_api import owner as response_owner
from raylane.deployments.gateway.upload_form import FILE_CHUNK, FormReader, boundary_of
from raylane.deployments.protocol.batch_answers import UPLOAD_RATE_EXCEEDED
from raylane.deployments.protocol.batch_schemas import BatchCreateRequest
from raylane.deployments.protocol.errors import OpenAIError, client_error, invalid, unavailable
from raylane.router import Principal

logger = logging.getLogger(__name__)
FORM_OVERHEAD = 64 * 1024  # bytes of a multipart body beyond the file (boundaries, headers, fields)
CONTENT_PAGE = 2**20  # bytes of a file's content asked of the actor at once
KEEPALIVE_S = 30.0  # a slow upload's bytes go to the actor at least this often (it drops silent ones)


def owner(principal: Principal) -> str:
    """Whose records a caller sees: as for stored responses, its API key; everyone's in open mode."""
    return response_owner(principal) or ""


def check_batches_allowed(principal: Principal) -> None:
    """403 for a key whose tier has not opted in to batches (`tiers[].batches`)."""
    if not principal.tier.batches:
        raise OpenAIError(
            f"This API key's tier '{principal.tier.name}' may not upload files or run batches "
            "(tiers[].batches).",
            status=403,
            code="batches_not_allowed",
        )


class RefusedUploads:
    """Keys the batch actor turned an upload away for being over their upload budget, until the
    Retry-After it gave (a budget refills with time only, so nothing frees it sooner): their next
    uploads are refused here, without the actor's round trip, while Serve's proxy goes on reading the
    body (each refusal cost the proxy and the gateway ~50 ms of CPU under a flood of 64 MiB uploads).
    A refusal for uploads in progress is not remembered: one finishing frees its place at once. At
    most MAX_KEYS are remembered."""

    MAX_KEYS = 10_000

    def __init__(self) -> None:
        self._until: OrderedDict[str, tuple[float, OpenAIError]] = OrderedDict()

    def check(self, key_id: str) -> None:
        refused = self._until.get(key_id)
        if refused is None:
            return
        until, error = refused
        left = until - time.monotonic()
        if left <= 0:
            del self._until[key_id]
            return
        raise OpenAIError(error.message, status=429, param=error.param, code=error.code, retry_after=left)

    def remember(self, key_id: str, error: OpenAIError) -> None:
        if error.code == UPLOAD_RATE_EXCEEDED and error.retry_after:
            self._until[key_id] = (time.monotonic() + error.retry_after, error)
            self._until.move_to_end(key_id)
            while len(self._until) > self.MAX_KEYS:
                self._until.popitem(last=False)


class BatchApi:
    def __init__(self, app_name: str, config: ClusterConfig) -> None:
        self.app_name, self.config = app_name, config
        self._service = None
        self._driving = None
        self.refused_uploads = RefusedUploads()

    @property
    def service(self):
        """The app's batch actor, created by the first replica that asks, and driven from here on."""
        if self._service is None:
            from raylane.deployments.batch.service import batch_service

            handle = batch_service(
                self.app_name,
                self.config.batch,
                self.config.gateway.max_request_body_bytes,
                self.config.observability.tracing.model_dump(),
            )
            self._driving = handle.run.remote()  # pending for the actor's life (kept: Ray retries it)
            self._service = handle
        return self._service

    def start(self) -> None:
        self.service  # noqa: B018  (creating the handle starts the actor driving)

    async def call(self, method: str, *args: Any) -> Any:
        try:
            result = await self.service.answer.remote(method, *args)
        except Exception as e:
            if (error := client_error(e)) is not None:
                raise error from None
            logger.warning("the batch actor failed a %s call: %s", method, e)
            raise unavailable(f"The batch service could not answer: {type(e).__name__}.") from None
        if isinstance(result, OpenAIError):  # the client's error, returned as a value (BatchService.answer)
            raise result
        return result

    async def upload(self, request: Request, principal: Principal) -> dict:
        try:
            return await self._upload(request, principal)
        finally:  # refused or not, Serve buffered some of the body here (raylane/heap.py)
            heap.trim_soon()

    async def _upload(self, request: Request, principal: Principal) -> dict:
        check_batches_allowed(principal)
        limit = self.config.batch.max_file_bytes
        reader = FormReader(boundary_of(request.headers.get("content-type", "")))
        declared = request.headers.get("content-length", "")
        size = int(declared) if declared.isdigit() else None
        if size is not None and size > limit + FORM_OVERHEAD:
            raise body_too_large(limit + FORM_OVERHEAD, size)
        self.refused_uploads.check(principal.key_id)
        try:
            upload_id = await self.call("begin_upload", owner(principal), principal.key_id, size)
        except OpenAIError as e:
            self.refused_uploads.remember(principal.key_id, e)
            raise
        try:
            await self._stream_file(request, reader, upload_id, limit + FORM_OVERHEAD)
            purpose = reader.fields.get("purpose")
            if purpose != "batch":
                raise invalid("purpose", f"purpose must be 'batch', got {purpose!r}.")
            if reader.filename is None:
                raise invalid("file", "The form holds no file.")
            return await self.call("finish_upload", upload_id, reader.filename, purpose)
        except BaseException:
            self.service.abort_upload.remote(upload_id)  # its place and reservation go at once
            raise

    async def _stream_file(self, request: Request, reader: FormReader, upload_id: str, limit: int) -> None:
        """Read the body, handing the file's bytes to the actor as they come (one chunk in memory;
        a slow client's bytes at least every `KEEPALIVE_S`, so the actor never takes a live upload
        for an abandoned one)."""
        read, sent_at = 0, time.monotonic()
        async for chunk in request.stream():
            read += len(chunk)
            if read > limit:  # chunked (or lying about its length): stop reading here
                raise body_too_large(limit)
            reader.write(chunk)
            due = time.monotonic() - sent_at > KEEPALIVE_S
            if (data := reader.take(at_least=1 if due else FILE_CHUNK)) is not None:
                await self.call("upload_chunk", upload_id, data)
                sent_at = time.monotonic()
        reader.finalize()
        if (data := reader.take(at_least=1)) is not None:
            await self.call("upload_chunk", upload_id, data)

    async def content(self, principal: Principal, file_id: str) -> StreamingResponse:
        """A file's content, streamed in pages read from the actor as the client takes them."""
        record = await self.call("file", owner(principal), file_id)  # a 404 before anything is sent

        async def pages() -> AsyncIterator[bytes]:
            offset = 0
            while offset < record["bytes"]:
                page = await self.call("file_page", owner(principal), file_id, offset, CONTENT_PAGE)
                if not page:
                    return
                offset += len(page)
                yield page

        headers = {"content-length": str(record["bytes"])}
        return StreamingResponse(pages(), media_type="application/octet-stream", headers=headers)

    async def create_batch(self, body: bytes, principal: Principal) -> dict:
        check_batches_allowed(principal)
        req = await parse_bytes(body, BatchCreateRequest)
        args = (owner(principal), principal.key_id, req.input_file_id, req.endpoint, req.metadata)
        return await self.call("create_batch", *args)


def page(data: list[dict], limit: int) -> dict:
    """OpenAI's list object, from `limit + 1` items read (the extra one says there are more)."""
    items = data[:limit]
    return {
        "object": "list",
        "data": items,
        "first_id": items[0]["id"] if items else None,
        "last_id": items[-1]["id"] if items else None,
        "has_more": len(data) > limit,
    }


def list_limit(request: Request, default: int, most: int) -> int:
    raw = request.query_params.get("limit")
    if raw is None:
        return default
    if not raw.isdigit() or not 1 <= int(raw) <= most:
        raise invalid("limit", f"limit must be an integer from 1 to {most}.")
    return int(raw)
