"""The Batch API's records: files, batches, and each finished line of a batch, in the database of
deployments/batch/database.py (SQLite, or PostgreSQL by URL).

A batch's progress is its `lines` rows: a line is run when it has no row, and its row is written
once (the primary key), so a batch taken up again after any crash runs only the lines without one,
and its output holds each line once. File bytes live in a directory (`batch.files_dir`; a shared
filesystem with PostgreSQL); a file's row is written after its bytes, and its bytes removed after
its row. Every row names its app, so apps may share a database. Files are read in pages: no caller
ever holds a whole one.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from raylane.deployments.batch.database import Database, is_postgresql
from raylane.deployments.protocol.batch_answers import NO_USAGE, LineUsage, usage_of

__all__ = ["ACTIVE", "BatchStore", "is_postgresql", "now"]
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
FILE_COLUMNS = "id, owner, purpose, filename, bytes, created_at, expires_at"


class BatchStore:
    def __init__(self, store: str, files_dir: Path, app: str) -> None:
        files_dir.mkdir(parents=True, exist_ok=True)
        self.files_dir, self.app = files_dir, app
        self.db = Database(store)

    # -- files ------------------------------------------------------------------------------------

    def path_of(self, file_id: str) -> Path:
        return self.files_dir / file_id

    def add_file(self, record: dict[str, Any], owner: str, content: bytes | None = None) -> None:
        """The file's row, after its bytes: `content`, or (None) what is at `path_of` already."""
        if content is not None:
            self.path_of(record["id"]).write_bytes(content)
        self.db.write(
            f"INSERT INTO raylane_batch_files (app, {FILE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
            " ON CONFLICT (id) DO NOTHING",
            (self.app, record["id"], owner, record["purpose"], record["filename"], record["bytes"])
            + (record["created_at"], record["expires_at"]),
        )

    def read_page(self, file_id: str, offset: int, size: int) -> bytes:
        """Up to `size` bytes of a file's content from `offset` (fewer at its end)."""
        with self.path_of(file_id).open("rb") as f:
            f.seek(offset)
            return f.read(size)

    def file(self, file_id: str, owner: str) -> dict[str, Any] | None:
        sql = f"SELECT {FILE_COLUMNS} FROM raylane_batch_files WHERE id = ? AND app = ? AND owner = ?"
        rows = self.db.rows(sql, (file_id, self.app, owner))
        return _file_record(rows[0]) if rows else None

    def files(self, owner: str, purpose: str | None, limit: int, after: str | None, desc: bool) -> list[dict]:
        sql, args = (
            f"SELECT {FILE_COLUMNS} FROM raylane_batch_files WHERE app = ? AND owner = ?",
            [self.app, owner],
        )
        if purpose is not None:
            sql, args = sql + " AND purpose = ?", [*args, purpose]
        if after is not None:
            sql += f" AND seq {'<' if desc else '>'} (SELECT seq FROM raylane_batch_files WHERE id = ?)"
            args.append(after)
        sql += f" ORDER BY seq {'DESC' if desc else 'ASC'} LIMIT ?"  # the order they were made in
        return [_file_record(row) for row in self.db.rows(sql, (*args, limit))]

    def file_usage(self, owner: str) -> tuple[int, int]:
        """(files, their bytes) an owner keeps."""
        sql = "SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM raylane_batch_files WHERE app = ? AND owner = ?"
        count, size = self.db.rows(sql, (self.app, owner))[0]
        return int(count), int(size)

    def delete_file(self, file_id: str, owner: str) -> bool:
        sql = "DELETE FROM raylane_batch_files WHERE id = ? AND app = ? AND owner = ?"
        deleted = self.db.write(sql, (file_id, self.app, owner)) > 0
        if deleted:
            self.path_of(file_id).unlink(missing_ok=True)
        return deleted

    def expired_files(self, now: float) -> list[tuple[str, str]]:
        sql = "SELECT id, owner FROM raylane_batch_files WHERE app = ? AND expires_at <= ?"
        return self.db.rows(sql, (self.app, int(now)))

    # -- batches ----------------------------------------------------------------------------------

    def put_batch(self, batch: dict[str, Any], owner: str, key_id: str) -> None:
        self.db.write(
            "INSERT INTO raylane_batches (id, app, owner, key_id, status, created_at, data)"
            " VALUES (?, ?, ?, ?, ?, ?, ?)"
            " ON CONFLICT (id) DO UPDATE SET status = excluded.status, data = excluded.data",
            (batch["id"], self.app, owner, key_id, batch["status"], batch["created_at"], json.dumps(batch)),
        )

    def set_status(self, batch: dict[str, Any], status: str) -> None:
        """`batch` moved to `status` now (its `<status>_at` set), and stored."""
        batch["status"] = status
        batch[f"{status}_at"] = now()
        self.put_batch(batch, *self.owner_of(batch["id"]))

    def owner_of(self, batch_id: str) -> tuple[str, str]:
        """(owner, key id) of a batch."""
        return self.db.rows(
            "SELECT owner, key_id FROM raylane_batches WHERE id = ? AND app = ?", (batch_id, self.app)
        )[0]

    def batch(self, batch_id: str, owner: str | None = None) -> dict[str, Any] | None:
        sql, args = "SELECT data FROM raylane_batches WHERE id = ? AND app = ?", (batch_id, self.app)
        if owner is not None:
            sql, args = sql + " AND owner = ?", (*args, owner)
        rows = self.db.rows(sql, args)
        return json.loads(rows[0][0]) if rows else None

    def batches(self, owner: str, limit: int, after: str | None) -> list[dict]:
        """Newest first, as OpenAI lists them."""
        sql, args = "SELECT data FROM raylane_batches WHERE app = ? AND owner = ?", [self.app, owner]
        if after is not None:
            sql += " AND seq < (SELECT seq FROM raylane_batches WHERE id = ?)"
            args.append(after)
        return [
            json.loads(row[0]) for row in self.db.rows(sql + " ORDER BY seq DESC LIMIT ?", (*args, limit))
        ]

    def count_by_status(self) -> dict[str, int]:
        sql = "SELECT status, COUNT(*) FROM raylane_batches WHERE app = ? GROUP BY status"
        return dict(self.db.rows(sql, (self.app,)))

    def active(self, owner: str | None = None) -> list[tuple[str, str, str]]:
        """(id, owner, key id) of the batches not yet ended, oldest first."""
        statuses = ",".join("?" * len(ACTIVE))
        sql = f"SELECT id, owner, key_id FROM raylane_batches WHERE app = ? AND status IN ({statuses})"
        args: tuple = (self.app, *ACTIVE)
        if owner is not None:
            sql, args = sql + " AND owner = ?", (*args, owner)
        return self.db.rows(sql + " ORDER BY seq", args)

    # -- a batch's lines ----------------------------------------------------------------------------

    def finish_line(
        self, batch_id: str, line: int, status_code: int, text: str, usage: LineUsage = NO_USAGE
    ) -> bool:
        """Record line `line`'s result (its output or error line, as JSON) and tokens; False if it had
        one already (it is never written twice)."""
        sql = (
            "INSERT INTO raylane_batch_lines"
            " (batch_id, line, status_code, record, bytes, input_tokens, output_tokens)"
            " VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING"
        )
        args = (batch_id, line, status_code, text, len(text.encode()), *usage)
        return self.db.write(sql, args) > 0

    def done_lines(self, batch_id: str) -> set[int]:
        return {
            row[0]
            for row in self.db.rows("SELECT line FROM raylane_batch_lines WHERE batch_id = ?", (batch_id,))
        }

    def line_counts(self, batch_id: str) -> tuple[int, int]:
        """(answered with a success, failed) lines so far."""
        sql = (
            "SELECT COALESCE(SUM(CASE WHEN status_code < 400 THEN 1 ELSE 0 END), 0),"
            " COALESCE(SUM(CASE WHEN status_code >= 400 THEN 1 ELSE 0 END), 0)"
            " FROM raylane_batch_lines WHERE batch_id = ?"
        )
        ok, failed = self.db.rows(sql, (batch_id,))[0]
        return int(ok), int(failed)

    def line_bytes(self, batch_id: str) -> int:
        """Bytes of a batch's line results (from the index: no record is read)."""
        sql = "SELECT COALESCE(SUM(bytes), 0) FROM raylane_batch_lines WHERE batch_id = ?"
        return int(self.db.rows(sql, (batch_id,))[0][0])

    def result_sizes(self, batch_id: str, after: int, limit: int) -> list[tuple[int, int]]:
        """(line, bytes) of up to `limit` finished lines past line `after`, in input order."""
        sql = (
            "SELECT line, bytes FROM raylane_batch_lines"
            " WHERE batch_id = ? AND line > ? ORDER BY line LIMIT ?"
        )
        return self.db.rows(sql, (batch_id, after, limit))

    def results(self, batch_id: str, first: int, last: int) -> list[tuple[int, int, str, LineUsage]]:
        """(line, status code, output line JSON, usage) of the finished lines from `first` to `last`."""
        sql = (
            "SELECT line, status_code, record, input_tokens, output_tokens FROM raylane_batch_lines"
            " WHERE batch_id = ? AND line BETWEEN ? AND ? ORDER BY line"
        )
        return [
            (line, status, text, LineUsage(i, o) if i >= 0 else _usage_in(text))
            for line, status, text, i, o in self.db.rows(sql, (batch_id, first, last))
        ]

    def forget_lines(self, batch_id: str, up_to: int | None = None) -> None:
        """Drop a batch's line rows (those up to line `up_to`): its output files hold them now."""
        if up_to is None:
            self.db.write("DELETE FROM raylane_batch_lines WHERE batch_id = ?", (batch_id,))
        else:
            self.db.write(
                "DELETE FROM raylane_batch_lines WHERE batch_id = ? AND line <= ?", (batch_id, up_to)
            )

    # -- writing a batch's output files ---------------------------------------------------------

    def output_state(self, batch_id: str) -> dict[str, Any] | None:
        """How far writing a batch's output files got (deployments/batch/output.py), if it began."""
        rows = self.db.rows("SELECT state FROM raylane_batch_outputs WHERE batch_id = ?", (batch_id,))
        return json.loads(rows[0][0]) if rows else None

    def save_output_state(self, batch_id: str, state: dict[str, Any]) -> None:
        self.db.write(
            "INSERT INTO raylane_batch_outputs VALUES (?, ?)"
            " ON CONFLICT (batch_id) DO UPDATE SET state = excluded.state",
            (batch_id, json.dumps(state)),
        )

    def forget_output_state(self, batch_id: str) -> None:
        self.db.write("DELETE FROM raylane_batch_outputs WHERE batch_id = ?", (batch_id,))


def _file_record(row: tuple) -> dict[str, Any]:
    file_id, _owner, purpose, filename, size, created_at, expires_at = row
    return {
        "id": file_id,
        "object": "file",
        "bytes": size,
        "created_at": created_at,
        "expires_at": expires_at,
        "filename": filename,
        "purpose": purpose,
        "status": "processed",
    }


def now() -> int:
    return int(time.time())


def _usage_in(text: str) -> LineUsage:
    """The usage of a line an earlier version stored without its tokens."""
    response = json.loads(text)["response"]
    return usage_of(response["body"]) if response is not None else NO_USAGE
