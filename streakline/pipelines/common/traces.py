"""What stage=spot and stage=spiffy share: both decode prompts with a draft-free rule of the target into traces, so
both judge the same trace settings the same way (``check_trace_settings``, called by their ``check``), and both end
with one artifact beside a ``metrics.json`` that a cached rerun reads back (``finish_with_metrics``,
``reuse_metrics``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from streakline.artifacts import StageRun, write_json_atomic
from streakline.config import ConfigError
from streakline.decoding.registry import BLOCK

from ..runner import StageResult

METRICS = "metrics.json"


def check_trace_settings(s: Any, counts: tuple[str, ...], top_k_why: str) -> None:
    """ConfigError for trace settings in ``s`` (a stage's ``cfg.stage``) the draft-free decoder cannot run with:
    ``rule``, ``prompt_sources``, ``temperature``, ``threshold``, ``top_k`` (``top_k_why`` says what needs 2), and
    the stage's own ``counts`` that must be at least 1."""
    if s.rule not in BLOCK:
        raise ConfigError(f"stage.rule={s.rule} is not a draft-free rule; valid: {', '.join(BLOCK)}")
    if not s.prompt_sources:
        raise ConfigError("stage.prompt_sources is empty; name at least one benchmark (e.g. tiny-math-train)")
    for name in counts:
        if s[name] < 1:
            raise ConfigError(f"stage.{name} must be >= 1, got {s[name]}")
    if s.top_k < 2:
        raise ConfigError(f"stage.top_k must be >= 2 ({top_k_why}), got {s.top_k}")
    if s.temperature < 0:
        raise ConfigError(f"stage.temperature must be >= 0, got {s.temperature}")
    if not 0.0 < s.threshold <= 1.0:
        raise ConfigError(f"stage.threshold must be in (0, 1], got {s.threshold}")


def finish_with_metrics(stage: str, stage_run: StageRun, artifact: str, metrics: dict[str, Any]) -> StageResult:
    """Write ``metrics.json``, put the metrics in the manifest, and return the result whose main artifact is
    ``artifact`` (already written into the run folder)."""
    write_json_atomic(stage_run.add_output(METRICS), metrics)
    stage_run.metrics.update(metrics)
    return StageResult(stage, folder=stage_run.dir, artifact=stage_run.dir / artifact, metrics=metrics)


def reuse_metrics(stage: str, folder: Path, artifact: str) -> StageResult:
    """The result of a complete earlier run in ``folder``, from its ``metrics.json``."""
    metrics = json.loads((folder / METRICS).read_text(encoding="utf-8"))
    return StageResult(stage, folder=folder, artifact=folder / artifact, metrics=metrics)
