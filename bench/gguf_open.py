"""`raylane bench gguf-open`: what opening a GGUF checkpoint costs a process, with and without the sidecar.

The engine opens its checkpoint's config and tokenizer in several processes (the serving process, the
engine core, every rank). Two designs, each timed in fresh processes, alternated:
- direct: every process reads the GGUF's metadata with the `gguf` package and has transformers build
  the config and convert the tokenizer from it (what `from_pretrained(..., gguf_file=...)` does);
- sidecar (raylane's, models/gguf.py): the first process writes config, tokenizer and tensor index
  to a small folder once; every process then reads that folder as a checkpoint directory.
The weights are read from the GGUF file in both; only the metadata path differs.

    raylane bench gguf-open [--model smollm2-135m-instruct | --model FILE.gguf] [--repeats 3]
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from raylane.bench.common import machine_info, print_table, write_json

DIRECT = """
import sys, time
t = time.perf_counter()
from transformers import AutoConfig, AutoTokenizer
path = sys.argv[1]; folder, name = path.rsplit("/", 1)
AutoConfig.from_pretrained(folder, gguf_file=name); AutoTokenizer.from_pretrained(folder, gguf_file=name)
print(time.perf_counter() - t)
"""
SIDECAR = """
import sys, time
t = time.perf_counter()
from transformers import AutoConfig, AutoTokenizer
from raylane.models.gguf import checkpoint_dir
folder = checkpoint_dir(sys.argv[1])
AutoConfig.from_pretrained(folder); AutoTokenizer.from_pretrained(folder)
print(time.perf_counter() - t)
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a .gguf file or a packaged model")
    parser.add_argument("--repeats", type=int, default=3, help="timed opens per file")
    parser.add_argument("--out", type=Path, help="folder to write gguf_open.json into")


def run(args: argparse.Namespace) -> int:
    path = Path(args.model)
    if not path.is_file():
        from raylane.models.packaged import packaged_model_path

        path = packaged_model_path(args.model)
    cache = Path(tempfile.mkdtemp(prefix="raylane-gguf-bench-"))
    env = {"RAYLANE_CACHE_DIR": str(cache), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    try:
        first = _time(SIDECAR, path, env)  # writes the sidecar
        times: dict[str, list[float]] = {"direct": [], "sidecar": []}
        for _ in range(args.repeats):
            for name, script in (("direct", DIRECT), ("sidecar", SIDECAR)):
                times[name].append(_time(script, path, env))
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    machine = machine_info()
    print(f"machine: {machine['cpu']}, {machine['cores']} cores; model: {path.name}")
    rows = [
        ["direct (every process)", f"{statistics.median(times['direct']):.2f}"],
        ["sidecar, first process (writes it)", f"{first:.2f}"],
        ["sidecar, every later process", f"{statistics.median(times['sidecar']):.2f}"],
    ]
    print_table(["config + tokenizer, one fresh process", "seconds (median)"], rows)
    if args.out:
        result = {"machine": machine, "model": str(path), "first_sidecar_s": first, "times_s": times}
        write_json(args.out / "gguf_open.json", result)
    return 0


def _time(script: str, path: Path, env: dict[str, str]) -> float:
    """Seconds the script measured in a fresh interpreter (imports included: each process pays them)."""
    out = subprocess.run(
        [sys.executable, "-c", script, str(path)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    return float(out.stdout.strip().splitlines()[-1])
