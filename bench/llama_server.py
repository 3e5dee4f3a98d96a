"""llama.cpp's C++ `llama-server`, the CPU anchor of `raylane bench compare --llama-server-a GGUF`.

The binary is built once from the llama.cpp sources vendored in the `llama-cpp-python` sdist on PyPI
(pinned by `LLAMA_CPP_PYTHON_VERSION`, so every machine builds the same server), with cmake, Release,
CPU only, `-march=native`, llama.cpp's own libraries linked in, into a cache folder:

    ~/.cache/raylane/llama.cpp/<version>/bin/llama-server   ($RAYLANE_LLAMA_CPP_DIR replaces the root)

A started server logs to ~/.cache/raylane/llama.cpp/logs/llama-server-<port>.log.

The build runs under `nice -n 10` with two jobs: about 15 minutes on two quiet cores, 41 on two cores
shared with other work (2026-12-02); a second call finds the binary and returns at once. Only
benchmarks use it: no test builds or runs it.

    python -m raylane.bench.llama_server build               # build (or find) the binary, print its path
    python -m raylane.bench.llama_server serve FILE.gguf     # start it on a free port until Ctrl-C

`LlamaServer` starts it with the settings of the side-by-side benchmark: `-np 16` parallel slots
(continuous batching), `-t 2` threads, a context of slots x tokens per slot, on 127.0.0.1.
"""

import argparse
import contextlib
import datetime
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

# The llama-cpp-python release whose vendored llama.cpp is built; change it to move the anchor.
LLAMA_CPP_PYTHON_VERSION = "0.3.36"

# Release, CPU only, tuned for this CPU, one static binary; nothing fetched at configure time (the
# web UI would be downloaded from Hugging Face, HTTPS would need OpenSSL, model download needs curl).
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DGGML_CUDA=OFF",
    "-DGGML_METAL=OFF",
    "-DGGML_VULKAN=OFF",
)


class LlamaServerError(RuntimeError):
    pass


def cache_root() -> Path:
    if os.environ.get("RAYLANE_LLAMA_CPP_DIR"):
        return Path(os.environ["RAYLANE_LLAMA_CPP_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "raylane" / "llama.cpp"


def binary_path(version: str = LLAMA_CPP_PYTHON_VERSION, root: Path | None = None) -> Path:
    return (root or cache_root()) / version / "bin" / "llama-server"


def cmake_executable() -> str:
    """cmake from PATH, else the one `pip install cmake` puts beside this interpreter."""
    found = shutil.which("cmake") or shutil.which("cmake", path=str(Path(sys.executable).parent))
    if not found:
        raise LlamaServerError("building llama-server needs cmake: pip install cmake (or apt install cmake)")
    return found


def build_commands(source: Path, build: Path, jobs: int, cmake: str = "cmake") -> list[list[str]]:
    """The configure and build commands, niced: the build shares its cores with whatever else runs."""
    nice = ["nice", "-n", "10"] if shutil.which("nice") else []
    return [
        [*nice, cmake, "-S", str(source), "-B", str(build), *CMAKE_FLAGS],
        [*nice, cmake, "--build", str(build), "--config", "Release", "--target", "llama-server", f"-j{jobs}"],
    ]


def download_sdist(version: str, dest: Path) -> Path:
    """The llama-cpp-python sdist from the package index, through pip (which honours its index settings)."""
    dest.mkdir(parents=True, exist_ok=True)
    name = f"llama_cpp_python-{version}.tar.gz"
    if (dest / name).exists():
        return dest / name
    cmd = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps"]
    run_logged([*cmd, "-d", str(dest), f"llama-cpp-python=={version}"], dest / "download.log")
    if not (dest / name).exists():
        raise LlamaServerError(f"pip download did not produce {dest / name}; see {dest / 'download.log'}")
    return dest / name


def vendored_source(sdist: Path, dest: Path) -> Path:
    """Unpack the sdist once; llama.cpp sits in its vendor/llama.cpp."""
    top = dest / sdist.name.removesuffix(".tar.gz")
    if not (top / "vendor" / "llama.cpp" / "CMakeLists.txt").exists():
        with tarfile.open(sdist) as tar:
            tar.extractall(dest, filter="data")
    source = top / "vendor" / "llama.cpp"
    if not (source / "CMakeLists.txt").exists():
        raise LlamaServerError(f"{sdist} has no vendor/llama.cpp")
    return source


def run_logged(cmd: list[str], log: Path) -> None:
    with open(log, "ab") as out:
        out.write(f"\n$ {' '.join(cmd)}\n".encode())
        out.flush()
        if subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
            raise LlamaServerError(f"`{' '.join(cmd[:6])} ...` failed; see {log}")


def ensure_built(version: str = LLAMA_CPP_PYTHON_VERSION, jobs: int = 2, quiet: bool = False) -> Path:
    """The cached llama-server binary, built first if absent (a lock keeps two builds apart)."""
    binary = binary_path(version)
    if binary.exists():
        return binary
    home = binary.parent.parent
    home.mkdir(parents=True, exist_ok=True)
    with open(home / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if binary.exists():  # another process built it while this one waited
            return binary
        log = home / "build.log"
        if not quiet:
            print(f"building llama-server {version} into {home} (about 15 min on 2 cores; log {log})")
        started = time.monotonic()
        source = vendored_source(download_sdist(version, home), home)
        build = home / "build"
        for cmd in build_commands(source, build, jobs, cmake_executable()):
            run_logged(cmd, log)
        built = build / "bin" / "llama-server"
        if not built.exists():
            raise LlamaServerError(f"the build finished without {built}; see {log}")
        binary.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built, binary.with_suffix(".tmp"))
        os.replace(binary.with_suffix(".tmp"), binary)  # present only once complete
        info = {
            "llama_cpp_python": version,
            "cmake_flags": list(CMAKE_FLAGS),
            "build_s": round(time.monotonic() - started),
            "built_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }
        (home / "build-info.json").write_text(json.dumps(info, indent=2) + "\n")
        if not quiet:
            print(f"built {binary} in {info['build_s']} s")
    return binary


@dataclass(slots=True)
class LlamaServer:
    """One llama-server process on a free port of 127.0.0.1, for the duration of a `with` block."""

    model: Path
    n_parallel: int = 16
    threads: int = 2
    ctx_per_slot: int = 2048  # prompt + answer tokens one slot holds; the context is slots x this
    binary: Path | None = None
    port: int | None = None
    startup_timeout_s: float = 300.0
    extra_args: tuple[str, ...] = ()
    log_path: Path | None = None
    _process: subprocess.Popen | None = field(default=None, init=False, repr=False)

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [
            str(self.binary or binary_path()),
            "-m",
            str(self.model),
            "-np",
            str(self.n_parallel),
            "-t",
            str(self.threads),
            "-c",
            str(self.n_parallel * self.ctx_per_slot),
            *self.extra_args,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]

    def start(self) -> "LlamaServer":
        from raylane.cluster.serve_env import free_port

        if not self.model.exists():
            raise LlamaServerError(f"{self.model}: no such GGUF file")
        if self.binary is None:
            self.binary = ensure_built()
        if self.port is None:
            self.port = free_port()
        if self.log_path is None:  # beside the binary, where a failed start's error stays readable
            self.log_path = cache_root() / "logs" / f"llama-server-{self.port}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self._process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT)
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_healthy(self) -> None:
        """Poll /health until it answers 200 (503 while the model loads); fail fast if the process exits."""
        deadline = time.monotonic() + self.startup_timeout_s
        last = "no answer"
        while time.monotonic() < deadline:
            if self._process is not None and self._process.poll() is not None:
                code = self._process.returncode
                raise LlamaServerError(f"llama-server exited with {code}; see {self.log_path}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except urllib.error.HTTPError as e:
                last = f"{e.code}"
            except (urllib.error.URLError, OSError) as e:
                last = repr(e)
            time.sleep(0.25)
        waited = f"{self.startup_timeout_s:g} s"
        raise LlamaServerError(f"{self.url}/health did not answer 200 in {waited}: {last}")

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def __enter__(self) -> "LlamaServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m raylane.bench.llama_server", description=__doc__.splitlines()[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="build llama-server once into the cache, print its path")
    build.add_argument("--version", default=LLAMA_CPP_PYTHON_VERSION, help="llama-cpp-python sdist version")
    build.add_argument("-j", "--jobs", type=int, default=2)
    serve = sub.add_parser("serve", help="start llama-server on a GGUF file until Ctrl-C")
    serve.add_argument("model", type=Path)
    serve.add_argument("--port", type=int)
    serve.add_argument("-np", "--parallel", type=int, default=16)
    serve.add_argument("-t", "--threads", type=int, default=2)
    serve.add_argument("--ctx-per-slot", type=int, default=2048)
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            print(ensure_built(args.version, args.jobs))
            return 0
        server = LlamaServer(args.model, args.parallel, args.threads, args.ctx_per_slot, port=args.port)
        with server:
            print(f"llama-server on {server.url}/v1 (log {server.log_path}); Ctrl-C stops it")
            with contextlib.suppress(KeyboardInterrupt):
                while True:
                    time.sleep(3600)
    except LlamaServerError as e:
        print(f"llama-server: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
