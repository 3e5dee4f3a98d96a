"""The batch store's database connection: SQLite (a file on the batch actor's node, nothing to
install) or PostgreSQL (`batch.store: postgresql://...`, for a multi-node cluster whose batch actor
may restart on another node), with the schema made or brought up to date when it opens."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

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
);
CREATE TABLE IF NOT EXISTS raylane_batch_outputs (
    batch_id TEXT NOT NULL PRIMARY KEY, state TEXT NOT NULL
)
"""
# Added since the first schema (a database an earlier version made lacks them): each line's bytes,
# and an index that gives every line's number and bytes without reading the records themselves; each
# line's tokens (-1 in a row an earlier version wrote: counted from its record).
MIGRATIONS = (
    (
        "raylane_batch_lines",
        "bytes",
        "ALTER TABLE raylane_batch_lines ADD COLUMN bytes {bigint} NOT NULL DEFAULT 0",
    ),
    (
        "raylane_batch_lines",
        "input_tokens",
        "ALTER TABLE raylane_batch_lines ADD COLUMN input_tokens {bigint} NOT NULL DEFAULT -1",
    ),
    (
        "raylane_batch_lines",
        "output_tokens",
        "ALTER TABLE raylane_batch_lines ADD COLUMN output_tokens {bigint} NOT NULL DEFAULT -1",
    ),
)
INDEXES = (
    "CREATE INDEX IF NOT EXISTS raylane_batch_lines_bytes ON raylane_batch_lines (batch_id, line, bytes)"
)


def is_postgresql(store: str) -> bool:
    return store.startswith(("postgresql://", "postgres://"))


class Database:
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
            types = {"serial": "BIGSERIAL PRIMARY KEY", "bigint": "BIGINT"}
            for statement in SCHEMA.format(**types).split(";"):
                connection.execute(statement)
            for _table, _column, sql in MIGRATIONS:
                connection.execute(sql.format(**types).replace("ADD COLUMN", "ADD COLUMN IF NOT EXISTS"))
            connection.execute(INDEXES)
            return connection
        path = Path(self.store).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        connection = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        connection.execute("PRAGMA journal_mode=WAL")
        connection.execute("PRAGMA synchronous=NORMAL")  # WAL: a crash of the process loses nothing
        types = {"serial": "INTEGER PRIMARY KEY AUTOINCREMENT", "bigint": "INTEGER"}
        connection.executescript(SCHEMA.format(**types))
        for table, column, sql in MIGRATIONS:
            if column not in {row[1] for row in connection.execute(f"PRAGMA table_info({table})")}:
                connection.execute(sql.format(**types))
        connection.execute(INDEXES)
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
