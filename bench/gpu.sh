#!/usr/bin/env bash
# The prepared GPU check: one command, run as is from the repository root on a machine with one CUDA GPU
# (meant to take under 7 minutes on an H200), that checks what this project can only check on a GPU (docs/gpu.md):
#
#   setup           installs the packages the parts import and the machine lacks, from a carried wheel folder
#                   (./wheels or $WHEELS, built by bench/gpu_wheels.sh), then builds the micro world
#                   (stage=bootstrap model=micro) and its trajectories in a fresh run root
#   kernel_tests    python -m pytest tests/decoding/kernels tests/models/test_attention.py tests/decoding/test_engines.py
#                   (compiled Triton; flash / efficient attention; CUDA graphs give the eager tokens)
#   bench_kernels   python bench/triton_kernels.py: Triton against torch for the decoder kernels
#   gpu_decode      python bench/gpu_decode.py: bandwidth, roofline, vanilla / transformers tokens/s, speculative
#                   cycle cost at the real 7B / 14B shapes, against the speed goals (also as gpu_decode.json)
#   distill_zero2   stage=distill on the micro world under DeepSpeed ZeRO-2, bf16, NCCL, one rank, 4 steps
#   distill_zero3   the same under ZeRO-3
#                   (each distill prints the plan's peak against the free memory at its start and against
#                   torch.cuda.max_memory_allocated / reserved at its end; the summary repeats those lines)
#   decode          stage=decode on the micro world, vanilla and diffusion_draft; their tokens must be equal (T=0)
#   dflash          a DFlash drafter (micro-dflash) trained with dflash_ce under ZeRO-2 in bf16, then decoded with
#                   dflash_draft: its tokens must be vanilla's (T=0)
#   dflash_zero3    the same under ZeRO-3: the held-out check runs on the export gathered to the CPU
#
#     bash bench/gpu.sh                           # logs in runs/gpu_check/<part>.log, a summary at the end
#     OUT=/tmp/check PYTHON=python3 bash bench/gpu.sh
#     ONLY="distill_zero3 dflash_zero3" bash bench/gpu.sh   # only these parts (and setup): rerun what failed
#
# Each part writes its log to $OUT/<part>.log (default runs/gpu_check) and has a time limit (TIMEOUT_SCALE=2 doubles
# them all); a failing part does not stop the others, and the summary gives each part's exit status and seconds.
# Without CUDA the script runs what works on a CPU (the kernel tests under TRITON_INTERPRET=1, gpu_decode.py at tiny
# shapes, distill in fp32 on gloo, decode) and names the parts it skipped; that is its dry run.
# Python: $PYTHON, else .venv/bin/python if there is one, else python3. The micro world goes to a temporary run
# root, removed at the end (RUN_ROOT=<dir> keeps it there), so every run trains and decodes afresh.
# GPU_DECODE_ARGS adds options to gpu_decode.py (e.g. "--engines graphs static eager --budget-s 300").
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
PARTS=(setup kernel_tests bench_kernels gpu_decode distill_zero2 distill_zero3 decode dflash dflash_zero3)
for p in "${PARTS[@]}"; do rm -f "$OUT/$p.log"; done  # a part that fails early must not leave an old log standing
rm -f "$OUT/gpu_decode.json"
WHEELS=${WHEELS:-wheels}
SCALE=${TIMEOUT_SCALE:-1}
source bench/_python.sh  # PY: $PYTHON, else .venv/bin/python, else python3
if [ -n "${RUN_ROOT:-}" ]; then
    mkdir -p "$RUN_ROOT"
else
    RUN_ROOT=$(mktemp -d "${TMPDIR:-/tmp}/streakline-gpu-check.XXXXXX")
    trap 'rm -rf "$RUN_ROOT"' EXIT
fi
# bench/ scripts import streakline from this checkout even where it is not pip-installed (a carried tree).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export WANDB_MODE=offline HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PY WHEELS RUN_ROOT OUT

GPU=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
if [ "$GPU" = 1 ]; then
    PRECISION=()  # the trainer presets' bf16
    # graphs first (the engine the goals are about), eager as the before; static sits between them and would cost a
    # minute more. The budget keeps the part inside its limit even when an engine is slow or broken.
    DECODE_BENCH=(--engines graphs eager --repeats 2 --budget-s 120)
else
    PRECISION=(trainer.precision=fp32)  # bf16 ZeRO is a GPU check; on a CPU the tests' own setting
    DECODE_BENCH=(--shapes tiny)
fi
# The micro world's trajectories and a distill run of a few steps: enough to start, step, save, export and evaluate.
WORLD=(model=micro "run_root=$RUN_ROOT" experiment.name=gpu_check data.max_prompts=8 data.samples_per_prompt=1
    data.max_new_tokens=16 data.num_shards=1 data.batch_size=8)
TRAIN=(trainer.max_steps=4 trainer.micro_batch_size=2 trainer.warmup_steps=1 trainer.save_every=4
    trainer.eval_every=4 trainer.log_every=1 trainer.eval_prompts=1 trainer.windows_per_seq=2
    trainer.wandb_project=null)

names=() rcs=() secs=() notes=()
record() { names+=("$1"); rcs+=("$2"); secs+=("$3"); notes+=("$4"); }

part() {  # part <name> <limit s> <command...>: run it with its output in $OUT/<name>.log
    local name=$1 limit=$(($2 * SCALE)) t0=$SECONDS rc note=""
    shift 2
    if [ -n "${ONLY:-}" ] && [ "$name" != setup ] && [[ " $ONLY " != *" $name "* ]]; then
        skip "$name" "not in ONLY"
        return
    fi
    echo "== $name (limit ${limit}s, log $OUT/$name.log)"
    if command -v timeout > /dev/null; then
        timeout --kill-after=15 "$limit" "$@" > "$OUT/$name.log" 2>&1
    else
        "$@" > "$OUT/$name.log" 2>&1
    fi
    rc=$?
    if [ $rc = 124 ] || [ $rc = 137 ]; then note="timed out after ${limit}s"; fi
    tail -n 4 "$OUT/$name.log" | sed 's/^/   | /'
    record "$name" "$rc" $((SECONDS - t0)) "$note"
}

skip() {  # skip <name> <reason>
    echo "== $1: skipped ($2)"
    record "$1" "-" 0 "skipped: $2"
}

missing_packages() {
    # What the parts import (found by running them and listing sys.modules), module: pip name. wandb, ray, peft and
    # submitit are not among them: W&B is off (trainer.wandb_project=null) and nothing here uses Ray or LoRA.
    "$PY" - << 'EOF'
import importlib.util

need = {"deepspeed": "deepspeed", "hydra": "hydra-core", "omegaconf": "omegaconf", "datasets": "datasets",
        "pydantic": "pydantic", "pyarrow": "pyarrow", "pandas": "pandas", "transformers": "transformers",
        "safetensors": "safetensors", "tokenizers": "tokenizers", "tqdm": "tqdm", "yaml": "pyyaml",
        "pytest": "pytest", "pytest_timeout": "pytest-timeout"}
print(" ".join(pip for mod, pip in need.items() if importlib.util.find_spec(mod) is None))
EOF
}

setup() {
    echo "python: $PY ($("$PY" -V 2>&1)); run root: $RUN_ROOT"
    local missing
    missing=$(missing_packages)
    if [ -n "$missing" ]; then
        echo "missing here: $missing"
        if [ ! -d "$WHEELS" ]; then
            echo "no wheel folder at $WHEELS: build one with bench/gpu_wheels.sh on a machine with PyPI and carry it"
        elif ! "$PY" -m pip install --no-index --find-links "$WHEELS" $missing; then
            # The resolver can refuse over a pin this machine's packages do not meet (an older pyarrow, say); the
            # wheels were tested together on the CPU machine, so install the folder's missing packages without it.
            echo "pip's resolver refused; installing the folder's missing packages with --no-deps"
            local all
            all=$("$PY" - "$WHEELS" << 'EOF'
import importlib.metadata as md
import pathlib
import sys

names = {w.name.split("-")[0].replace("_", "-").lower() for w in pathlib.Path(sys.argv[1]).glob("*.whl")}
have = {(d.metadata["Name"] or "").replace("_", "-").lower() for d in md.distributions()}
print(" ".join(sorted(names - have)))
EOF
            )
            "$PY" -m pip install --no-index --no-deps --find-links "$WHEELS" $all
        fi
        missing=$(missing_packages)
        if [ -n "$missing" ]; then
            echo "still missing: $missing (the parts that import them will fail)"
        fi
    fi
    "$PY" - << 'EOF'
import importlib.metadata as md

import torch

gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPU: {gpu}")
for name in ("triton", "transformers", "deepspeed", "hydra-core", "datasets", "pyarrow", "pydantic"):
    try:
        print(f"  {name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"  {name} MISSING")
EOF
    "$PY" launch.py stage=bootstrap model=micro "run_root=$RUN_ROOT" &&
        "$PY" launch.py stage=trajectories "${WORLD[@]}"
}

like_vanilla() {  # like_vanilla <decode overrides...>: stage=decode with them gives vanilla's greedy tokens
    local v d rc=0
    v=$("$PY" launch.py stage=decode "${WORLD[@]}" decoder=vanilla 'prompt_ids=[5,6,7]' decoder.max_new_tokens=16) ||
        rc=1
    printf 'vanilla:\n%s\n' "$v"
    d=$("$PY" launch.py stage=decode "${WORLD[@]}" "$@" 'prompt_ids=[5,6,7]' decoder.max_new_tokens=16) || rc=1
    printf '%s:\n%s\n' "$*" "$d"
    [ $rc = 0 ] || return 1
    # The last line of each is its JSON metrics line; at temperature 0 every decoder gives the verifier's tokens.
    "$PY" -c 'import json, sys
a, b = (json.loads(s.strip().splitlines()[-1])["token_ids"] for s in sys.argv[1:])
print("tokens equal:", a == b)
sys.exit(a != b)' "$v" "$d"
}

decode() {
    like_vanilla decoder=diffusion_draft
}

dflash() {  # dflash [zero2|zero3]: a DFlash drafter (micro-dflash) trained under that ZeRO stage in the trainer's
    # precision (under ZeRO-3 its held-out check runs on the gathered export), then decoded losslessly
    local out folder
    out=$("$PY" launch.py stage=distill "${WORLD[@]}" "${TRAIN[@]}" model.drafter=micro-dflash method=dflash_ce \
        "trainer=${1:-zero2}" ${PRECISION[@]+"${PRECISION[@]}"} 2>&1)
    local rc=$?
    echo "$out"
    [ $rc = 0 ] || return 1
    folder=$(echo "$out" | sed -n 's/^distill: drafter in //p' | tail -n 1)
    [ -n "$folder" ] || { echo "no drafter folder in the distill output"; return 1; }
    like_vanilla model.drafter=micro-dflash decoder=dflash_draft "model.drafter.path=$folder"
}
export -f missing_packages setup like_vanilla decode dflash

t_all=$SECONDS
where=$("$PY" -c 'import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else "")' 2>&1)
echo "gpu check on ${where:-a machine without CUDA (the CPU dry run)}; logs in $OUT"
# Arrays do not cross into the `bash -c` of a timed function: pass them through declare.
part setup 180 bash -c "$(declare -p WORLD); setup"
# the Triton kernels, the attention paths and the engines (CUDA graphs against eager, token for token)
part kernel_tests 180 "$PY" -m pytest tests/decoding/kernels tests/models/test_attention.py \
    tests/decoding/test_engines.py -q
if [ "$GPU" = 1 ]; then
    part bench_kernels 60 "$PY" bench/triton_kernels.py
else
    skip bench_kernels "needs a CUDA GPU: it times compiled Triton kernels"
fi
# GPU_DECODE_ARGS: more options for it, split on spaces on purpose (e.g. "--engines graphs static eager")
part gpu_decode 200 "$PY" bench/gpu_decode.py "${DECODE_BENCH[@]}" ${GPU_DECODE_ARGS:-} --json "$OUT/gpu_decode.json"
part distill_zero2 90 "$PY" launch.py stage=distill "${WORLD[@]}" "${TRAIN[@]}" trainer=zero2 ${PRECISION[@]+"${PRECISION[@]}"}
part distill_zero3 90 "$PY" launch.py stage=distill "${WORLD[@]}" "${TRAIN[@]}" trainer=zero3 ${PRECISION[@]+"${PRECISION[@]}"}
part decode 90 bash -c "$(declare -p WORLD); decode"
part dflash 120 bash -c "$(declare -p WORLD TRAIN PRECISION); dflash zero2"
part dflash_zero3 120 bash -c "$(declare -p WORLD TRAIN PRECISION); dflash zero3"

echo
echo "summary ($((SECONDS - t_all)) s; logs in $OUT)"
printf '%-15s %4s %6s  %s\n' part rc seconds note
failed=0
for i in "${!names[@]}"; do
    printf '%-15s %4s %6s  %s\n' "${names[$i]}" "${rcs[$i]}" "${secs[$i]}" "${notes[$i]}"
    if [ "${rcs[$i]}" != "-" ] && [ "${rcs[$i]}" != 0 ]; then failed=1; fi
done
if [ -f "$OUT/gpu_decode.log" ]; then
    echo
    sed -n '/^summary of the speed goals/,$p' "$OUT/gpu_decode.log"
fi
# the planner against the measured CUDA peak (pipelines/distill.py prints it at the end of every GPU distill)
plan_lines=$(grep -h "the plan's peak on\|the plan said" "$OUT"/distill_zero2.log "$OUT"/distill_zero3.log "$OUT"/dflash.log \
    "$OUT"/dflash_zero3.log 2>/dev/null)
if [ -n "$plan_lines" ]; then
    echo
    echo "the plan against the measured peaks (docs/planning.md):"
    echo "$plan_lines"
fi
if [ "$GPU" != 1 ]; then
    echo "no CUDA here: bench_kernels was skipped; kernel_tests ran under TRITON_INTERPRET=1, gpu_decode at tiny"
    echo "shapes in fp32 and distill in fp32 on gloo. The GPU check proper (compiled Triton, real 7B/14B shapes, bf16"
    echo "ZeRO-2/3 on NCCL, CUDA graphs) needs a CUDA machine: docs/gpu.md."
fi
exit $failed
