"""The Batch API's records in SQLite: files, batches, and each finished line of a batch.

A batch's progress is its `lines` rows: a line is run when it has no row, and its row is written
once (the primary key), so a batch taken up again after any crash runs only the lines without one,
and its output holds each line once. File bytes live in a directory beside the database (the
records name them); a file's row is written after its bytes, and its bytes removed after its row.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, purpose TEXT NOT NULL, filename TEXT NOT NULL,
    bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, expires_at INTEGER
);
CREATE INDEX IF NOT EXISTS files_by_owner ON files (owner);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, key_id TEXT NOT NULL, status TEXT NOT NULL,
    created_at INTEGER NOT NULL, data TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS batches_by_owner ON batches (owner);
CREATE INDEX IF NOT EXISTS batches_by_status ON batches (status);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, line INTEGER NOT NULL, status_code INTEGER NOT NULL, record TEXT NOT NULL,
    PRIMARY KEY (batch_id, line)
);
"""
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")


class BatchStore:
    def __init__(self, path: Path, files_dir: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        files_dir.mkdir(parents=True, exist_ok=True)
        self.files_dir = files_dir
        # One connection, used from the actor's loop and its file threads: serialized by the lock.
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")  # WAL: a crash of the process loses nothing
        self._db.executescript(SCHEMA)
        self._lock = threading.Lock()

    def _rows(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def _write(self, sql: str, args: tuple = ()) -> int:
        with self._lock:
            return self._db.execute(sql, args).rowcount

    # -- files ------------------------------------------------------------------------------------

    def path_of(self, file_id: str) -> Path:
        return self.files_dir / file_id

    def add_file(self, record: dict[str, Any], owner: str, content: bytes) -> None:
        path = self.path_of(record["id"])
        path.write_bytes(content)
        self._write(
            "INSERT INTO files VALUES (?, ?, ?, ?, ?, ?, ?)",
            (
                record["id"],
                owner,
                record["purpose"],
                record["filename"],
                record["bytes"],
                record["created_at"],
                record["expires_at"],
            ),
        )

    def file(self, file_id: str, owner: str) -> dict[str, Any] | None:
        rows = self._rows("SELECT * FROM files WHERE id = ? AND owner = ?", (file_id, owner))
        return _file_record(rows[0]) if rows else None

    def files(self, owner: str, purpose: str | None, limit: int, after: str | None, desc: bool) -> list[dict]:
        sql, args = "SELECT * FROM files WHERE owner = ?", [owner]
        if purpose is not None:
            sql, args = sql + " AND purpose = ?", [*args, purpose]
        if after is not None:
            sql += f" AND rowid {'<' if desc else '>'} (SELECT rowid FROM files WHERE id = ?)"
            args.append(after)
        order = "DESC" if desc else "ASC"
        sql += f" ORDER BY rowid {order} LIMIT ?"  # the order they were made in
        return [_file_record(row) for row in self._rows(sql, (*args, limit))]

    def count_files(self, owner: str) -> int:
        return self._rows("SELECT COUNT(*) FROM files WHERE owner = ?", (owner,))[0][0]

    def delete_file(self, file_id: str, owner: str) -> bool:
        deleted = self._write("DELETE FROM files WHERE id = ? AND owner = ?", (file_id, owner)) > 0
        if deleted:
            self.path_of(file_id).unlink(missing_ok=True)
        return deleted

    def expired_files(self, now: float) -> list[tuple[str, str]]:
        return self._rows(
            "SELECT id, owner FROM files WHERE expires_at IS NOT NULL AND expires_at <= ?", (now,)
        )

    # -- batches ----------------------------------------------------------------------------------

    def put_batch(self, batch: dict[str, Any], owner: str, key_id: str) -> None:
        self._write(
            # An upsert, not a replace: the row keeps its rowid, the order batches were made in.
            "INSERT INTO batches VALUES (?, ?, ?, ?, ?, ?)"
            " ON CONFLICT (id) DO UPDATE SET status = excluded.status, data = excluded.data",
            (batch["id"], owner, key_id, batch["status"], batch["created_at"], json.dumps(batch)),
        )

    def owner_of(self, batch_id: str) -> tuple[str, str]:
        """(owner, key id) of a batch."""
        return self._rows("SELECT owner, key_id FROM batches WHERE id = ?", (batch_id,))[0]

    def batch(self, batch_id: str, owner: str | None = None) -> dict[str, Any] | None:
        sql, args = "SELECT data FROM batches WHERE id = ?", (batch_id,)
        if owner is not None:
            sql, args = sql + " AND owner = ?", (batch_id, owner)
        rows = self._rows(sql, args)
        return json.loads(rows[0][0]) if rows else None

    def batches(self, owner: str, limit: int, after: str | None) -> list[dict]:
        """Newest first, as OpenAI lists them."""
        sql, args = "SELECT data FROM batches WHERE owner = ?", [owner]
        if after is not None:
            sql += " AND rowid < (SELECT rowid FROM batches WHERE id = ?)"
            args.append(after)
        sql += " ORDER BY rowid DESC LIMIT ?"
        return [json.loads(row[0]) for row in self._rows(sql, (*args, limit))]

    def count_by_status(self) -> dict[str, int]:
        return dict(self._rows("SELECT status, COUNT(*) FROM batches GROUP BY status"))

    def active(self, owner: str | None = None) -> list[tuple[str, str, str]]:
        """(id, owner, key id) of the batches not yet ended, oldest first."""
        sql = f"SELECT id, owner, key_id FROM batches WHERE status IN ({','.join('?' * len(ACTIVE))})"
        args: tuple = ACTIVE
        if owner is not None:
            sql, args = sql + " AND owner = ?", (*ACTIVE, owner)
        return self._rows(sql + " ORDER BY rowid", args)

    # -- a batch's lines ----------------------------------------------------------------------------

    def finish_line(self, batch_id: str, line: int, status_code: int, record: dict[str, Any]) -> bool:
        """Record line `line`'s result; False if it had one already (it is never written twice)."""
        sql = "INSERT OR IGNORE INTO lines VALUES (?, ?, ?, ?)"
        return self._write(sql, (batch_id, line, status_code, json.dumps(record, ensure_ascii=False))) > 0

    def done_lines(self, batch_id: str) -> set[int]:
        return {row[0] for row in self._rows("SELECT line FROM lines WHERE batch_id = ?", (batch_id,))}

    def line_counts(self, batch_id: str) -> tuple[int, int]:
        """(succeeded, failed) lines so far."""
        sql = "SELECT SUM(status_code < 300), SUM(status_code >= 300) FROM lines WHERE batch_id = ?"
        ok, failed = self._rows(sql, (batch_id,))[0]
        return ok or 0, failed or 0

    def results(self, batch_id: str) -> list[tuple[int, int, str]]:
        """(line, status code, output line JSON) of each finished line, in input order."""
        sql = "SELECT line, status_code, record FROM lines WHERE batch_id = ? ORDER BY line"
        return self._rows(sql, (batch_id,))

    def forget_lines(self, batch_id: str) -> None:
        self._write("DELETE FROM lines WHERE batch_id = ?", (batch_id,))


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
