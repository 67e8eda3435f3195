"""Stage dispatch: ``stage=<name>`` on the command line runs ``streakline.pipelines.<name>.run(cfg)``.

Each stage is one module with a ``run(cfg)`` function that takes the validated, path-resolved config and
returns what it produced. Only ``streakline.cli`` imports this package. Try ``python launch.py stage=doctor``.
"""

import importlib
import importlib.util
from typing import Any

from omegaconf import DictConfig

from streakline.config.schema import STAGES as STAGE_NAMES

STAGES: dict[str, str] = {name: f"{__name__}.{name}" for name in STAGE_NAMES}


class StageNotBuiltError(RuntimeError):
    """The stage is a valid name in the schema but its module is not in this version."""


def built_stages() -> list[str]:
    """Stage names whose module exists in this installation, in schema order."""
    return [name for name, module in STAGES.items() if importlib.util.find_spec(module) is not None]


def run_stage(cfg: DictConfig) -> Any:
    """Import the module for ``cfg.stage.name`` and return its ``run(cfg)``."""
    name = cfg.stage.name
    if name not in STAGES:
        raise StageNotBuiltError(f"unknown stage {name!r}; stages: {', '.join(STAGES)}")
    module_name = STAGES[name]
    # find_spec rather than catching ImportError: a stage that exists but fails to import must show its own error.
    if importlib.util.find_spec(module_name) is None:
        raise StageNotBuiltError(
            f"stage {name!r} is not built yet in this version; built stages: {', '.join(built_stages())}"
        )
    return importlib.import_module(module_name).run(cfg)
