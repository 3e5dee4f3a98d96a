"""A real PostgreSQL server for a test module: Debian's package (`apt-get install postgresql`), a
fresh cluster in a temporary directory, reached by its Unix socket only; stopped at the end."""

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest


def server_binaries() -> Path | None:
    found = shutil.which("initdb") or next(iter(sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))), None)
    return Path(found).resolve().parent if found else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def postgresql_url():
    """postgresql:// URL of a database `raylane` (trust authentication, user `raylane`)."""
    binaries = server_binaries()
    if binaries is None:
        pytest.skip("no PostgreSQL server binary (initdb) on this machine: apt-get install postgresql")
    # Not under pytest's own temporary directory: only root may enter that one.
    root = Path(tempfile.mkdtemp(prefix="raylane-postgresql-"))
    data, sockets = root / "data", root / "run"
    sockets.mkdir()
    # The server refuses to run as root: as root, it runs as Debian's `postgres` user.
    as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    if as_user:
        shutil.chown(root, "postgres")
        shutil.chown(sockets, "postgres")
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.PIPE, "check": True}
    subprocess.run([*as_user, binaries / "initdb", "-D", data, "-A", "trust", "-U", "raylane"], **quiet)
    port = free_port()
    server = subprocess.Popen(
        [
            *as_user,
            binaries / "postgres",
            "-D",
            data,
            "-k",
            sockets,
            "-p",
            str(port),
            "-c",
            "listen_addresses=",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while not (sockets / f".s.PGSQL.{port}").exists():
            assert server.poll() is None and time.monotonic() < deadline, "PostgreSQL did not start"
            time.sleep(0.1)
        time.sleep(0.5)  # the socket appears a moment before connections are accepted
        yield f"postgresql://raylane@/postgres?host={sockets}&port={port}"
    finally:
        server.terminate()
        server.wait(timeout=30)
        shutil.rmtree(root, ignore_errors=True)
