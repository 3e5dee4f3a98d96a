"""Helpers every benchmark shares: what machine ran it, timing, and writing results (JSON + PNG)."""

import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# The instruction-set extensions that decide which kernels torch and oneDNN run (flag in /proc/cpuinfo,
# name in the machine line): bf16 linears need AVX512-BF16 or AMX, the int8/int4 kernels use VNNI.
VECTOR_EXTENSIONS = (("avx512_bf16", "AVX512-BF16"), ("avx512_vnni", "AVX512-VNNI"), ("amx_tile", "AMX"))


def cpu_model() -> str:
    """The CPU's name from /proc/cpuinfo (Linux) with its family and model numbers and its vector
    extensions (AVX-512 or only AVX2, and those of VECTOR_EXTENSIONS it has), else what `platform` knows.
    A VM often names only "AMD EPYC", and different EPYC generations hide behind that name; which
    kernels run, and so every figure, depends on these flags (bench/README.md says by how much)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())  # the first core's
    except OSError:
        pass
    if "model name" not in fields:
        return platform.processor() or platform.machine()
    flags = set(fields.get("flags", "").split())
    vector = "AVX-512" if "avx512f" in flags else "AVX2, no AVX-512" if "avx2" in flags else "no AVX2"
    vector = ", ".join([vector] + [name for flag, name in VECTOR_EXTENSIONS if flag in flags])
    family, model = fields.get("cpu family"), fields.get("model")
    return f"{fields['model name']} (family {family}, model {model}; {vector})"


def usable_cores() -> int:
    # sched_getaffinity, not cpu_count: a container or taskset may give us fewer cores than the host has.
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# Settings that hold torch's, oneDNN's, MKL's and raylane's kernels to fewer vector extensions than the
# CPU has: `ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2` times an AVX2-only CPU's code on this one.
ISA_LIMITS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def machine_info() -> dict[str, Any]:
    """The machine line of a benchmark that runs a model in its own process; the CPU's name says so
    when the kernels were held to fewer vector extensions (`ISA_LIMITS`)."""
    import torch

    limits = [f"{name}={os.environ[name]}" for name in ISA_LIMITS if os.environ.get(name)]
    held = f" [kernels held back: {', '.join(limits)}]" if limits else ""
    return {
        "cpu": cpu_model() + held,
        "cores": usable_cores(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def client_machine() -> dict[str, Any]:
    """The machine line of an HTTP client benchmark (`bench serve`, `bench compare`): the machine the
    client runs on, which is the servers' too when the command starts them. The installed torch's
    version is read from the package metadata, so a client does not pay torch's import."""
    try:
        torch_version: str | None = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = None
    return {
        "cpu": cpu_model(),
        "cores": usable_cores(),
        "torch": torch_version,
        "python": platform.python_version(),
    }


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(wall seconds, result) of one call."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


class OtherLoad:
    """How much CPU other processes took while a block ran, as a fraction of all cores' time.

    Other sessions' processes may share these cores without showing in `ps` (another PID namespace),
    and on two cores they can double a step's time; so a benchmark reports this next to its numbers.
    Measured as busy jiffies system-wide (/proc/stat) minus this process's own CPU time.
    """

    def __init__(self, own_cpu_s: Callable[[], float] = time.process_time):
        # What counts as "own": this process (default), or `process_tree_cpu_s` when the benchmark's
        # server runs in child processes (an in-process Ray: raylet, Serve proxy, replicas).
        self._own_cpu_s = own_cpu_s

    def __enter__(self) -> "OtherLoad":
        self.fraction: float | None = None
        self._start = (_busy_and_total_s(), self._own_cpu_s())
        return self

    def __exit__(self, *exc: object) -> None:
        (busy0, total0), own0 = self._start
        (busy1, total1), own1 = _busy_and_total_s(), self._own_cpu_s()
        if total1 > total0:
            self.fraction = max(0.0, (busy1 - busy0) - (own1 - own0)) / (total1 - total0)


def process_tree_cpu_s(root: int | None = None) -> float:
    """CPU seconds (user + system) of process `root` (default: this one) and all its descendants, from
    /proc; with an in-process Ray these are the raylet, GCS, Serve proxy and replicas. Descendants that
    exited count once their parent has reaped them (the parent's cutime/cstime)."""
    return sum(own + reaped for _, own, reaped, _ in _process_tree(root).values())


def process_tree_cpu_by_name(root: int | None = None) -> dict[str, float]:
    """CPU seconds (user + system) of `root` (default: this one) and of each of its descendants, by
    the name their command line gives them (`process_name`), processes of one name summed."""
    names: dict[str, float] = {}
    for pid, (_, own, _, cmdline) in _process_tree(root).items():
        name = process_name(cmdline) if pid != (root or os.getpid()) else "this process"
        names[name] = names.get(name, 0.0) + own
    return names


def process_tree_pss_mib(root: int | None = None, shmem: bool = True) -> dict[int, tuple[int, str, float]]:
    """pid -> (parent pid, `process_name`, proportional set size in MiB) of `root` (default: this
    process) and its descendants: memory that processes share (a forkserver's imports, libraries)
    counts once between them, split evenly. `shmem=False` leaves out shared-memory mappings: Ray's
    object store, whose pages a process maps as large arguments pass through it (Ray's, bounded by
    its `object_store_memory` and reused), not memory the process holds."""
    out = {}
    for pid, (ppid, _, _, cmdline) in _process_tree(root).items():
        try:
            rollup = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
        except OSError:
            continue  # exited meanwhile
        fields = {line.split(":")[0]: int(line.split()[1]) for line in rollup[1:]}
        pss_kib = fields.get("Pss", 0) - (0 if shmem else fields.get("Pss_Shmem", 0))
        out[pid] = (ppid, process_name(cmdline), pss_kib / 1024)
    return out


def process_name(cmdline: list[str]) -> str:
    """A process's role from its command line: a Ray worker's title (`ray::ServeReplica:app:Gateway`
    -> `ServeReplica:app:Gateway`), a Python module or script (`-m raylane.engine.core_proc` ->
    `raylane.engine.core_proc`; `python` for `-c` code), else the program's file name (`gcs_server`,
    `llama-server`, whose own `-m` names its model)."""
    if not cmdline:
        return "?"
    if cmdline[0].startswith("ray::"):
        return cmdline[0].removeprefix("ray::").split()[0].split(".")[0]
    if not Path(cmdline[0]).name.startswith("python"):
        return Path(cmdline[0]).name
    args = iter(cmdline[1:])
    for arg in args:  # the interpreter's options, up to the module, the code or the script
        if arg == "-m":
            return next(args, "python")
        if arg == "-c" or not arg.startswith("-"):
            return "python" if arg == "-c" else Path(arg).name
        if arg in ("-X", "-W"):
            next(args, None)  # the option's value
    return "python"


def _process_tree(root: int | None) -> dict[int, tuple[int, float, float, list[str]]]:
    """pid -> (parent pid, own CPU seconds, reaped children's CPU seconds, command line) of `root`
    (default: this process) and its descendants, from /proc."""
    root = os.getpid() if root is None else root
    table: dict[int, tuple[int, float, float, list[str]]] = {}
    ticks = os.sysconf("SC_CLK_TCK")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # Fields after the command name (which may hold spaces): state ppid ... then utime, stime,
            # cutime, cstime (fields 14-17 of proc(5)).
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
        except (OSError, IndexError):
            continue  # exited meanwhile
        own, reaped = (int(fields[11]) + int(fields[12])) / ticks, (int(fields[13]) + int(fields[14])) / ticks
        table[int(entry.name)] = (int(fields[1]), own, reaped, cmdline)
    tree = {}
    for pid, row in table.items():
        ancestor, hops = pid, 0
        while ancestor not in (root, 0, 1) and hops < 64:
            ancestor, hops = table[ancestor][0] if ancestor in table else 0, hops + 1
        if ancestor == root:
            tree[pid] = row
    return tree


def _busy_and_total_s() -> tuple[float, float]:
    """(busy, total) CPU seconds of all cores since boot; (0, 0) where /proc/stat is missing."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except OSError:
        return 0.0, 0.0
    ticks = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields) - idle) / ticks, sum(fields) / ticks


def summary(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def print_table(headers: list[str], rows: list[list[str]]) -> None:
    """A plain-text table, columns right-aligned except the first, markdown-compatible."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]

    def line(cells: list[str]) -> str:
        pairs = enumerate(zip(cells, widths, strict=True))
        out = [str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in pairs]
        return "| " + " | ".join(out) + " |"

    print(line(headers))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print(line(row))


def client_result(benchmark: str, args: Any, **figures: Any) -> dict[str, Any]:
    """A client-side benchmark's JSON: its name, the date, the machine that ran the client, the
    options it ran with (paths as text) and its figures."""
    return {
        "benchmark": benchmark,
        "date": datetime.date.today().isoformat(),
        "client_machine": client_machine(),
        "options": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "func"},
        **figures,
    }


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def pyplot():
    """matplotlib's pyplot on the Agg backend: benchmarks run on headless machines and Ray workers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
