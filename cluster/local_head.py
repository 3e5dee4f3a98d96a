"""The local Ray head that `raylane serve` starts, in a session of its own.

`ray.init()` would start GCS, the raylet, the dashboard and every worker as children in raylane's
process group. A stop sent to the whole group (systemd, `timeout`, `kill -TERM -PGID`, most
supervisors) then reached them at the same moment as raylane: GCS died first, and raylane's drain
and Serve shutdown waited a minute for it before exiting non-zero. Started as
`ray start --head --block` in a new session (its own process group), Ray's processes get only what
raylane sends them, in order: raylane drains the app, shuts Serve down, disconnects, and then stops
the head (SIGTERM to `ray start`, which stops its processes the way `ray stop` does; whatever is
left of the head's process group after `STOP_TIMEOUT_S` is killed).

The head dies with raylane all the same: `ray start` gets SIGKILL when raylane's process ends
(Linux `PR_SET_PDEATHSIG`), and its reaper then ends the rest of its group.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from raylane.cluster.serve_env import free_port

START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 15.0
READY_LINE = "Ray runtime started"


@dataclass
class LocalHead:
    process: subprocess.Popen
    address: str  # the GCS address, for ray.init(address=...)
    log: Path  # `ray start`'s own output

    @classmethod
    def start(cls, timeout_s: float = START_TIMEOUT_S) -> LocalHead:
        """Start the head (with this process's environment) and return once it accepts drivers."""
        port = free_port()
        log = Path(tempfile.mkstemp(prefix="raylane-ray-head-", suffix=".log")[1])
        command = [
            sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
            f"--port={port}", "--node-ip-address=127.0.0.1", "--disable-usage-stats",
            f"--temp-dir={temp_dir(port)}",
        ]  # fmt: skip
        _token_auth_as_ray_init_does()
        # Serve is down by the time the head stops: Ray's own drain on SIGTERM has nothing to wait for.
        env = os.environ | {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
        with open(log, "w") as out:
            process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        head = cls(process, f"127.0.0.1:{port}", log)
        deadline = time.monotonic() + timeout_s
        try:
            while READY_LINE not in head.output():
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the local Ray head did not start:\n{head.output()[-3000:]}")
                time.sleep(0.2)
        except BaseException:  # a stop signal while starting too: leave nothing behind
            head.stop()
            raise
        return head

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Stop `ray start` and, after `timeout_s`, kill whatever is left of its process group."""
        pgid = self.process.pid  # a session leader: its group is its pid
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while _group_alive(pgid) and time.monotonic() < deadline:
            self.process.poll()  # reap it, so it does not linger as a zombie of the group
            time.sleep(0.1)
        if _group_alive(pgid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        self.process.wait()
        self.log.unlink(missing_ok=True)


def temp_dir(port: int) -> str:
    """The head's own Ray temp dir, under Ray's default root ($RAY_TMPDIR, $TMPDIR or /tmp, then
    `ray`). `ray start` writes its address into `ray_current_cluster` there, and a plain `ray.init()`
    on the machine joins the cluster that file names, even one long stopped: in the shared
    /tmp/ray it would take over every other Ray user's `ray.init()` (a `ray.init()` head, as
    raylane ran before, writes no such file)."""
    root = os.environ.get("RAY_TMPDIR") or tempfile.gettempdir()
    return os.path.join(root, "ray", f"raylane-{port}")


def _token_auth_as_ray_init_does() -> None:
    """Token authentication as `ray.init()` sets it up for a new local cluster (Ray 2.60): on unless
    RAY_AUTH_MODE says otherwise, the token in ~/.ray/auth_token (made if missing). The head inherits
    the mode and reads the same token; this driver, which connects by address, would otherwise not
    send it (Ray turns auth on by itself only for a cluster it finds or starts)."""
    from ray._private.authentication.authentication_token_setup import (
        enable_token_auth_by_default,
        ensure_token_if_auth_enabled,
    )

    enable_token_auth_by_default()
    ensure_token_if_auth_enabled(None, create_token_if_missing=True)


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the parent (raylane) dies; Linux only."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGKILL)


def _group_alive(pgid: int) -> bool:
    """Whether a live process (not a zombie) is in process group `pgid`."""
    if not sys.platform.startswith("linux"):
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False
