"""Benchmark: the plan's peak (streakline/planning/) for CPU runs against the resident memory those runs take.

For each case the planner's per-device peak for the composed config (``cluster=cpu``, through
``planning.verdicts.plan_stage``, the function ``stage=plan`` prints) is set beside the increase in resident memory of
a process running that stage. Cases (``--cases``, default all):

- ``micro-distill``: ``stage=distill model=micro`` (trainer=cpu: fp32, ZeRO-0, micro batch 8 x 8 windows);
- ``tiny-distill``: ``stage=distill model=tiny``, the same trainer;
- ``micro-evaluate``: ``stage=evaluate model=micro``, vanilla and the base diffusion drafter on 4 tiny-math prompts
  of 64 new tokens;
- ``tiny-evaluate``: the same on the tiny world.

Every distill trains one epoch of 16 trajectories (``data.max_prompts=16``, one sample each, 128 new tokens: 32
steps), so the longest trajectory's last windows are in some micro batch, with the held-out check on (its verifier
is built). W&B is off in every case (``trainer.wandb_project=null``: a logging service, not the stage). The tiny
world is the shipped architecture (the same presets, so the same shapes) trained 2 steps per model instead of 15
minutes: memory depends on shapes, not on how well the models are trained. The plan's prompt length
(``settings.plan.prompt_tokens``) is set to the longest prompt of the trajectories the run reads, because the peak is
that of the longest micro batch.

Measurement: each case runs in a child process (``--child``). The child imports everything, runs the stage once at
one step (one prompt for evaluate: every lazy import, the process group, the tokenizer and data caches), deletes its
run folders, collects garbage and returns freed heap pages to the kernel (``malloc_trim(0)``), reads its resident set
size (``VmRSS``) as the baseline, resets the kernel's high-water mark (``/proc/self/clear_refs``, 5), runs the
measured stage and reads the high-water mark (``VmHWM``). The measured increase is ``VmHWM - baseline``: what the run
itself made resident at its worst moment, file-backed pages included (the weights a checkpoint is loaded into are
its memory-mapped pages until written). Each case runs twice: with glibc's malloc as it comes, and with
``MALLOC_MMAP_THRESHOLD_=131072`` (``heap returned``), which stops glibc from raising its mmap threshold as large
blocks are freed, so that a freed tensor goes back to the kernel instead of staying in the heap for reuse; the
difference between the two is the allocator's, which the plan does not model (docs/planning.md). Threads:
``OMP_NUM_THREADS=1`` unless set, so that the numbers do not depend on the core count (each extra OpenMP thread keeps
its own stack and scratch) and a shared machine measures the same. Not a test: nothing is asserted. Linux with glibc
only (``/proc``, ``malloc_trim``).

    python bench/plan_peaks.py                  # 6 min on 2 CPU cores; under 3 once the worlds are built
    python bench/plan_peaks.py --cases tiny-distill --root /tmp/peaks_runs
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported (see the docstring)
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import ctypes  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

MB = 2**20
HEAP_RETURNED = 131072  # glibc's initial mmap threshold, fixed: a freed block of 128 kB or more goes back at once
EXPERIMENT = "peaks"
# The shipped tiny world's presets (so its shapes) trained 2 steps a model: a cache entry of its own in --root.
TINY_QUICK = [
    *(f"model.world.{role}.steps=2" for role in ("verifier", "drafter", "target")),
    "model.world.report_prompts=2",
    "model.world.report_new_tokens=8",
]
WORLDS = {"micro": ["model=micro"], "tiny": ["model=tiny", *TINY_QUICK]}
DATA = {"data.max_prompts": 16, "data.samples_per_prompt": 1, "data.num_shards": 1}
DISTILL = {
    "trainer.max_steps": 32,  # one epoch: 16 trajectories x 128 offsets / 8 windows per example / 8 per batch
    "trainer.save_every": 32,
    "trainer.eval_every": 32,
    "trainer.eval_prompts": 2,
    "trainer.log_every": 8,
    "trainer.wandb_project": "null",
}
DISTILL_WARMUP = {"trainer.max_steps": 1, "trainer.save_every": 1, "trainer.eval_every": 1, "trainer.eval_prompts": 1}
EVALUATE = {
    "stage.methods": "[{name:vanilla,decoder:vanilla},{name:base,decoder:diffusion_draft}]",
    "stage.benchmarks": "[tiny-math]",
    "stage.prompts": 4,
    "stage.temperatures": "[0.0]",
    "stage.max_new_tokens": 64,
    "stage.k_grid": "[]",
    "stage.block": "false",
    "stage.figures": "false",
    "trainer.wandb_project": "null",
}
EVALUATE_WARMUP = {"stage.prompts": 1, "stage.max_new_tokens": 4}


@dataclass
class Case:
    world: str
    stage: str
    settings: dict = field(default_factory=dict)
    warmup: dict = field(default_factory=dict)


CASES = {
    "micro-distill": Case("micro", "distill", DISTILL, DISTILL_WARMUP),
    "tiny-distill": Case("tiny", "distill", DISTILL, DISTILL_WARMUP),
    "micro-evaluate": Case("micro", "evaluate", EVALUATE, EVALUATE_WARMUP),
    "tiny-evaluate": Case("tiny", "evaluate", EVALUATE, EVALUATE_WARMUP),
}


def overrides(case: Case, root: Path, *, warmup: bool = False) -> list[str]:
    """The command line of the case's run (or of its warm-up), as ``python launch.py`` would take it."""
    values = {**DATA, **case.settings, **(case.warmup if warmup else {})}
    return [f"stage={case.stage}", *WORLDS[case.world], f"run_root={root}", f"experiment.name={EXPERIMENT}",
            *(f"{k}={v}" for k, v in values.items())]  # fmt: skip


# ------------------------------------------------------------------------------------------------------ the child
def _status() -> dict[str, int]:
    """Memory figures of this process from ``/proc/self/status``, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def _settle() -> None:
    """Free what can be freed and hand glibc's free heap pages back to the kernel, so that the measured run's
    allocations show up as new resident pages instead of reusing pages the warm-up left behind."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def child(case_name: str, root: Path) -> dict:
    """Run the case's warm-up and then the measured stage in this process; the measurement as a dict."""
    import pyarrow.parquet as pq
    import torch

    from streakline.config import compose_config
    from streakline.pipelines import run_stage
    from streakline.pipelines.common.lookup import trajectories_dir

    case = CASES[case_name]
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    stage_dir = root / EXPERIMENT / case.stage
    run_stage(compose_config(overrides(case, root, warmup=True)))
    shutil.rmtree(stage_dir, ignore_errors=True)
    cfg = compose_config(overrides(case, root))
    _settle()
    base = _status()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS (Linux >= 4.0)
    t0 = time.perf_counter()
    run_stage(cfg)
    seconds = time.perf_counter() - t0
    end = _status()
    out = {"baseline": base["VmRSS"], "increase": end["VmHWM"] - base["VmRSS"], "seconds": seconds}
    if case.stage == "distill":  # cfg points at its world now (the runner attached it): the shards it read
        table = pq.read_table(trajectories_dir(cfg), columns=["prompt_ids", "completion_ids"])
        out["longest_prompt"] = max(len(p) for p in table.column("prompt_ids").to_pylist())
        out["longest_completion"] = max(len(c) for c in table.column("completion_ids").to_pylist())
    return out


# ----------------------------------------------------------------------------------------------------- the parent
def prepare(root: Path, worlds: set[str]) -> None:
    """The worlds and the trajectories the distill cases read (reused when already in ``root``)."""
    from streakline.config import compose_config
    from streakline.pipelines import run_stage

    for world in sorted(worlds):
        run_stage(compose_config(["stage=bootstrap", *WORLDS[world], f"run_root={root}"]))
        data = [f"{k}={v}" for k, v in DATA.items()]
        run_stage(compose_config(["stage=trajectories", *WORLDS[world], f"run_root={root}",
                                  f"experiment.name={EXPERIMENT}", *data]))  # fmt: skip


def _measure(name: str, root: Path, env: dict[str, str]) -> dict:
    """The child's measurement of case ``name`` (``env`` added to this process's environment)."""
    done = subprocess.run([sys.executable, __file__, "--child", name, "--root", str(root)],
                          capture_output=True, text=True, env={**os.environ, **env})  # fmt: skip
    line = next((x for x in done.stdout.splitlines() if x.startswith("PEAKS ")), None)
    if done.returncode or line is None:
        sys.exit(f"{name}: the child failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(line[len("PEAKS ") :])


def planned(case: Case, root: Path, measured: dict) -> tuple[int, dict[str, int]]:
    """The planner's peak per device for the case's composed config on ``cluster=cpu``, and its terms."""
    from streakline.config import compose_config
    from streakline.planning.stages import Shapes
    from streakline.planning.verdicts import plan_stage

    extra = []
    if "longest_prompt" in measured:
        extra.append(f"settings.plan.prompt_tokens={measured['longest_prompt']}")
    cfg = compose_config([*overrides(case, root), "cluster=cpu", *extra])
    plan = plan_stage(case.stage, cfg, Shapes(cfg))
    return plan.peak, plan.memory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--root", default="/tmp/peaks_runs", help="run_root: worlds, trajectories and runs")
    parser.add_argument("--terms", action="store_true", help="print each plan's terms under the table")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    root = Path(args.root).resolve()
    if args.child:
        print("PEAKS " + json.dumps(child(args.child, root)), flush=True)
        return
    names = [n.strip() for n in args.cases.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; choose from {', '.join(CASES)}")
    prepare(root, {CASES[n].world for n in names})
    rows = []
    for name in names:
        runs = [_measure(name, root, {}), _measure(name, root, {"MALLOC_MMAP_THRESHOLD_": str(HEAP_RETURNED)})]
        peak, terms = planned(CASES[name], root, runs[0])
        rows.append((name, peak, terms, runs))

    def ratio(peak: int, increase: int) -> str:
        r = peak / increase if increase > 0 else float("inf")
        return f"{r:>7.2f} {'yes' if abs(r - 1) <= 0.25 else 'no':>4}"

    print(f"threads {os.environ['OMP_NUM_THREADS']}, cluster=cpu, run_root {root}")
    print(
        f"{'case':<16}{'planned':>9}{'measured':>10}{'ratio':>7}{'25%':>5}{'heap returned':>15}{'ratio':>7}{'25%':>5}"
    )
    for name, peak, _, (default, returned) in rows:
        print(f"{name:<16}{peak / MB:>6.1f}MiB{default['increase'] / MB:>7.1f}MiB{ratio(peak, default['increase'])}"
              f"{returned['increase'] / MB:>12.1f}MiB{ratio(peak, returned['increase'])}")  # fmt: skip
    print("planned: plan_stage's peak on cluster=cpu; measured: VmHWM - VmRSS before the run; ratio: planned /")
    print(f"measured; 25%: within 25%; heap returned: measured with MALLOC_MMAP_THRESHOLD_={HEAP_RETURNED}")
    if args.terms:
        for name, _, terms, (m, _) in rows:
            longest = ""
            if "longest_prompt" in m:
                longest = f" (longest prompt {m['longest_prompt']}, completion {m['longest_completion']})"
            print(f"{name}{longest}: " + ", ".join(f"{k} {v / MB:.2f}" for k, v in terms.items()) + " MiB")


if __name__ == "__main__":
    main()
