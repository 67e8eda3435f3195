"""Stage ``pipeline``: run the chain of stages an experiment lists, each cached by its own config hash.

    python launch.py stage=pipeline experiment=tiny_e2e          # the tiny world end to end (make demo)
    python launch.py stage=pipeline experiment=nightly_fig7      # train if needed, then the Fig. 7 sweep

``experiment.stages`` entries are a stage name plus overrides for that stage only, e.g.
``"distill method=ar_distill"``. Each stage is composed from the command line's overrides, then its own, exactly
as ``python launch.py stage=<name> <overrides>`` would be, and run in this process. A stage whose result is
already on disk (same config hash) returns it in seconds, so a rerun after a failure resumes at the failed stage
and a warm rerun is a cache check. The summary at the end lists each stage's time and output.
"""

from __future__ import annotations

import shlex
import time
from typing import Any

from omegaconf import DictConfig

from streakline.config import compose_config

STAGE = "pipeline"


def stage_overrides(cfg: DictConfig, entry: str) -> tuple[str, list[str]]:
    """(stage name, overrides to compose it with) for one ``experiment.stages`` entry."""
    name, *extra = shlex.split(entry)
    base = [o for o in cfg.overrides if o.split("=", 1)[0].lstrip("+~") != "stage"]
    return name, [*base, f"stage={name}", *extra]


def run(cfg: DictConfig) -> dict[str, Any]:
    from . import run_stage  # the dispatcher; only launch.py and this chain runner call it

    entries = list(cfg.experiment.stages)
    done: list[dict[str, Any]] = []
    t_all = time.perf_counter()
    for i, entry in enumerate(entries):
        name, overrides = stage_overrides(cfg, entry)
        print(f"\n=== pipeline [{i + 1}/{len(entries)}] {entry}", flush=True)
        stage_cfg = compose_config(overrides)
        t = time.perf_counter()
        result = run_stage(stage_cfg)
        done.append({"stage": entry, "seconds": time.perf_counter() - t, "result": result})
    print(f"\n=== pipeline {cfg.experiment.name}: {len(done)} stages in {time.perf_counter() - t_all:.0f} s")
    for step in done:
        print(f"  {step['seconds']:7.1f} s  {step['stage']}{_where(step['result'])}")
    report = next(
        (s["result"] for s in reversed(done) if isinstance(s["result"], dict) and "markdown" in s["result"]), None
    )
    if report is not None:
        print(f"\nreport: {report['markdown']}")
        for path in report.get("figures", {}).values():
            print(f"figure: {path}")
    return {"stages": [{k: v for k, v in s.items() if k != "result"} for s in done], "report": report}


def _where(result: Any) -> str:
    if isinstance(result, dict):
        for key in ("folder", "drafter", "path"):
            if isinstance(result.get(key), str):
                return f"  -> {result[key]}"
    if result is not None and hasattr(result, "as_posix"):
        return f"  -> {result}"
    return ""
