"""The one stage runner: every ``stage=<name>`` goes through :func:`run_stage`, which does what all stages share.

    python launch.py stage=spot model=tiny     # -> run_stage(cfg) -> STAGE.run(cfg, stage_run) in pipelines/spot.py

A stage module holds one :class:`Stage` object named ``STAGE``: its name, the config nodes it owns, ``check``
(validation before any work), ``key`` (what its artifact depends on; None for stages that keep no artifact),
``run`` (the recipe, top-down), ``reuse`` (the result of a complete earlier run with the same key) and ``report``
(what it prints). The runner, in order:

1. points the tiny world's roles at their checkpoints, building the world if needed (``world.attach_world``);
2. ``stage.check(cfg)``;
3. ``stage.key(cfg)``; with a key, looks for a complete run of this experiment with the same hash and, if found
   and not damaged (``stage.damage``), returns ``stage.reuse`` of it (flagged ``cached``) without redoing the work;
4. otherwise runs ``stage.run(cfg, stage_run)`` inside a ``StageRun``, whose manifest is written last and which
   holds the run folder's lock throughout (a second process on the same run refuses; under torchrun rank 0 takes
   it and the other ranks of its job join it: docs/artifacts.md, Locks);
5. ``stage.report(result)``, for a fresh and a reused result alike.

Every stage returns a :class:`StageResult`, which is what ``stage=pipeline`` and ``stage=sweep`` read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from omegaconf import DictConfig

from streakline.artifacts import StageRun, check_run_root, config_hash, find_complete, run_dir, wait_for_job_lock


@dataclass
class StageResult:
    """What a stage produced. ``folder``: its run folder; ``artifact``: the main output a later stage or a user
    reads (``drafter/``, ``shards/``, ``order_model/``, ``graph.json``, ``results.json``, ...); ``metrics``: the
    numbers it measured; ``cached``: reused from an earlier complete run; ``details``: anything else the stage
    returns (evaluate's records and figures, decode's tokens)."""

    stage: str
    folder: Path | None = None
    artifact: Path | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    cached: bool = False
    details: dict[str, Any] = field(default_factory=dict)


class Stage:
    """One stage of the pipeline; subclass it in ``pipelines/<name>.py`` and expose the instance as ``STAGE``."""

    name: ClassVar[str]
    # The config nodes this stage owns (its settings); documentation, and what `stage=<name> --help` would show.
    settings: ClassVar[tuple[str, ...]] = ()
    # Point the tiny world's roles at their checkpoints first (every stage that loads a model).
    needs_world: ClassVar[bool] = True
    # Under torchrun every rank runs the stage; only rank 0 writes the manifest.
    ranked: ClassVar[bool] = False

    def uses(self, cfg: DictConfig) -> tuple[str, ...]:
        """The model roles this stage loads with ``cfg``: only these are pointed at the tiny world (which is built
        only when one of them has no checkpoint of its own)."""
        return ("verifier", "drafter", "target")

    def prepare(self, cfg: DictConfig) -> None:
        """Settle what ``cfg`` leaves to be looked up before the world is attached (distill's ``trainer.init_from``
        becomes the drafter's ``path``); ``ConfigError`` when it cannot be."""

    def check(self, cfg: DictConfig) -> None:
        """Raise ``ConfigError`` for settings this stage cannot run with; before any work is done."""

    def key(self, cfg: DictConfig) -> dict[str, Any] | None:
        """What this stage's artifact depends on (its run folder is the hash of it); None: no artifact, no cache."""
        return None

    def damage(self, cfg: DictConfig, folder: Path) -> str | None:
        """Why the complete run in ``folder`` cannot be reused as is (a damaged output), or None."""
        return None

    def reuse(self, cfg: DictConfig, folder: Path) -> StageResult:
        """The result of a complete earlier run in ``folder`` (same key)."""
        raise NotImplementedError(f"stage {self.name} keeps artifacts but cannot reuse them")

    def run(self, cfg: DictConfig, stage_run: StageRun | None) -> StageResult:
        """The recipe. ``stage_run`` is the open run (folder, outputs, metrics) when ``key`` gave one, else None."""
        raise NotImplementedError

    def report(self, result: StageResult) -> None:
        """Print what a user wants to see of ``result`` (fresh or reused)."""


def _check_devices(cfg: DictConfig, roles: tuple[str, ...]) -> None:
    """Refuse ``model.<role>.devices`` naming a GPU this machine lacks (``placement.DeviceError``), before any work."""
    from streakline.models.placement import resolve_devices

    for role in roles:
        devices = cfg.model[role].get("devices")
        if devices is not None:
            resolve_devices(devices, key=f"model.{role}.devices")


def _check_model_types(cfg: DictConfig, roles: tuple[str, ...]) -> None:
    """Refuse a role's checkpoint folder whose config.json names a model_type no family reads, unless the command
    line says which family to read it as (``model.<role>.family=``)."""
    from streakline.errors import UserError
    from streakline.models import locate
    from streakline.models.checkpoint import check_model_type

    given = {str(o).split("=", 1)[0].lstrip("+") for o in (cfg.get("overrides") or [])}
    for role in roles:
        try:
            folder = locate(cfg.model[role], role)
        except UserError:
            continue  # not there: the stage that loads it says so, with the fix
        if folder is not None:
            check_model_type(folder, role, family_given=f"model.{role}.family" in given)


def is_main_rank() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def run_stage_object(stage: Stage, cfg: DictConfig) -> StageResult:
    """Run ``stage`` on ``cfg`` (validated, paths absolute) the way every stage runs; see the module docstring."""
    check_run_root(cfg.run_root)  # before any work: the world and every run folder live there
    stage.prepare(cfg)
    if stage.needs_world:
        from streakline.world import attach_world

        from .common.roles import device

        _check_devices(cfg, stage.uses(cfg))  # a GPU that is not there: refused before a world is built for it
        attach_world(cfg, roles=stage.uses(cfg), device=device())  # a world built now trains on the GPU if any
        _check_model_types(cfg, stage.uses(cfg))
    stage.check(cfg)
    key = stage.key(cfg)
    if key is None:
        result = stage.run(cfg, None)
    else:
        digest = config_hash(key)
        done = find_complete(cfg.run_root, cfg.experiment.name, stage.name, digest)
        problem = None if done is None else stage.damage(cfg, done)
        if problem is not None:
            print(f"{stage.name}: the complete run at {done} is damaged ({problem}); redoing what is missing")
        if done is not None and problem is None:
            print(f"{stage.name}: reusing the complete run with these settings: {done}")
            result = stage.reuse(cfg, done)
            result.cached = True
        elif stage.ranked and not is_main_rank():
            # other ranks work in the same folder but leave the manifest (and the folder's lock) to rank 0; they
            # start once rank 0 of their own job holds the lock, never in a folder another job writes
            wait_for_job_lock(run_dir(cfg.run_root, cfg.experiment.name, stage.name, digest))
            result = stage.run(cfg, StageRun(cfg.run_root, cfg.experiment.name, stage.name, key))
        else:
            # the run's lock makes this process the folder's one writer (RunLockedError, status 2, if another is)
            with StageRun(cfg.run_root, cfg.experiment.name, stage.name, key) as stage_run:
                finished = (
                    None if done is not None else find_complete(cfg.run_root, cfg.experiment.name, stage.name, digest)
                )  # completed by another process between the lookup and the lock
                if finished is not None:
                    stage_run.abandon()
                    print(f"{stage.name}: reusing the complete run with these settings: {finished}")
                    result = stage.reuse(cfg, finished)
                    result.cached = True
                else:
                    result = stage.run(cfg, stage_run)
    if not isinstance(result, StageResult):
        raise TypeError(f"stage {stage.name} returned {type(result).__name__}, not a StageResult")
    if not stage.ranked or is_main_rank():
        stage.report(result)
    return result
