#!/usr/bin/env bash
# Build the wheel folder that bench/gpu.sh installs from on a GPU machine that cannot reach PyPI (docs/gpu.md).
#
# Run it on a machine with this project's .venv and network, then carry the folder (and the repository) to the GPU
# machine; bench/gpu.sh finds it at ./wheels (or $WHEELS) and installs only what is missing there:
#
#     bench/gpu_wheels.sh                         # -> wheels/ (git-ignored), for Python 3.10-3.13 on Linux x86-64
#     GPU_PYTHON=3.12 bench/gpu_wheels.sh /shared/streakline-wheels
#
# What goes in: the packages gpu.sh's parts import (ROOTS) and everything they require, at the versions installed in
# .venv (so the GPU machine runs what the tests here ran), minus what any CUDA PyTorch machine with transformers
# already has (SKIP: torch and its CUDA libraries, numpy, pandas, pyarrow, transformers and its tokenizer/hub stack;
# they are large, and a torch built for the GPU must not be replaced by this machine's CPU build). Binary wheels are
# downloaded for each Python version in GPU_PYTHON (`python3 -V` on the GPU machine; pip there picks its own), and
# the packages PyPI ships only as source (deepspeed, antlr4-python3-runtime) are built here into pure-Python wheels:
# deepspeed with --no-build-isolation against .venv's torch and no ops compiled (it compiles the ones a run needs
# just in time; the parts here need none). About 15 MB.
set -euo pipefail
cd "$(dirname "$0")/.."

DEST=${1:-wheels}
PY=${PYTHON:-.venv/bin/python}
GPU_PYTHON=${GPU_PYTHON:-3.10 3.11 3.12 3.13}
ROOTS=${WHEELS_ROOTS:-deepspeed hydra-core omegaconf datasets pydantic pytest pytest-timeout}
SKIP=${WHEELS_SKIP:-'torch|triton|nvidia-.*|cuda-.*|numpy|pandas|pyarrow|transformers|tokenizers|safetensors|hf-xet|huggingface-hub|setuptools|pip|wheel|sympy|networkx|jinja2|markupsafe|mpmath'}

mkdir -p "$DEST"
# The requirement closure of ROOTS from .venv's installed metadata, pinned to the installed versions. Markers are
# judged for Linux x86-64 CPython (the version does not change any marker in this closure); extras are not followed.
pins=$("$PY" - "$ROOTS" "$SKIP" <<'EOF'
import importlib.metadata as md
import re
import sys

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

roots, skip = sys.argv[1].split(), re.compile(sys.argv[2])
env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux", "platform_system": "Linux",
       "platform_machine": "x86_64", "os_name": "posix", "implementation_name": "cpython",
       "platform_python_implementation": "CPython", "extra": ""}
seen, todo = {}, list(roots)
while todo:
    name = canonicalize_name(todo.pop())
    if name in seen or skip.fullmatch(name):
        continue
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        sys.exit(f"{name} is not installed in this environment; run `make setup` first")
    seen[name] = dist.version
    todo += [r.name for r in map(Requirement, dist.requires or []) if r.marker is None or r.marker.evaluate(env)]
print(" ".join(f"{n}=={v}" for n, v in sorted(seen.items())))
EOF
)
echo "pinned: $pins"

# pip download matches manylinux tags exactly, so name every glibc level a wheel may be built for.
platforms=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
for n in $(seq 5 39); do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
binary() {  # binary <python version> <pins...>: wheels for that Python, no dependency resolution (the pins are it)
    local v=$1
    shift
    "$PY" -m pip download -q --no-deps --only-binary=:all: --implementation cp --python-version "$v" \
        "${platforms[@]}" -d "$DEST" "$@"
}

declare -A have=()
missing=()
for v in $GPU_PYTHON; do
    if binary "$v" $pins 2>/dev/null; then
        for p in $pins; do have[$p]=1; done
        continue
    fi
    for p in $pins; do  # one pin has no wheel for this Python: find which, keep the rest
        if binary "$v" "$p" 2>/dev/null; then have[$p]=1; else missing+=("$p for Python $v"); fi
    done
done
for p in $pins; do
    if [ -z "${have[$p]:-}" ]; then  # no wheel on PyPI at all: source only, build it here (pure Python)
        echo "building $p from source"
        "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$DEST" "$p"
    fi
done
# A wheel that exists for some versions only is worth a line: gpu.sh on such a Python would lack it.
for m in ${missing[@]+"${missing[@]}"}; do
    if [ -n "${have[${m%% for *}]:-}" ]; then echo "note: no wheel of $m (only for other versions)"; fi
done
echo "$(find "$DEST" -name '*.whl' | wc -l) wheels, $(du -sh "$DEST" | cut -f1) in $DEST"
echo "carry $DEST to the GPU machine's checkout (as ./wheels, or point WHEELS at it) and run: bash bench/gpu.sh"
