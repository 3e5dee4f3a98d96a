"""raylane's own CPU kernels (`csrc/*.cpp`), compiled on first use on each machine.

- `paged_decode.cpp`: decode attention reading the KV pages in place, the `cpu_paged` attention
  backend (models/attention.py). The torch backend gathers every decoding request's context into a
  tensor padded to the batch's longest and runs SDPA with a mask; at sixteen streams of mixed
  lengths most of that is padding and copying.
- `layer_ops.cpp`: a decoder layer's small float32 ops fused for eager steps (RMSNorm with the residual
  add before it, SiLU-and-multiply, rotary embedding): several torch ops each otherwise, whose
  dispatch is a good part of a one-stream decode step (`fuses_layer_ops`).
- `quantized_gemv.cpp`: int4 (Q4_1) and int8 weight products for decode-sized calls
  (parallel/int4.py, parallel/quantization.py), the activations quantized to int8 per 32 inputs and
  multiplied in int32 with VNNI (AVX-512 VNNI or AVX-VNNI; AVX2's vpmaddubsw otherwise), as llama.cpp
  does; torch's CPU int4 and int8 kernels take bfloat16 activations and multiply in float.
bench/README.md ("raylane's CPU kernels") has the measurements.

All sources build into one library, once per machine: torch keeps the build in its extensions
folder (`TORCH_EXTENSIONS_DIR`, default ~/.cache/torch_extensions), about 30 s on two cores. It is
compiled for the CPU it runs on (`-march=native`: AVX-512 where there is one, AVX2 otherwise), so the
build's name carries this CPU's flags. Where torch's kernels are held to AVX2 (`ATEN_CPU_CAPABILITY=avx2`)
so are these, which times an AVX2-only CPU's code paths on an AVX-512 one (bench/README.md). Where
it cannot be built (no C++ compiler or ninja) the callers keep torch's kernels and say why.
"""

import contextlib
import hashlib
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.cpp"))
HEADERS = sorted((Path(__file__).parent / "csrc").glob("*.h"))
# Reassociation lets the compiler vectorize the kernels' sums and the softmax's exp; they keep no
# NaN/inf or signed-zero semantics beyond the -inf start of a running max.
CFLAGS = [
    "-O3",
    "-march=native",
    *(["-mno-avx512f"] if torch.backends.cpu.get_cpu_capability() == "AVX2" else []),
    # OpenMP: ATen's parallel_for (a header template) runs on the calling thread in code compiled
    # without it. The library links the libgomp torch has loaded (same soname), not a second runtime.
    "-fopenmp",
    "-fno-math-errno",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
]

_lock = threading.Lock()
_why_not: str | None = "not built yet"


def _build_name() -> str:
    """The build's name: the sources, the flags, torch's version and this CPU's extensions."""
    try:
        cpu = next(
            line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")
        )
    except (OSError, StopIteration):
        cpu = ""
    text = "\n".join([*(s.read_text() for s in SOURCES + HEADERS), " ".join(CFLAGS), torch.__version__, cpu])
    return "raylane_cpu_" + hashlib.sha256(text.encode()).hexdigest()[:16]


def why_not_available() -> str | None:
    """None once the kernels are loaded in this process (building them on first use), else why not."""
    global _why_not
    with _lock:
        if _why_not == "not built yet":
            try:
                from torch.utils.cpp_extension import load

                with _packaged_ninja_first():
                    load(
                        _build_name(),
                        [str(s) for s in SOURCES],
                        extra_cflags=CFLAGS,
                        extra_ldflags=["-fopenmp"],
                        is_python_module=False,
                    )
                _register_fakes()
                if (used := torch.ops.raylane_cpu.parallel_threads()) < torch.get_num_threads():
                    logger.warning(
                        "raylane's C++ kernels run on %d of torch's %d threads", used, torch.get_num_threads()
                    )
                _why_not = None
            except Exception as error:  # noqa: BLE001 - no compiler, no ninja, a failed build: say so
                _why_not = f"raylane's C++ kernels did not build: {error}"
                logger.warning("%s", _why_not)
        return _why_not


@contextlib.contextmanager
def _packaged_ninja_first() -> Iterator[None]:
    """torch runs `ninja` from PATH: for the build, the `ninja` package's (a dependency) goes first,
    in every process. Otherwise a process started with the environment's bin folder on PATH
    (`raylane serve`) and one without it (a Ray worker of `pytest`, beside a system ninja-build) run
    two ninja versions on one build folder; they hash commands differently in its build log (ninja
    1.12 changed the hash), so each rebuilds all the kernels (~30 s of both cores) after the other."""
    try:
        import ninja
    except ImportError:
        yield
        return
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + path
    try:
        yield
    finally:
        os.environ["PATH"] = path


def load() -> None:
    """Load the kernels (built on first use), or raise saying why not. Called outside compiled graphs."""
    if (why_not := why_not_available()) is not None:
        raise RuntimeError(why_not)


_gemv: bool | None = None


def quantized_gemv_supported() -> bool:
    """Whether this CPU runs the quantized kernels (x86 with AVX2, FMA and F16C) and they are loaded.
    Answered once (at weight quantization, before any compile): later calls only read a global, which
    torch.compile traces as a constant."""
    global _gemv
    if _gemv is None:
        _gemv = why_not_available() is None and bool(torch.ops.raylane_cpu.quantized_gemv_supported())
    return _gemv


_layer_ops: bool | None = None


def fuses_layer_ops(x: torch.Tensor) -> bool:
    """Whether a layer's norms, activation and rotary on `x` run in `layer_ops.cpp`: eager float32 on
    CPU where the kernels load. torch.compile fuses those ops itself, so its graphs keep torch's."""
    global _layer_ops
    if x.device.type != "cpu" or x.dtype != torch.float32 or torch.compiler.is_compiling():
        return False
    if _layer_ops is None:
        _layer_ops = why_not_available() is None
    return _layer_ops


def _register_fakes() -> None:
    """Shapes for torch.compile (engine/compiled_decode.py), which calls the kernels as they are."""

    @torch.library.register_fake("raylane_cpu::paged_decode")
    def _(q, k_cache, v_cache, block_tables, context_lens, scale, window):
        return torch.empty_like(q)

    @torch.library.register_fake("raylane_cpu::int4_gemv")
    def _(x, codes, scale, minimum):
        return x.new_empty(x.shape[0], codes.shape[0])

    @torch.library.register_fake("raylane_cpu::int8_gemv")
    def _(x, weight, scale):
        return x.new_empty(x.shape[0], weight.shape[0])
