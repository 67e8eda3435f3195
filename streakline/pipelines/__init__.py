"""The stages: ``stage=<name>`` on the command line runs ``streakline.pipelines.<name>.STAGE`` through the runner.

Each stage is one module holding a :class:`~streakline.pipelines.runner.Stage` object named ``STAGE`` (its recipe,
top-down); ``runner.py`` does what every stage shares (world, validation, cache lookup, run folder and manifest);
``common/`` holds what several stages use. No stage module imports another. Only ``streakline.cli`` (and the
chaining stages, through :func:`run_stage`) run stages. Try ``python launch.py stage=doctor``.
"""

import importlib
import importlib.util

from omegaconf import DictConfig

from streakline.config.schema import STAGES as STAGE_NAMES
from streakline.errors import UserError

from .runner import Stage, StageResult, run_stage_object

STAGES: dict[str, str] = {name: f"{__name__}.{name}" for name in STAGE_NAMES}

__all__ = ["STAGES", "Stage", "StageNotBuiltError", "StageResult", "built_stages", "load_stage", "run_stage"]


class StageNotBuiltError(UserError, RuntimeError):
    """The stage is a valid name in the schema but its module is not in this version."""


def built_stages() -> list[str]:
    """Stage names whose module exists in this installation, in schema order."""
    return [name for name, module in STAGES.items() if importlib.util.find_spec(module) is not None]


def load_stage(name: str) -> Stage:
    """The ``STAGE`` object of stage ``name``; StageNotBuiltError for an unknown or unbuilt one."""
    if name not in STAGES:
        raise StageNotBuiltError(f"unknown stage {name!r}; stages: {', '.join(STAGES)}")
    module_name = STAGES[name]
    # find_spec rather than catching ImportError: a stage that exists but fails to import must show its own error.
    if importlib.util.find_spec(module_name) is None:
        raise StageNotBuiltError(
            f"stage {name!r} is not built yet in this version; built stages: {', '.join(built_stages())}"
        )
    stage = getattr(importlib.import_module(module_name), "STAGE", None)
    if not isinstance(stage, Stage) or stage.name != name:
        raise TypeError(f"{module_name} must define STAGE, a pipelines.runner.Stage named {name!r}")
    return stage


def run_stage(cfg: DictConfig) -> StageResult:
    """Run the stage ``cfg.stage.name`` through the runner and return its :class:`StageResult`."""
    return run_stage_object(load_stage(cfg.stage.name), cfg)
