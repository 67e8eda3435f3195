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

import os
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
# Stages that start one process per GPU: inside a multi-node / multi-GPU Slurm job each node runs torchrun over them.
TORCHRUN_STAGES = ("distill",)


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

    try:
        cfg = as_schema(cfg)
        cfg.overrides = list(HydraConfig.get().overrides.task)
        validate(cfg)
    except ConfigError as err:
        _fail(f"invalid config: {err}")
    resolve_paths(cfg)
    if cfg.launcher.name == "slurm" and not _submitted(HydraConfig.get()):
        # Hydra hands jobs to a launcher only in multirun mode: without -m this would run here, silently
        _fail(
            f"launcher=slurm submits jobs through Hydra's multirun: add -m, e.g. python launch.py -m launcher=slurm "
            f"stage={cfg.stage.name} ...; or drop launcher=slurm to run on this machine"
        )
    if cfg.launcher.name == "slurm" and cfg.stage.name in TORCHRUN_STAGES and _run_ranks(cfg):
        return

    # Only the entry point may import pipelines/ (docs/design.md, Layout).
    from streakline.decoding.vanilla import PositionLimitError
    from streakline.models import CheckpointError
    from streakline.pipelines import StageNotBuiltError, run_stage

    try:
        run_stage(cfg)
    except (StageNotBuiltError, ConfigError, CheckpointError, PositionLimitError) as err:
        # input the user can fix (a bad combination of settings, a missing checkpoint): a message, not a traceback
        _fail(str(err))


def _submitted(hydra_cfg) -> bool:
    """True when this process runs a job Hydra launched in multirun mode (the launcher's own job), or a rank
    inside a Slurm job that the driver submitted."""
    from hydra.types import RunMode

    return hydra_cfg.mode == RunMode.MULTIRUN or "SLURM_JOB_ID" in os.environ


def _run_ranks(cfg: DictConfig) -> bool:
    """Inside a Slurm job with more than one process to start (several nodes or GPUs), run this node's torchrun
    over the same command line (every rank composes the driver's config) and return True; else False."""
    from hydra.core.hydra_config import HydraConfig

    from streakline.launch.slurm import node_command

    hydra_cfg = HydraConfig.get()
    ranks = node_command(cfg.launcher.gpus_per_node, hydra_cfg.overrides.task, hydra_cfg.runtime.output_dir)
    if ranks is None:
        return False
    import subprocess

    code = subprocess.call(ranks)
    if code != 0:  # an exception, not SystemExit: submitit reports it back to the driver
        raise RuntimeError(f"torchrun exited with status {code}: {' '.join(ranks)}")
    return True


def _fail(message: str) -> None:
    print(f"streakline: {message}", file=sys.stderr)
    if os.environ.get("SUBMITIT_EXECUTOR"):  # a submitit job returns exceptions to its driver; SystemExit would hang it
        raise RuntimeError(f"streakline: {message}")
    # SystemExit is not an Exception, so Hydra's error reporter lets it through with our status intact.
    raise SystemExit(USAGE_ERROR)
