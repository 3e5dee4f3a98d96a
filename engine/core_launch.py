"""Starting an engine core process (`engine/core_proc.py`), apart from everything that talks to it.

This module imports nothing heavier than the config, so a pool replica can start its engine core
before it imports torch and its own serving code: the child imports torch and the model and loads
the checkpoint while the replica imports. On two cores the two start-ups overlap, which is most of
what a killed replica's recovery waited for (`raylane bench recovery`, bench/README.md).

The child is `python -m raylane.engine.core_proc FD` with one end of a socket pair, not a
multiprocessing spawn, which would re-run the caller's `__main__` script in the child. It is handed
`StartCore` at once and answers `CoreReady` or `CoreFailed` once its engine is loaded (or not).
"""

import os
import pickle
import socket
import subprocess
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection

from raylane import tracing
from raylane.config import EngineConfig


@dataclass(frozen=True, slots=True)
class StartCore:
    config: EngineConfig
    # As many as the serving process uses (what an engine thread would use); None: torch's default,
    # which the child reads from the same environment (Ray's OMP_NUM_THREADS for the actor).
    torch_threads: int | None = None
    # The serving process's tracing settings (raylane/tracing.py) and its instance name: the core emits
    # the engine's spans itself. None: off.
    tracing: dict | None = None
    tracing_instance: str = ""


@dataclass(frozen=True, slots=True)
class CoreReady:
    max_model_len: int


@dataclass(frozen=True, slots=True)
class CoreFailed:
    error: BaseException  # what loading the engine raised, re-raised in the serving process


@dataclass(frozen=True, slots=True)
class CoreLaunch:
    """A started core process and the serving side's end of its socket (`EngineCoreProc` takes it)."""

    process: subprocess.Popen
    conn: Connection

    def cancel(self) -> None:
        """Stop a core nobody will use (its serving side failed before taking it): the child exits
        when its socket closes, or is killed."""
        self.conn.close()
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def launch_core(config: EngineConfig, torch_threads: int | None = None) -> CoreLaunch:
    """Start the child and hand it `config`: it loads the model while this process goes on. It traces
    as this process does (configured before this call)."""
    mine, theirs = socket.socketpair()
    env = os.environ | {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # import what we import
    fd = theirs.fileno()
    command = [sys.executable, "-m", "raylane.engine.core_proc", str(fd)]
    process = subprocess.Popen(command, pass_fds=[fd], env=env)
    theirs.close()
    conn = Connection(mine.detach())
    start = StartCore(config, torch_threads, tracing.settings(), f"{tracing.instance()}/engine-core")
    conn.send_bytes(pickle.dumps(start, protocol=pickle.HIGHEST_PROTOCOL))
    return CoreLaunch(process, conn)
