"""Ending a batch: its output and error files written from its line rows a page at a time, and its
final status (completed, cancelled or expired).

A page is the rows of up to `PAGE_BYTES` of results (at least one row), chosen from the rows'
sizes (an index holds them: choosing reads no record); the page is appended to the files, its
progress saved (`raylane_batch_outputs`: the line written up to, each file's bytes, the counts and
usage so far), and then its rows dropped. So the actor never holds more than a page of a batch's
output, however large the batch made it, and an actor restarted mid-way continues from the last
saved page (the files cut back to the saved length first) instead of writing everything again.
The key's quota sees the bytes move from rows to files as they go.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from raylane.deployments.batch.lines import LineRef, add_usage, error_line, record_text
from raylane.deployments.batch.quota import StorageQuota
from raylane.deployments.batch.store import BatchStore, now

PAGE_BYTES = 4 * 2**20  # of line results read, and written, at once
SIZES_PAGE = 4096  # rows whose size is read at once to choose a page
EXPIRED_PAGE = 10_000  # error lines of lines that never ran written at once (~200 bytes each)
EXPIRED = "The request was not run within the batch's completion window."
KINDS = (("output_file_id", "output"), ("error_file_id", "errors"))


@dataclass(slots=True)
class Page:
    released: int  # bytes of line rows written out (and dropped)
    written: int  # bytes added to the files


class OutputWriter:
    def __init__(self, store: BatchStore, quota: StorageQuota, file_ttl_s: float) -> None:
        self.store, self.quota, self.file_ttl_s = store, quota, file_ttl_s

    async def finish(self, batch_id: str, input_lines: Callable[[], Awaitable[list[LineRef]]]) -> None:
        """Write the output and error files and end the batch: completed, cancelled or expired.
        `input_lines()`: its input's lines, read when it expired (the ones without a result are then
        `batch_expired` error lines)."""
        batch = self.store.batch(batch_id)
        owner, _ = self.store.owner_of(batch_id)
        self.quota.usage(owner)  # counted before the pages move bytes (a first count reads the store)
        state = self.store.output_state(batch_id) or self._begin(batch)
        pending: deque[tuple[int, str]] = deque()
        if state["ending"] == "expired":
            done = await asyncio.to_thread(self.store.done_lines, batch_id)
            refs = await input_lines()
            pending.extend(
                sorted(
                    (r.number, r.custom_id) for r in refs if r.number > state["line"] and r.number not in done
                )
            )
        await asyncio.to_thread(self._cut_back, state)
        while (page := await asyncio.to_thread(self._write_page, batch_id, state, pending)) is not None:
            self.quota.release(owner, 0, page.released)
            self.quota.charge(owner, 0, page.written)
        unused = await asyncio.to_thread(self._end, batch, owner, state)
        self.quota.release(owner, unused, 0)

    def _begin(self, batch: dict[str, Any]) -> dict[str, Any]:
        if batch["status"] == "cancelling":
            ending = "cancelled"
        elif time.time() >= batch["expires_at"]:
            ending = "expired"
        else:
            ending = "completed"
            self.store.set_status(batch, "finalizing")
        state = {
            "ending": ending,
            "line": 0,  # rows up to this line are in the files
            "files": {kind: f"file-{uuid.uuid4().hex}" for _, kind in KINDS},
            "bytes": {kind: 0 for _, kind in KINDS},
            "counts": {"completed": 0, "failed": 0},
            "usage": {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0},
        }
        self.store.save_output_state(batch["id"], state)
        return state

    def _cut_back(self, state: dict[str, Any]) -> None:
        """Each file to the length its saved progress says: a page cut short by a crash goes."""
        for _, kind in KINDS:
            path = self.store.path_of(state["files"][kind])
            with path.open("ab") as f:
                f.truncate(state["bytes"][kind])

    def _write_page(
        self, batch_id: str, state: dict[str, Any], pending: deque[tuple[int, str]]
    ) -> Page | None:
        """Append the next page to the files and save how far they got; None when all is written."""
        sizes = self.store.result_sizes(batch_id, state["line"], SIZES_PAGE)
        if sizes:
            last, total = sizes[0][0], 0
            for line, size in sizes:
                if total and total + size > PAGE_BYTES:
                    break
                last, total = line, total + size
            rows = self.store.results(batch_id, state["line"] + 1, last)
        elif pending:  # only lines that never ran are left
            last, total, rows = pending[min(len(pending), EXPIRED_PAGE) - 1][0], 0, []
        else:
            return None
        texts: dict[str, list[str]] = {"output": [], "errors": []}
        for _, status_code, text, usage in rows:
            texts["output" if status_code < 400 else "errors"].append(text)
            state["counts"]["completed" if status_code < 400 else "failed"] += 1
            add_usage(state["usage"], usage)
        while pending and pending[0][0] <= last:
            _, custom_id = pending.popleft()
            texts["errors"].append(record_text(error_line(custom_id, "batch_expired", EXPIRED)))
            state["counts"]["failed"] += 1
        written = 0
        for kind, items in texts.items():
            if items:
                with self.store.path_of(state["files"][kind]).open("ab") as f:
                    for text in items:  # one line at a time: no copy of the whole page
                        written += f.write(text.encode() + b"\n")
                    state["bytes"][kind] = f.tell()
        state["line"] = last
        self.store.save_output_state(batch_id, state)
        self.store.forget_lines(batch_id, last)
        return Page(total, written)

    def discard(self, batch_id: str) -> int:
        """Drop what a batch that failed while ending had written (files without a row yet: their
        rows are made last); the bytes dropped."""
        state = self.store.output_state(batch_id)
        if state is None:
            return 0
        owner, _ = self.store.owner_of(batch_id)
        dropped = 0
        for _, kind in KINDS:
            if self.store.file(state["files"][kind], owner) is None:
                self.store.path_of(state["files"][kind]).unlink(missing_ok=True)
                dropped += state["bytes"][kind]
        self.store.forget_output_state(batch_id)
        return dropped

    def _end(self, batch: dict[str, Any], owner: str, state: dict[str, Any]) -> int:
        """The files' rows, then the batch's final status, then the progress record; how many of
        its two files were empty, and so not made (their places in the key's quota go back)."""
        created, unused = now(), 0
        for field, kind in KINDS:
            file_id, size = state["files"][kind], state["bytes"][kind]
            if not size:
                self.store.path_of(file_id).unlink(missing_ok=True)
                unused += 1
                continue
            record = {
                "id": file_id,
                "purpose": "batch_output",
                "filename": f"{batch['id']}_{kind}.jsonl",
                "bytes": size,
                "created_at": created,
                "expires_at": created + int(self.file_ttl_s),
            }
            self.store.add_file(record, owner)
            batch[field] = file_id
        batch["request_counts"] = {"total": batch["request_counts"]["total"], **state["counts"]}
        details = {
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0},
        }
        batch["usage"] = state["usage"] | details
        self.store.set_status(batch, state["ending"])
        self.store.forget_lines(batch["id"])
        self.store.forget_output_state(batch["id"])
        return unused
