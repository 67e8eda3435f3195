"""Stage ``plan``: memory per GPU, disk and time of every stage on a named cluster, before anything is queued.

    python launch.py stage=plan model=diffucoder cluster=a100-80g cluster.nodes=4
    python launch.py stage=plan model=qwen2.5-72b cluster=h100-80g trainer=zero3 stage.stages=[distill]

Recipe: the roles are built by the project's builder on the ``meta`` device at their real shapes (no weights,
no GPU, no world: ``streakline/planning/shapes.py``); each stage of ``stage.stages`` is planned
(``planning/stages.py``), given its verdict and, when it does not fit, the change that makes it fit
(``planning/verdicts.py``), and printed (``planning/table.py``). Nothing is written: no run folder, no checkpoint.
docs/planning.md has the reasoning.
"""

from __future__ import annotations

from omegaconf import DictConfig

from .runner import Stage, StageResult


class Plan(Stage):
    name = "plan"
    settings = ("stage", "cluster")
    needs_world = False  # the shapes come from presets, config.json files or the known shapes: nothing is built

    def uses(self, cfg: DictConfig) -> tuple[str, ...]:
        return ()

    def check(self, cfg: DictConfig) -> None:
        from streakline.planning.verdicts import check

        check(cfg)

    def run(self, cfg: DictConfig, stage_run: None) -> StageResult:
        """``metrics``: per stage its peak bytes per GPU, whether it fits, its disk bytes and seconds."""
        from streakline.planning.table import format_plan
        from streakline.planning.verdicts import plan_all

        plans = plan_all(cfg)
        metrics = {
            p.stage: {"peak_bytes": p.peak, "fits": p.fits, "disk_bytes": sum(p.disk.values()), "seconds": p.seconds}
            for p in plans
        }
        return StageResult(self.name, metrics=metrics, details={"text": format_plan(cfg, plans), "plans": plans})

    def report(self, result: StageResult) -> None:
        print(result.details["text"])


STAGE = Plan()
