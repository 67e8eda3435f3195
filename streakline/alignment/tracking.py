"""Training metrics: always a JSONL file, and W&B when a project is set (``WANDB_MODE=offline`` works without network).

    tracker = Tracker(run_dir / "metrics.jsonl", project="streakline", run_id=cfg_hash, config=plain_cfg, enabled=rank0)
    tracker.log({"loss": 0.3, "lr": 1e-4}, step=10)
    tracker.update_config({"run": {"world_size": 8}})   # known once the engine is built (telemetry.run_metadata)
    tracker.close()

Without a W&B API key the run is logged offline (``wandb sync`` uploads it later) instead of failing.
Only the main rank writes (``enabled=False`` elsewhere makes every call a no-op). The JSONL file is appended to, so a
resumed run continues the same file; each line is ``{"step": n, ...}``. W&B resumes the same run id.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any


def _plain(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


# A process killed outright (SIGKILL, OOM) leaves its W&B service holding the run id for a few seconds; a rerun
# that resumes the same id waits this long in all before it gives up on W&B for this run.
WANDB_ID_WAITS = (1.0, 2.0, 4.0, 8.0)


def _init_wandb(wandb, kwargs: dict, jsonl: Path):
    """``wandb.init(**kwargs)``: offline when this machine has no API key; retried while a killed run's service
    still holds the id; and when W&B cannot start at all, None with one line saying so (the metrics log in
    ``jsonl`` is complete either way: telemetry never stops a training run)."""
    waits = list(WANDB_ID_WAITS)
    while True:
        try:
            return wandb.init(**kwargs)
        except wandb.errors.UsageError as e:  # no API key on this machine: keep the run, log it offline
            if kwargs.get("mode") == "offline":
                print(f"W&B: {e}; metrics go to {jsonl} only")
                return None
            print(f"W&B: {e}; logging offline under {jsonl.parent / 'wandb'} (upload later with `wandb sync`)")
            kwargs = {**kwargs, "mode": "offline"}
        except Exception as e:  # noqa: BLE001 - any W&B failure must not cost the run
            if "in use" in str(e) and waits:
                time.sleep(waits.pop(0))
                continue
            print(f"W&B: could not start ({type(e).__name__}: {e}); metrics go to {jsonl} only")
            return None


def experiment_project(base: str | None, experiment: str) -> str | None:
    """The W&B project of an experiment: one per experiment (``<base>-<experiment>``); None turns W&B off."""
    return f"{base}-{experiment}" if base else None


def stage_tracker(
    cfg: Any, stage_run: Any, job_type: str, config: dict, name: str | None = None, enabled: bool = True
) -> Tracker:
    """The Tracker of one stage run: ``metrics.jsonl`` in its folder, the experiment's W&B project, run id
    ``<job_type>-<run hash>`` (a resumed run logs into the same W&B run), group = experiment and job type = stage,
    so one experiment's runs sit together; ``name`` defaults to ``<experiment>/<job_type>``."""
    return Tracker(
        stage_run.dir / "metrics.jsonl",
        project=experiment_project(cfg.trainer.wandb_project, cfg.experiment.name),
        run_id=f"{job_type}-{stage_run.cfg_hash}",
        config=config,
        enabled=enabled,
        name=name or f"{cfg.experiment.name}/{job_type}",
        group=cfg.experiment.name,
        job_type=job_type,
    )


class Tracker:
    def __init__(
        self,
        jsonl: str | os.PathLike,
        *,
        project: str | None = None,
        run_id: str | None = None,
        config: dict | None = None,
        enabled: bool = True,
        name: str | None = None,
        group: str | None = None,
        job_type: str | None = None,
    ) -> None:
        self.enabled = enabled
        self.path = Path(jsonl)
        self.wandb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if project:
            import wandb

            kwargs = dict(
                project=project,
                id=run_id,
                name=name,
                group=group,
                job_type=job_type,
                resume="allow",
                config=config,
                dir=str(self.path.parent),
                reinit="finish_previous",
            )
            self.wandb = _init_wandb(wandb, kwargs, self.path)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if not self.enabled:
            return
        record = {"step": step, **_plain(metrics)}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb is not None:
            flat = {}
            for key, value in metrics.items():
                if isinstance(value, list | tuple):  # per-position lists become one scalar series per position
                    flat.update({f"{key}/{j + 1}": v for j, v in enumerate(value) if v is not None})
                elif value is not None:
                    flat[key] = value
            self.wandb.log(flat, step=step)

    def update_config(self, values: dict[str, Any]) -> None:
        """Add ``values`` to the W&B run's config (the run's shape, known only once the engine is built); a value
        already there is replaced, as a resumed run may run on another number of ranks. No-op without W&B."""
        if not self.enabled or self.wandb is None:
            return
        self.wandb.config.update(_plain(values), allow_val_change=True)

    def log_table(self, name: str, rows: list[dict[str, Any]]) -> None:
        """A W&B table of ``rows`` (one column per key of the first row; lists and dicts as JSON text)."""
        if not self.enabled or self.wandb is None or not rows:
            return
        import wandb

        columns = list(rows[0])
        cell = lambda v: json.dumps(_plain(v)) if isinstance(v, list | tuple | dict) else v  # noqa: E731
        self.wandb.log({name: wandb.Table(columns=columns, data=[[cell(r.get(c)) for c in columns] for r in rows])})

    def log_image(self, name: str, path: str | os.PathLike) -> None:
        if not self.enabled or self.wandb is None:
            return
        import wandb

        self.wandb.log({name: wandb.Image(str(path))})

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
