"""The check before a Slurm submission: plan the job's stage on the nodes it asks for, refuse it if it cannot fit.

The driver of ``python launch.py -m launcher=slurm stage=distill ... cluster=a100-80g`` calls
:func:`check_submission` with its command line before Hydra hands the job to sbatch: the config is composed as the
job will compose it, the ``cluster=`` preset is sized to the job (``cluster.nodes`` = ``launcher.nodes``,
``cluster.gpus_per_node`` = ``launcher.gpus_per_node``), and the job's stage (each planned stage of
``experiment.stages`` for stage=pipeline) is planned. A stage that does not fit raises a one-line ConfigError with the
fix (status 2, nothing submitted); ``launcher.plan=false`` skips the check. Without a GPU cluster named
(``cluster=cpu``, the default) or for a job without GPUs there is nothing to size, and the check says so and passes.

    check_submission(["-m", "launcher=slurm", "stage=distill", "model=diffucoder", "cluster=a100-80g"])

Tests: ``python -m pytest tests/planning/test_gate.py -q``.
"""

from __future__ import annotations

import re

from omegaconf import DictConfig

from streakline.config import ConfigError, compose_config

from .stages import STAGE_PLANNERS, Shapes
from .verdicts import plan_stage

_SWEEP = re.compile(r"^[^=\[]+=[^\[\]]*,")  # key=a,b: a multirun sweep over values (not a [list])


def job_stages(cfg: DictConfig) -> list[str]:
    """The stages the job runs that a plan covers."""
    if cfg.stage.name == "pipeline":
        names = [(entry.split() or [""])[0] for entry in cfg.experiment.stages]
    else:
        names = [cfg.stage.name]
    return [n for n in names if n in STAGE_PLANNERS]


def refusal(cfg: DictConfig) -> str | None:
    """Why the job ``cfg`` cannot fit its cluster (one line, with the fix), or None when it fits or there is
    nothing to size."""
    if not cfg.launcher.plan or cfg.cluster.name == "cpu" or cfg.launcher.gpus_per_node < 1:
        return None
    cfg.cluster.nodes = cfg.launcher.nodes
    cfg.cluster.gpus_per_node = cfg.launcher.gpus_per_node
    shapes = Shapes(cfg)
    for name in job_stages(cfg):
        plan = plan_stage(name, cfg, shapes)
        if not plan.fits:
            return (
                f"stage={name} cannot fit {cfg.launcher.nodes} node(s) x {cfg.launcher.gpus_per_node} "
                f"{cfg.cluster.name}: {plan.verdict}; nothing was submitted (launcher.plan=false submits anyway; "
                f"python launch.py stage=plan ... shows the whole plan)"
            )
    return None


def check_submission(args: list[str]) -> None:
    """Raise ConfigError when ``-m launcher=slurm`` would submit a job that cannot fit; see the module docstring.
    A command line that is no Slurm submission, or a sweep over values (each job its own config), passes."""
    if not any(a in ("-m", "--multirun") for a in args) or "launcher=slurm" not in args:
        return
    overrides = [a for a in args if not a.startswith("-")]
    if any(_SWEEP.match(a) for a in overrides):
        print("launcher.plan: a sweep over values is not planned before submission; plan one job with stage=plan")
        return
    cfg = compose_config(overrides)
    if cfg.launcher.plan and cfg.cluster.name == "cpu" and cfg.launcher.gpus_per_node > 0:
        print("launcher.plan: name the job's nodes (cluster=a100-80g, h100-80g, ...) to check that it fits first")
    problem = refusal(cfg)
    if problem is not None:
        raise ConfigError(problem)
