"""The command line: ``python launch.py ...`` and the ``streakline`` console script both land in :func:`main`.

    python launch.py stage=doctor model=tiny
    python launch.py --cfg job model=qwen2.5-72b        # print the composed config and stop
    python launch.py stage=distill model.verifier=qwen2.5-72b model.drafter.path=/ckpt/drafter
    python launch.py --help                             # groups and their options

Input the user can fix (any ``streakline.errors.UserError``) ends the run with one line on stderr and exit status 2;
``debug=true`` (or ``STREAKLINE_DEBUG=1``) shows its traceback too. SIGTERM ends a stage with one line (what was kept,
how to go on) and status 143.

Order of work: check and rewrite the overrides (unknown keys exit with status 2 before Hydra starts), compose with
Hydra from the repository's ``conf/``, merge onto the schema, validate, make paths absolute, then hand the config to
the stage named by ``stage=``. Heavy libraries are imported by the stages, not here, so ``--help`` and ``--cfg`` stay
fast.
"""

import logging
import os
import sys

import hydra
from omegaconf import DictConfig

from streakline.artifacts import check_run_root, disk_full_error, is_disk_full
from streakline.config import (
    CONF_DIR,
    Config,
    ConfigError,
    as_schema,
    register_configs,
    resolve_paths,
    rewrite_overrides,
    validate,
)
from streakline.errors import DEBUG_ENV, UserError, debugging

USAGE_ERROR = 2
# Hydra's flags that print and stop: no job runs, so nothing may be created
INFO_FLAGS = {"--cfg", "-c", "--help", "-h", "--hydra-help", "--info", "-i", "--version", "--shell-completion", "-sc"}
# Stages that start one process per GPU: inside a multi-node / multi-GPU Slurm job each node runs torchrun over them.
TORCHRUN_STAGES = ("distill",)


def main() -> None:
    """Entry point: rewrite ``sys.argv``'s overrides, then run the Hydra app."""
    _take_debug_flag(sys.argv)
    if not (CONF_DIR / "config.yaml").is_file():
        _fail(f"config folder not found at {CONF_DIR}; install streakline from its source tree (pip install -e .)")
    try:
        sys.argv[1:] = rewrite_overrides(sys.argv[1:], CONF_DIR)
        if not any(a.split("=", 1)[0] in INFO_FLAGS for a in sys.argv[1:]):
            # a job is going to run, and Hydra makes its log folder under run_root before any of our code runs
            check_run_root(_run_root(sys.argv[1:]))
        _check_slurm(sys.argv[1:])
    except UserError as err:
        _fail_with(err)
    register_configs()
    # A log handler that cannot write (Hydra's log file under a run root whose disk filled up mid-run) must not print
    # a traceback per record before the stage's own one-line disk-full message: logging then drops the record.
    logging.raiseExceptions = False
    _app()


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def _app(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    try:
        cfg = as_schema(cfg)
        cfg.overrides = list(HydraConfig.get().overrides.task)
        validate(cfg)
    except ConfigError as err:
        _fail_with(err, "invalid config: ")
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
    from streakline.pipelines import run_stage

    _trap_sigterm()
    try:
        run_stage(cfg)
    except Terminated:
        # a scheduler's preemption or a plain kill: the stage's finally blocks ran; what it finished stays on disk
        print(
            f"streakline: stage={cfg.stage.name} stopped by SIGTERM; what it finished (shards, checkpoints, "
            f"exports) is kept under {cfg.run_root}: run the same command again to go on from there",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(TERMINATED)
    except UserError as err:
        # input the user can fix (a bad combination of settings, a missing checkpoint): a message, not a traceback
        _fail_with(err)
    except OSError as err:
        if not is_disk_full(err):
            raise
        # a full disk met by a write that does not say so itself (DeepSpeed's checkpoint, a library's save)
        where = err.filename or cfg.run_root
        _fail_with(disk_full_error(where, err, folder=not err.filename))


TERMINATED = 128 + 15  # the shell's status for a SIGTERM'd process, which schedulers read as "stopped"


class Terminated(BaseException):
    """Raised where a stage is when SIGTERM arrives, so its ``finally`` blocks and locks unwind as for any error; a
    BaseException, so that no stage's ``except Exception`` takes it for its own."""


def _trap_sigterm() -> None:
    """SIGTERM becomes ``Terminated`` (main thread only: Python delivers signals there). stage=distill puts its own
    handler in place while it trains (it saves a checkpoint first) and puts this one back after."""
    import signal
    import threading

    def handler(signum, frame):
        raise Terminated()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)


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


def _run_root(args: list[str]) -> str:
    """The ``run_root`` the command line sets (the last one wins, as in Hydra), else the schema's default."""
    given = [a.split("=", 1)[1] for a in args if a.split("=", 1)[0].lstrip("+") == "run_root"]
    return given[-1] if given else Config.run_root


def _check_slurm(args: list[str]) -> None:
    """Refuse ``-m launcher=slurm`` on a machine without Slurm's commands, before Hydra's submitit launcher fails on
    it with a 25-line traceback, and a job that the plan says cannot fit (``planning/gate.py``)."""
    import shutil

    multirun = any(a in ("-m", "--multirun") for a in args)
    if multirun and "launcher=slurm" in args:
        missing = [c for c in ("sbatch", "srun") if shutil.which(c) is None]
        if missing:
            verb = "is" if len(missing) == 1 else "are"
            raise ConfigError(
                f"launcher=slurm submits with Slurm, but {' and '.join(missing)} {verb} not on this machine's PATH: "
                "run from a Slurm login node (or load its module), or drop launcher=slurm to run here"
            )
        from streakline.planning.gate import check_submission

        check_submission(args)  # a job that cannot fit the nodes it asks for is refused before sbatch (launcher.plan)


def _take_debug_flag(argv: list[str]) -> None:
    """Remove ``debug=true`` from ``argv`` and set ``STREAKLINE_DEBUG`` instead: a flag of the command line, not a
    setting of the run (it must not change a run's hash), and seen by every process the run starts."""
    for arg in list(argv[1:]):
        key, sep, value = arg.partition("=")
        if sep and key.lstrip("+") == "debug":
            if value.lower() not in ("true", "false", "1", "0"):
                _fail(f"debug={value} is not valid; use debug=true (tracebacks for input errors) or debug=false")
            argv.remove(arg)
            os.environ[DEBUG_ENV] = "1" if value.lower() in ("true", "1") else "0"
    if debugging():
        os.environ.setdefault("HYDRA_FULL_ERROR", "1")  # Hydra otherwise trims the traceback to its last frame


def _fail_with(err: UserError, prefix: str = "") -> None:
    """Print a user error as one line (status 2), or re-raise it with its traceback under ``debug=true``."""
    if debugging():
        raise err
    # A message is one line: a second one (a hint) joins the first, so logs and Slurm's .err keep it whole.
    _fail(prefix + " ".join(line.strip() for line in str(err).splitlines() if line.strip()))


def _fail(message: str) -> None:
    _close_progress_bars()
    print(f"streakline: {message}", file=sys.stderr)
    if os.environ.get("SUBMITIT_EXECUTOR"):  # a submitit job returns exceptions to its driver; SystemExit would hang it
        raise RuntimeError(f"streakline: {message}")
    # SystemExit is not an Exception, so Hydra's error reporter lets it through with our status intact.
    raise SystemExit(USAGE_ERROR)


def _close_progress_bars() -> None:
    """Close the progress bars a refused stage left open (a full disk mid-shard), so that the message starts a line
    of its own instead of trailing the bar's last redraw."""
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", None) or ()):
        try:
            bar.close()
        except Exception:  # a bar that cannot redraw must not cost the message
            pass
