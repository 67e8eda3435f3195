"""Stage ``sweep``: the nightly Figure 7. Evaluate every checkpoint of the experiment's distill runs that has not
been evaluated yet, append the points to a history file, and redraw speedup vs distillation steps.

    python launch.py stage=sweep experiment=nightly_fig7            # train (cached) + evaluate new checkpoints
    python launch.py stage=sweep model=tiny experiment=default      # only evaluate what this experiment has

``stage.train`` (``settings.sweep.train`` in an experiment file) lists distill runs to train first (each
``"method=<name> [overrides]"``; a finished run is a cache hit, so a nightly job that keeps the same list costs
nothing when nothing changed). Checkpoints are each run's ``checkpoints/step-*`` folders plus its final
``drafter/``, and step 0: the model preset's drafter before any distillation, evaluated once (the first night, or
when the preset's drafter changes) and shared by every line. Each night also measures ``vanilla`` (the
speedup reference) and ``ar_draft`` (the horizontal baseline) in the same process. Idempotent: a checkpoint
already in the history (same folder) is skipped, so rerunning adds nothing.

Outputs in ``<run_root>/<experiment>/sweep/``: ``history.jsonl`` (one evaluation record per line, with
``night`` and ``checkpoint``) and ``fig7_speedup_vs_steps.png``. Scheduling: docs/evaluation.md (cron or a
recurring Slurm job).
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from streakline.artifacts import atomic_file
from streakline.config import compose_config
from streakline.evaluation.figures import fig7_speedup_vs_steps
from streakline.evaluation.methods import EvalMethod
from streakline.evaluation.suite import evaluate_methods
from streakline.world import attach_world

from .common.kinds import drafter_kind, preset_rows
from .common.lookup import distill_checkpoints, distill_runs, stage_overrides
from .common.prompts import evaluation_inputs
from .common.roles import device
from .runner import Stage, StageResult

STAGE_NAME = "sweep"


class Sweep(Stage):
    name = STAGE_NAME
    settings = ("stage",)

    def run(self, cfg: DictConfig, stage_run: None) -> StageResult:
        from . import run_stage  # the dispatcher: each distill run goes through the runner like any stage

        for entry in cfg.stage.train:
            print(f"sweep: distill {entry}")
            run_stage(compose_config(stage_overrides(cfg, f"distill {entry}")[1]))
        # the evaluation's settings are stage=evaluate's (settings.evaluate.*), at this sweep's one temperature
        evaluation = attach_world(compose_config(stage_overrides(cfg, "evaluate")[1]), device=device())
        evaluation.stage.temperatures = [cfg.stage.temperature]
        path = history_path(cfg)
        history = read_history(path)
        methods = new_checkpoints(evaluation, history)
        new: list[dict] = []
        if methods:
            new = _evaluate(evaluation, methods)
            path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_file(path, "w") as f:  # rewrite whole: a crash never leaves half a line
                for r in history + new:
                    f.write(json.dumps(r) + "\n")
        else:
            print("sweep: every checkpoint is already in the history; nothing to evaluate")
        figure = fig7_speedup_vs_steps(history + new, path.parent / "fig7_speedup_vs_steps.png", cfg.stage.temperature)
        points = sum(1 for r in new if r.get("checkpoint"))
        metrics = {"new_points": points, "checkpoints": len(methods)}
        return StageResult(self.name, path.parent, path, metrics, details={"figure": str(figure) if figure else None})

    def report(self, result: StageResult) -> None:
        m = result.metrics
        print(f"sweep: {m['new_points']} new points ({m['checkpoints']} checkpoints) appended to {result.artifact}")
        if result.details["figure"] is not None:
            print(f"sweep: figure {result.details['figure']}")


STAGE = Sweep()


def new_checkpoints(cfg: DictConfig, history: list[dict[str, Any]]) -> list[EvalMethod]:
    """A method per checkpoint that the history lacks on some benchmark of ``cfg`` (a stage=evaluate config):
    step 0 (the model preset's drafter, undistilled; every line starts there), then every checkpoint of this
    experiment's distill runs."""
    seen = {(r.get("checkpoint"), r["benchmark"]) for r in history if r.get("checkpoint")}

    def new(ckpt: str) -> bool:
        return not all((ckpt, b) in seen for b in cfg.stage.benchmarks)

    # step 0: the preset's drafter decoded as the kind that trains it ("base", diffusion_draft for a plain drafter)
    methods = [m for m in preset_rows(cfg) if m.steps == 0] if new(base_checkpoint(cfg)) else []
    for run_ in distill_runs(cfg):
        for steps, ckpt in distill_checkpoints(run_):
            if new(ckpt):
                label = f"{run_['method']}@{Path(run_['folder']).name}"
                decoder = drafter_kind(cfg, ckpt).decoder  # dflash_draft for a DFlash run's exports
                methods.append(EvalMethod(label, decoder, drafter=ckpt, steps=steps, distill_loss=run_["method"]))
    return methods


def base_checkpoint(cfg: DictConfig) -> str:
    """What the history calls step 0: the model preset's drafter (its folder, or its hub id)."""
    node = cfg.model.drafter
    return str(node.path or node.hub_id)


def _evaluate(cfg: DictConfig, methods: list[EvalMethod]) -> list[dict[str, Any]]:
    """Tonight's records on ``cfg`` (a stage=evaluate config at the sweep's temperature): the new checkpoints plus
    ``ar_draft`` (the horizontal baseline) and ``vanilla`` (the speedup reference)."""
    night = datetime.now(timezone.utc).isoformat(timespec="seconds")
    methods = [*(m for m in preset_rows(cfg) if m.steps is None), *methods]  # ar_draft for a transformer drafter
    prompts, eos = evaluation_inputs(cfg, methods)
    records = evaluate_methods(cfg, methods, prompts, eos)
    for r in records:
        checkpoint = (r["drafter"] or base_checkpoint(cfg)) if r.get("steps") is not None else None
        r.update(night=night, checkpoint=checkpoint)
    return records


def history_path(cfg: DictConfig) -> Path:
    return Path(cfg.stage.history or Path(cfg.run_root, cfg.experiment.name, STAGE_NAME, "history.jsonl"))


def read_history(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    records = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {n} is not JSON ({e}); fix or delete that line") from e
    return records
