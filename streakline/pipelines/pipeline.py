"""Stage ``pipeline``: run the chain of stages an experiment lists, each cached by its own config hash.

    python launch.py stage=pipeline experiment=tiny_e2e          # the tiny world end to end (make demo-tiny)
    python launch.py stage=pipeline experiment=nightly_fig7      # train if needed, then the Fig. 7 sweep

``experiment.stages`` entries are a stage name plus overrides for that stage only, e.g.
``"distill method=ar_distill"``. Each stage is composed from the command line's overrides, then its own, exactly
as ``python launch.py stage=<name> <overrides>`` would be, and run in this process through the same runner. A
stage whose result is already on disk (same config hash) returns it in seconds, so a rerun after a failure resumes
at the failed stage and a warm rerun is a cache check. The summary at the end lists each stage's time and output.
"""

from __future__ import annotations

import time

from omegaconf import DictConfig

from streakline.config import compose_config

from .common.lookup import stage_overrides
from .runner import Stage, StageResult


class Pipeline(Stage):
    name = "pipeline"
    settings = ("experiment",)
    needs_world = False  # each chained stage attaches its own

    def run(self, cfg: DictConfig, stage_run: None) -> StageResult:
        from . import run_stage  # the dispatcher: every chained stage goes through the runner

        entries = list(cfg.experiment.stages)
        done: list[tuple[str, float, StageResult]] = []
        t_all = time.perf_counter()
        for i, entry in enumerate(entries):
            name, overrides = stage_overrides(cfg, entry)
            print(f"\n=== pipeline [{i + 1}/{len(entries)}] {entry}", flush=True)
            t = time.perf_counter()
            result = run_stage(compose_config(overrides))
            done.append((entry, time.perf_counter() - t, result))
        stages = [{"stage": e, "seconds": s, "output": _where(r), "cached": r.cached} for e, s, r in done]
        report = next((r for _, _, r in reversed(done) if "markdown" in r.details), None)
        details = {"stages": stages, "report": report, "name": cfg.experiment.name}
        return StageResult(self.name, metrics={"seconds": time.perf_counter() - t_all}, details=details)

    def report(self, result: StageResult) -> None:
        stages = result.details["stages"]
        print(f"\n=== pipeline {result.details['name']}: {len(stages)} stages in {result.metrics['seconds']:.0f} s")
        for step in stages:
            where = f"  -> {step['output']}" if step["output"] else ""
            print(f"  {step['seconds']:7.1f} s  {step['stage']}{where}")
        report = result.details["report"]
        if report is not None:
            print(f"\nreport: {report.details['markdown']}")
            for path in report.details.get("figures", {}).values():
                print(f"figure: {path}")


STAGE = Pipeline()


def _where(result: StageResult) -> str | None:
    """What a summary line points at: the stage's main artifact, else its folder."""
    target = result.artifact or result.folder
    return None if target is None else str(target)
