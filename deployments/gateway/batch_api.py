"""The gateway's side of the Batch API (`/v1/files`, `/v1/batches`): reading an upload, and calls to
the app's batch actor (deployments/batch/service.py), which keeps the records and runs the lines.

An upload is read within `batch.max_file_bytes` (413 past it, on its Content-Length before a byte
is read) and its multipart form parsed in a thread: this replica's event loop serves others while a
64 MiB file is split. Records belong to the API key that made them (its key id; every caller shares
one owner in open mode); another key's id is a 404, as if it did not exist.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import Request

from raylane.config import ClusterConfig
from raylane.deployments.gateway.request_body import parse_bytes, read_body
from raylane.deployments.protocol.batch_schemas import BatchCreateRequest
from raylane.deployments.protocol.errors import OpenAIError, client_error, invalid, unavailable
from raylane.router import Principal

logger = logging.getLogger(__name__)
FORM_OVERHEAD = 64 * 1024  # bytes of a multipart body beyond the file (boundaries, headers, fields)


def owner(principal: Principal) -> str:
    return "" if principal.key_id.startswith("anonymous") else principal.key_id


class BatchApi:
    def __init__(self, app_name: str, config: ClusterConfig) -> None:
        self.app_name, self.config = app_name, config
        self._service = None
        self._driving = None

    @property
    def service(self):
        """The app's batch actor, created by the first replica that asks, and driven from here on."""
        if self._service is None:
            from raylane.deployments.batch.service import batch_service

            handle = batch_service(
                self.app_name, self.config.batch, self.config.gateway.max_request_body_bytes
            )
            self._driving = handle.run.remote()  # pending for the actor's life (kept: Ray retries it)
            self._service = handle
        return self._service

    def start(self) -> None:
        self.service  # noqa: B018  (creating the handle starts the actor driving)

    async def call(self, method: str, *args: Any) -> Any:
        try:
            return await getattr(self.service, method).remote(*args)
        except Exception as e:
            if (error := client_error(e)) is not None:
                raise error from None
            logger.warning("the batch actor failed a %s call: %s", method, e)
            raise unavailable(f"The batch service could not answer: {type(e).__name__}.") from None

    async def upload(self, request: Request, principal: Principal) -> dict:
        limit = self.config.batch.max_file_bytes
        body = await read_body(request, limit + FORM_OVERHEAD)
        fields, file = await asyncio.to_thread(parse_form, body, request.headers.get("content-type", ""))
        purpose = fields.get("purpose")
        if purpose != "batch":
            raise invalid("purpose", f"purpose must be 'batch', got {purpose!r}.")
        if file is None:
            raise invalid("file", "The form holds no file.")
        filename, content = file
        if len(content) > limit:
            raise OpenAIError(f"The file is larger than {limit} bytes.", status=413, param="file")
        return await self.call("create_file", owner(principal), filename, purpose, content)

    async def create_batch(self, body: bytes, principal: Principal) -> dict:
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


def parse_form(body: bytes, content_type: str) -> tuple[dict[str, str], tuple[str, bytes] | None]:
    """The text fields of a multipart form, and its one file (filename, bytes); 400 when it is not a
    multipart form (python-multipart's parser: linear in the body)."""
    from python_multipart.multipart import MultipartParser, parse_options_header

    kind, options = parse_options_header(content_type)
    boundary = options.get(b"boundary")
    if kind != b"multipart/form-data" or not boundary:
        raise invalid("file", "Upload the file as multipart/form-data (fields `file` and `purpose`).")
    parts: list[tuple[dict[bytes, bytes], bytearray]] = []
    header = [b"", b""]

    def on_part_begin() -> None:
        parts.append(({}, bytearray()))

    def on_header_field(data: bytes, start: int, end: int) -> None:
        header[0] += data[start:end]

    def on_header_value(data: bytes, start: int, end: int) -> None:
        header[1] += data[start:end]

    def on_header_end() -> None:
        parts[-1][0][header[0].lower()] = header[1]
        header[0] = header[1] = b""

    def on_part_data(data: bytes, start: int, end: int) -> None:
        parts[-1][1].extend(data[start:end])

    callbacks = {
        "on_part_begin": on_part_begin,
        "on_header_field": on_header_field,
        "on_header_value": on_header_value,
        "on_header_end": on_header_end,
        "on_part_data": on_part_data,
    }
    try:
        parser = MultipartParser(boundary, callbacks)
        parser.write(body)
        parser.finalize()
    except Exception as e:  # python-multipart's errors for a malformed body
        raise invalid("file", f"The multipart form could not be read: {e}.") from None
    fields: dict[str, str] = {}
    file = None
    for headers, data in parts:
        _, disposition = parse_options_header(headers.get(b"content-disposition", b""))
        name = disposition.get(b"name", b"").decode(errors="replace")
        if b"filename" in disposition:
            if file is not None:
                raise invalid("file", "Upload one file at a time.")
            file = (disposition[b"filename"].decode(errors="replace")[:256], bytes(data))
        elif len(data) <= 1024:
            fields[name] = data.decode(errors="replace")
    return fields, file
