"""The simulated fleets `raylane bench scale` loads: N `raylane sim-server` processes, with
`vllm-router` (the Rust router on PyPI) in front of them or nothing (`direct`: the client spreads its
requests over the servers itself: the engines' own latency, no routing layer); and raylane's own
app, one pool of N simulated replicas behind the gateway. Both run the same profile, so what differs
between them is the routing layer alone.

Also: the CPU seconds each role spent (`cpu_by_role`), read from /proc, so a point's table can say
where the CPU went per request and per streamed token.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx2

from raylane.cluster.serve_env import free_ports

ROUTER_POLICIES = ("round_robin", "cache_aware")
START_TIMEOUT_S = 180.0


def wait_ok(url: str, deadline: float, process: subprocess.Popen | None = None) -> None:
    while True:
        if process is not None and process.poll() is not None:
            raise RuntimeError(
                f"{' '.join(process.args)} exited ({process.returncode}) before {url} answered"
            )
        try:
            if httpx2.get(url, timeout=2).status_code == 200:
                return
        except httpx2.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not answer 200 in time")
        time.sleep(0.3)


@dataclass
class SimServers:
    """`count` sim-server processes of `profile` on free local ports (each its own engine)."""

    profile: str
    count: int
    max_num_seqs: int | None = None
    urls: list[str] = field(default_factory=list)
    _processes: list[subprocess.Popen] = field(default_factory=list)

    def __enter__(self) -> SimServers:
        raylane = str(Path(sys.executable).with_name("raylane"))
        extra = ["--max-num-seqs", str(self.max_num_seqs)] if self.max_num_seqs else []
        try:
            for port in free_ports(self.count):
                command = [raylane, "sim-server", "--profile", self.profile, "--port", str(port), *extra]
                self._processes.append(subprocess.Popen(command, stdout=subprocess.DEVNULL))
                self.urls.append(f"http://127.0.0.1:{port}")
            deadline = time.monotonic() + START_TIMEOUT_S
            for url, process in zip(self.urls, self._processes, strict=True):
                wait_ok(f"{url}/health", deadline, process)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._processes]

    def __exit__(self, *exc) -> None:
        stop(self._processes)


@dataclass
class VllmRouter:
    """`vllm-router --policy POLICY` in front of `workers`, on a free port."""

    policy: str
    workers: list[str]
    url: str = ""
    _process: subprocess.Popen | None = None

    def __enter__(self) -> VllmRouter:
        binary = shutil.which("vllm-router", path=str(Path(sys.executable).parent)) or shutil.which(
            "vllm-router"
        )
        if binary is None:
            raise RuntimeError("vllm-router is not installed: pip install 'raylane[fleet]'")
        port, metrics_port = free_ports(2)
        command = [binary, "--worker-urls", *self.workers, "--policy", self.policy, "--port", str(port)]
        command += ["--prometheus-port", str(metrics_port), "--log-level", "warning"]
        # Its defaults queue at most 100 requests past 256 at once (then 429): a fleet's worth of streams
        # must pass, as they pass raylane's open tier.
        command += ["--max-concurrent-requests", "65536", "--queue-size", "65536"]
        command += ["--request-timeout-secs", "3600"]
        self._process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{port}"
        try:
            wait_ok(f"{self.url}/health", time.monotonic() + START_TIMEOUT_S, self._process)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    @property
    def pid(self) -> int:
        return self._process.pid if self._process else 0

    def __exit__(self, *exc) -> None:
        stop([self._process] if self._process else [])


def stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            process.terminate()
    for process in processes:
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def raylane_config(profile: str, replicas: int, max_num_seqs: int | None, ingress: str) -> dict:
    """raylane's app for the same fleet: one pool of `replicas` simulated replicas, open mode (the
    `open` tier: no rate limits, as vllm-router has none), prefix-aware replica routing (the
    default), no cap on a replica's streams but its engine's."""
    engine = {"cpus_per_rank": 0.01} | ({"max_num_seqs": max_num_seqs} if max_num_seqs else {})
    return {
        "http": {"ingress": ingress},
        "gateway": {"num_cpus": 0.1},
        "embeddings": {"enabled": False},
        "pools": [
            {
                "name": "sim",
                "model": f"sim:{profile}",
                "engine": engine,
                # vllm-router forwards every stream at once: so does the pool here (its default of
                # 64 a replica would hold an L4 profile's engine, 256 sequences, to a quarter).
                "replicas": {
                    "min_replicas": replicas,
                    "max_replicas": replicas,
                    "max_ongoing_requests": 4096,
                },
            }
        ],
        "router": {"routes": [{"name": "chat", "pool": "sim"}]},
    }


ROLES = (  # (role, what its command line starts with or holds), first match wins
    ("proxy", "ray::ProxyActor"),
    ("proxy", "haproxy"),
    ("gateway", ":Gateway"),
    ("pool replicas", ":ModelPool"),
    ("vllm-router", "vllm::router"),  # its process title (setproctitle)
    ("vllm-router", "vllm-router"),
    ("sim-servers", "sim-server"),
)


def cpu_by_role(client_pid: int | None = None) -> dict[int, tuple[str, float]]:
    """pid -> (role, CPU seconds so far: user + system) of every process in a role, the client's
    included; `role_cpu_since` turns two of these into the seconds each role spent between them."""
    tick = os.sysconf("SC_CLK_TCK")
    client_pid = client_pid or os.getpid()
    out: dict[int, tuple[str, float]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            fields = (proc / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        role = "client" if int(proc.name) == client_pid else None
        role = role or next((r for r, mark in ROLES if mark in cmdline), None)
        if role is not None:
            out[int(proc.name)] = (role, (int(fields[11]) + int(fields[12])) / tick)
    return out


def role_cpu_since(before: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds each role spent since `before`, over the processes alive at both ends (one that
    started meanwhile would count its whole life, one that ended would count negative)."""
    out: dict[str, float] = {}
    for pid, (role, cpu) in cpu_by_role().items():
        if pid in before:
            out[role] = out.get(role, 0.0) + cpu - before[pid][1]
    return out


# Proportional set size of one simulated replica (a Serve replica with its engine core) and of one
# sim-server, measured on this box (bench/README.md, "Fleet scale"), with room for their growth
# under load; and what the rest (Ray, Serve, the gateway, the client) needs beside them.
REPLICA_MIB = {"raylane": 240, "sim-server": 170}
HEADROOM_MIB = 3072


def phases(wanted: list[str], replicas: int, mode: str) -> list[list[str]]:
    """The targets in the groups that are started and measured together: all at once (alternated
    point by point, the fairest comparison on a noisy machine), or raylane's fleet and then the
    sim-servers' (one machine holds 64 of each only one fleet at a time: `REPLICA_MIB`)."""
    apart = [
        group for group in (["raylane"], [t for t in wanted if t != "raylane"]) if set(group) & set(wanted)
    ]
    if len(apart) < 2 or mode == "together":
        return [wanted]
    needed = replicas * (REPLICA_MIB["raylane"] + REPLICA_MIB["sim-server"]) + HEADROOM_MIB
    return apart if mode == "apart" or needed > available_mib() else [wanted]


def available_mib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) // 1024
    return 0
