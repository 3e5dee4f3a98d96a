"""What one API key keeps in the batch store, against `batch.max_files_per_key` and
`batch.max_bytes_per_key`: its files (uploads, outputs, error files) and the line results of its
batches not yet ended.

Counted in the batch actor's memory, from the store's truth (read at an owner's first use after the
actor starts) plus what is reserved for work under way: an upload reserves its file and its declared
bytes before a byte of its body is read; a batch reserves its two output files (output and errors)
when it is made; a line's result is charged before it is written. A check and its reservation are
one synchronous call on the actor's event loop, with no await between: two uploads racing for a
key's last file cannot both pass, whatever the gateway replicas they came through. The actor is the
store's only writer, so the count stays true while it lives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

OUTPUT_FILES = 2  # a batch's output and error files: counted against its key from its creation


class QuotaError(Exception):
    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field  # the config field that bounds it (`batch.max_bytes_per_key`)


@dataclass(slots=True)
class Usage:
    files: int = 0
    bytes: int = 0


class Records(Protocol):
    """What the quota reads of the store when it first counts an owner."""

    def file_usage(self, owner: str) -> tuple[int, int]: ...
    def active(self, owner: str | None = None) -> list[tuple[str, str, str]]: ...
    def line_bytes(self, batch_id: str) -> int: ...
    def output_state(self, batch_id: str) -> dict | None: ...


class StorageQuota:
    def __init__(self, records: Records, max_files: int, max_bytes: int) -> None:
        self.records, self.max_files, self.max_bytes = records, max_files, max_bytes
        self._usage: dict[str, Usage] = {}

    def usage(self, owner: str) -> Usage:
        usage = self._usage.get(owner)
        if usage is None:
            usage = self._usage[owner] = self._count(owner)
        return usage

    def _count(self, owner: str) -> Usage:
        files, size = self.records.file_usage(owner)
        active = self.records.active(owner)
        for batch_id, _, _ in active:
            size += self.records.line_bytes(batch_id)
            state = self.records.output_state(batch_id)  # output written, its row not yet made
            size += sum(state["bytes"].values()) if state is not None else 0
        return Usage(files + OUTPUT_FILES * len(active), size)

    def reserve(self, owner: str, files: int, size: int) -> None:
        """Count `files` and `size` bytes more for `owner`, or QuotaError counting nothing."""
        usage = self.usage(owner)
        if files and usage.files + files > self.max_files:
            raise QuotaError(
                f"This API key keeps {usage.files} of its {self.max_files} files already "
                "(batch.max_files_per_key; a batch not yet ended holds two, for its output and error "
                "files): delete some first.",
                "batch.max_files_per_key",
            )
        if size and usage.bytes + size > self.max_bytes:
            raise QuotaError(
                f"This API key's batch files and results would take {usage.bytes + size} bytes, more "
                f"than the {self.max_bytes} it may keep (batch.max_bytes_per_key): delete some files first.",
                "batch.max_bytes_per_key",
            )
        self.charge(owner, files, size)

    def charge(self, owner: str, files: int, size: int) -> None:
        """Count what is already admitted in another form (a batch's results becoming its output)."""
        usage = self.usage(owner)
        usage.files += files
        usage.bytes += size

    def release(self, owner: str, files: int, size: int) -> None:
        usage = self.usage(owner)
        usage.files = max(0, usage.files - files)
        usage.bytes = max(0, usage.bytes - size)
