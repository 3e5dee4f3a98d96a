"""The Batch API's records: files, batches, and each finished line of a batch, in SQLite (a file on
the batch actor's node, nothing to install) or PostgreSQL (`batch.store: postgresql://...`, for a
multi-node cluster whose batch actor may restart on another node).

A batch's progress is its `lines` rows: a line is run when it has no row, and its row is written
once (the primary key), so a batch taken up again after any crash runs only the lines without one,
and its output holds each line once. File bytes live in a directory (`batch.files_dir`; a shared
filesystem with PostgreSQL); a file's row is written after its bytes, and its bytes removed after
its row. Every row names its app, so apps may share a database.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

# `{serial}`, `{bigint}`: each dialect's auto-increment key and 64-bit integer. `seq` is the order
# rows were made in (listing order); `id` is what clients see.
SCHEMA = """
CREATE TABLE IF NOT EXISTS raylane_batch_files (
    seq {serial}, id TEXT NOT NULL UNIQUE, app TEXT NOT NULL, owner TEXT NOT NULL,
    purpose TEXT NOT NULL, filename TEXT NOT NULL, bytes {bigint} NOT NULL,
    created_at {bigint} NOT NULL, expires_at {bigint}
);
CREATE INDEX IF NOT EXISTS raylane_batch_files_owner ON raylane_batch_files (app, owner);
CREATE TABLE IF NOT EXISTS raylane_batches (
    seq {serial}, id TEXT NOT NULL UNIQUE, app TEXT NOT NULL, owner TEXT NOT NULL,
    key_id TEXT NOT NULL, status TEXT NOT NULL, created_at {bigint} NOT NULL, data TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS raylane_batches_owner ON raylane_batches (app, owner);
CREATE INDEX IF NOT EXISTS raylane_batches_status ON raylane_batches (app, status);
CREATE TABLE IF NOT EXISTS raylane_batch_lines (
    batch_id TEXT NOT NULL, line INTEGER NOT NULL, status_code INTEGER NOT NULL, record TEXT NOT NULL,
    PRIMARY KEY (batch_id, line)
)
"""
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
FILE_COLUMNS = "id, owner, purpose, filename, bytes, created_at, expires_at"


def is_postgresql(store: str) -> bool:
    return store.startswith(("postgresql://", "postgres://"))


class _Database:
    """One connection, used from the actor's loop and its threads, serialized by a lock; SQL is
    written with `?` parameters. A PostgreSQL connection that broke (a server restart, a network
    cut) is opened again once per statement."""

    def __init__(self, store: str) -> None:
        self.store, self.lock = store, threading.Lock()
        self.placeholder = "%s" if is_postgresql(store) else "?"
        self.connection = self._open()

    def _open(self):
        if is_postgresql(self.store):
            import psycopg  # the `postgresql` extra

            connection = psycopg.connect(self.store, autocommit=True)
            for statement in SCHEMA.format(serial="BIGSERIAL PRIMARY KEY", bigint="BIGINT").split(";"):
                connection.execute(statement)
            return connection
        path = Path(self.store).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        connection = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        connection.execute("PRAGMA journal_mode=WAL")
        connection.execute("PRAGMA synchronous=NORMAL")  # WAL: a crash of the process loses nothing
        connection.executescript(SCHEMA.format(serial="INTEGER PRIMARY KEY AUTOINCREMENT", bigint="INTEGER"))
        return connection

    def _execute(self, sql: str, args: tuple):
        sql = sql.replace("?", self.placeholder)
        try:
            return self.connection.execute(sql, args)
        except Exception as e:
            if not self._broken(e):
                raise
            self.connection = self._open()
            return self.connection.execute(sql, args)

    def _broken(self, error: Exception) -> bool:
        if not is_postgresql(self.store):
            return False
        import psycopg

        return isinstance(error, (psycopg.OperationalError, psycopg.InterfaceError))

    def rows(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self.lock:
            return [tuple(row) for row in self._execute(sql, args).fetchall()]

    def write(self, sql: str, args: tuple = ()) -> int:
        with self.lock:
            return self._execute(sql, args).rowcount


class BatchStore:
    def __init__(self, store: str, files_dir: Path, app: str) -> None:
        files_dir.mkdir(parents=True, exist_ok=True)
        self.files_dir, self.app = files_dir, app
        self.db = _Database(store)

    # -- files ------------------------------------------------------------------------------------

    def path_of(self, file_id: str) -> Path:
        return self.files_dir / file_id

    def add_file(self, record: dict[str, Any], owner: str, content: bytes) -> None:
        self.path_of(record["id"]).write_bytes(content)
        self.db.write(
            f"INSERT INTO raylane_batch_files (app, {FILE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (self.app, record["id"], owner, record["purpose"], record["filename"], record["bytes"])
            + (record["created_at"], record["expires_at"]),
        )

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

    def count_files(self, owner: str) -> int:
        return self.db.rows(
            "SELECT COUNT(*) FROM raylane_batch_files WHERE app = ? AND owner = ?", (self.app, owner)
        )[0][0]

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

    def finish_line(self, batch_id: str, line: int, status_code: int, record: dict[str, Any]) -> bool:
        """Record line `line`'s result; False if it had one already (it is never written twice)."""
        sql = "INSERT INTO raylane_batch_lines VALUES (?, ?, ?, ?) ON CONFLICT DO NOTHING"
        return self.db.write(sql, (batch_id, line, status_code, json.dumps(record, ensure_ascii=False))) > 0

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

    def results(self, batch_id: str) -> list[tuple[int, int, str]]:
        """(line, status code, output line JSON) of each finished line, in input order."""
        sql = "SELECT line, status_code, record FROM raylane_batch_lines WHERE batch_id = ? ORDER BY line"
        return self.db.rows(sql, (batch_id,))

    def forget_lines(self, batch_id: str) -> None:
        self.db.write("DELETE FROM raylane_batch_lines WHERE batch_id = ?", (batch_id,))


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
