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
from raylane.deployments.gateway.responses_api import owner as response_owner
from raylane.deployments.protocol.batch_schemas import BatchCreateRequest
from raylane.deployments.protocol.errors import OpenAIError, client_error, invalid, unavailable
from raylane.router import Principal

logger = logging.getLogger(__name__)
FORM_OVERHEAD = 64 * 1024  # bytes of a multipart body beyond the file (boundaries, headers, fields)


def owner(principal: Principal) -> str:
    """Whose records a caller sees: as for stored responses, its API key; everyone's in open mode."""
    return response_owner(principal) or ""


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
    """The text fields of a multipart form, and its one file (filename, bytes), by python-multipart's
    parser (linear in the body, which is whole in memory already); 400 when it is not one."""
    from python_multipart import create_form_parser
    from python_multipart.multipart import parse_options_header

    kind, options = parse_options_header(content_type)
    if kind != b"multipart/form-data" or not options.get(b"boundary"):
        raise invalid("file", "Upload the file as multipart/form-data (fields `file` and `purpose`).")
    fields: dict[str, str] = {}
    files: list = []

    def on_field(field) -> None:
        fields[field.field_name.decode(errors="replace")] = (field.value or b"")[:1024].decode(
            errors="replace"
        )

    headers = {"Content-Type": content_type.encode()}
    config = {"MAX_MEMORY_FILE_SIZE": len(body) + 1}  # kept in memory: never spooled to disk
    try:
        parser = create_form_parser(headers, on_field, files.append, config=config)
        parser.write(body)
        parser.finalize()
    except Exception as e:  # python-multipart's errors for a malformed body
        raise invalid("file", f"The multipart form could not be read: {e}.") from None
    if len(files) > 1:
        raise invalid("file", "Upload one file at a time.")
    if not files:
        return fields, None
    name = (files[0].file_name or b"").decode(errors="replace")[:256]
    return fields, (name, files[0].file_object.getvalue())
