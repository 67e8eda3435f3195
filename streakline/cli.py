"""The command line: ``python launch.py ...`` and the ``streakline`` console script both land in :func:`main`.

    python launch.py stage=doctor model=tiny
    python launch.py --cfg job model=qwen2.5-72b        # print the composed config and stop
    python launch.py stage=distill model.verifier=qwen2.5-72b model.drafter.path=/ckpt/drafter
    python launch.py --help                             # groups and their options

Order of work: check and rewrite the overrides (unknown keys exit with status 2 before Hydra starts),
compose with Hydra from the repository's ``conf/``, merge onto the schema, validate, make paths absolute,
then hand the config to the stage named by ``stage=``. Heavy libraries are imported by the stages, not
here, so ``--help`` and ``--cfg`` stay fast.
"""

import sys

import hydra
from omegaconf import DictConfig

from streakline.config import (
    CONF_DIR,
    ConfigError,
    OverrideError,
    as_schema,
    register_configs,
    resolve_paths,
    rewrite_overrides,
    validate,
)

USAGE_ERROR = 2


def main() -> None:
    """Entry point: rewrite ``sys.argv``'s overrides, then run the Hydra app."""
    if not (CONF_DIR / "config.yaml").is_file():
        _fail(f"config folder not found at {CONF_DIR}; install streakline from its source tree (pip install -e .)")
    try:
        sys.argv[1:] = rewrite_overrides(sys.argv[1:], CONF_DIR)
    except OverrideError as err:
        _fail(str(err))
    register_configs()
    _app()


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def _app(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    cfg = as_schema(cfg)
    cfg.overrides = list(HydraConfig.get().overrides.task)
    try:
        validate(cfg)
    except ConfigError as err:
        _fail(f"invalid config: {err}")
    resolve_paths(cfg)

    # Only the entry point may import pipelines/ (DESIGN.md, Layout).
    from streakline.models import CheckpointError
    from streakline.pipelines import StageNotBuiltError, run_stage

    try:
        run_stage(cfg)
    except (StageNotBuiltError, ConfigError, CheckpointError) as err:
        # input the user can fix (a bad combination of settings, a missing checkpoint): a message, not a traceback
        _fail(str(err))


def _fail(message: str) -> None:
    # SystemExit is not an Exception, so Hydra's error reporter lets it through with our status intact.
    print(f"streakline: {message}", file=sys.stderr)
    raise SystemExit(USAGE_ERROR)
