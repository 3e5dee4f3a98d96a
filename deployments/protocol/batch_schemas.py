"""The Batch API's request and list bodies; its objects are the `openai` SDK's own models (`Batch`,
`FileObject`, `FileDeleted`), so what the gateway documents is what the SDK parses."""

from __future__ import annotations

from typing import Literal

from openai.types import Batch, FileDeleted, FileObject
from pydantic import BaseModel

from raylane.config.batch import BATCH_ENDPOINTS
from raylane.deployments.protocol.openai_schemas import Metadata, _Request

__all__ = ["Batch", "BatchCreateRequest", "BatchList", "FileDeleted", "FileList", "FileObject"]


class BatchCreateRequest(_Request):
    input_file_id: str
    endpoint: Literal[BATCH_ENDPOINTS]
    completion_window: Literal["24h"]
    metadata: Metadata | None = None
    output_expires_after: dict | None = None  # accepted; output files are kept `batch.file_ttl_s`


class _Page(BaseModel):
    object: Literal["list"] = "list"
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class FileList(_Page):
    data: list[FileObject]


class BatchList(_Page):
    data: list[Batch]
