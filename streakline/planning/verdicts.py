"""Verdicts: when a stage's plan does not fit, the change that makes it fit; and the plan of every stage.

``FIXES`` lists, per stage, the changes to try, least disruptive first, each as the command-line overrides a user
would type (activation checkpointing, a higher ZeRO stage, a smaller micro batch with more accumulation, the stored
teacher or features, no held-out verifier on rank 0, more nodes; for the decoding stages the role placed over the
node's GPUs and a smaller batch). :func:`plan_stage` re-plans with them (one alone first, then added greedily) and
names the first that fits; :func:`plan_all` plans every stage of ``stage.stages``.

    plans = plan_all(cfg)                      # [StagePlan, ...] (default: the six stages of DEFAULT_STAGES)
    plans[1].fits, plans[1].fix_overrides      # False, ["trainer.zero_stage=3", "trainer.precision=bf16"]

Tests: ``python -m pytest tests/planning -q``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf, open_dict

from streakline.config import ConfigError

from .stages import (
    DEFAULT_STAGES,
    STAGE_PLANNERS,
    TEACHER_LOSSES,
    Shapes,
    StagePlan,
    assumptions,
    devices_of,
    heldout,
    settings_of,
    trajectory_batch,
)


# ------------------------------------------------------------------------------------------------------- fixes
@dataclass(frozen=True)
class Fix:
    """A change to try: command-line overrides (each ``key=value``, exactly what a user would type) and a note."""

    overrides: tuple[str, ...]
    note: str = ""

    @property
    def change(self) -> dict[str, Any]:
        """``{key: value}`` of the overrides, values read as YAML (``true``, ``3``, ``[2, 10]``) as Hydra reads them."""
        out = {}
        for item in self.overrides:
            key, _, value = item.partition("=")
            out[key] = yaml.safe_load(value)
        return out


def _halvings(key: str, value: int, keep: str | None = None, keep_value: int = 1) -> list[Fix]:
    out, v = [], value
    while v > 1:
        v //= 2
        items = [f"{key}={v}"]
        if keep:  # keep the optimizer batch: accumulate more micro batches
            items.append(f"{keep}={keep_value * (value // v)}")
        out.append(Fix(tuple(items)))
    return out


def distill_fixes(cfg: DictConfig) -> list[Fix]:
    t, m = cfg.trainer, cfg.method
    fixes = []
    if not t.activation_checkpointing:
        fixes.append(Fix(("trainer.activation_checkpointing=true",)))
    if t.zero_stage < 3:
        # what trainer=zero3 sets (conf/trainer/zero3.yaml), so that the plan promised is the one trainer=zero3 gets
        zero3 = ["trainer.zero_stage=3", "trainer.precision=bf16", "trainer.activation_checkpointing=true"]
        fixes.append(Fix(tuple(zero3), "as trainer=zero3"))
    fixes += _halvings("trainer.micro_batch_size", t.micro_batch_size, "trainer.grad_accum", t.grad_accum)
    if m.loss in TEACHER_LOSSES and m.teacher == "online":
        fixes.append(Fix(("method.teacher=stored", f"data.topk_logprobs={cfg.data.topk_logprobs or 20}"),
                         "trajectories with stored top-k teachers"))  # fmt: skip
    if m.features == "online" and cfg.model.drafter.kind == "dflash":
        ids = ",".join(str(i) for i in cfg.model.drafter.target_layer_ids or ())
        fixes.append(Fix(("method.features=stored", f"data.feature_layers=[{ids}]"), "features stored by trajectories"))
    if heldout(cfg):
        fixes.append(
            Fix(("trainer.eval_prompts=0",), "no verifier on rank 0; evaluate the exports with stage=evaluate")
        )
    for k in (2, 4):
        nodes = cfg.cluster.nodes * k
        fixes.append(Fix((f"cluster.nodes={nodes}",), f"launcher.nodes={nodes} in the job"))
    return fixes


def _decode_fixes(cfg: DictConfig, role: str, batch_key: str, batch: int) -> list[Fix]:
    fixes = []
    if cfg.cluster.gpus_per_node > 1 and devices_of(cfg, role) < cfg.cluster.gpus_per_node:
        fixes.append(Fix((f"model.{role}.devices=auto",), "its layers over the node's GPUs"))
    return fixes + _halvings(batch_key, batch)


# stage -> the fixes to try, least disruptive first (one signature: (cfg) -> [Fix]).
FIXES: dict[str, Callable[[DictConfig], list[Fix]]] = {
    "distill": distill_fixes,
    "trajectories": lambda cfg: _decode_fixes(cfg, "verifier", "data.batch_size", trajectory_batch(cfg)),
    "evaluate": lambda cfg: _decode_fixes(
        cfg, "verifier", "settings.evaluate.batch_size", settings_of(cfg, "evaluate").batch_size
    ),
    "spot": lambda cfg: _decode_fixes(cfg, "target", "settings.spot.batch_size", settings_of(cfg, "spot").batch_size),
    "spiffy": lambda cfg: _decode_fixes(
        cfg, "target", "settings.spiffy.batch_size", settings_of(cfg, "spiffy").batch_size
    ),
    "sweep": lambda cfg: _decode_fixes(
        cfg, "verifier", "settings.evaluate.batch_size", settings_of(cfg, "evaluate").batch_size
    ),
}


_ABSENT = object()


@contextmanager
def _changed(cfg: DictConfig, change: dict[str, Any]) -> Iterator[DictConfig]:
    """``cfg`` with ``change`` (``{"trainer.zero_stage": 3}``) set in place, restored on exit: a re-plan per fix
    trial without a deep copy of the config each time (a copy costs more than the plan)."""
    old: dict[str, Any] = {}
    for key in change:  # every prefix too, so that nodes the change creates (settings.<stage>) go again
        parts = key.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix not in old:
                old[prefix] = OmegaConf.select(cfg, prefix, default=_ABSENT)
    try:
        with open_dict(cfg):  # settings.<stage> may not be there yet; struct mode refuses new keys
            for key, value in change.items():
                OmegaConf.update(cfg, key, value, merge=False)
        yield cfg
    finally:
        with open_dict(cfg):
            for key in sorted(change, key=len):
                if old[key] is not _ABSENT:
                    OmegaConf.update(cfg, key, old[key], merge=False)
            for prefix in sorted(old, key=lambda k: -k.count(".")):  # deepest first
                if old[prefix] is _ABSENT and OmegaConf.select(cfg, prefix, default=_ABSENT) is not _ABSENT:
                    parent, _, leaf = prefix.rpartition(".")
                    node = OmegaConf.select(cfg, parent) if parent else cfg
                    del node[leaf]


def _replan(name: str, cfg: DictConfig, shapes: Shapes, change: dict[str, Any]) -> StagePlan:
    with _changed(cfg, change):
        return STAGE_PLANNERS[name](cfg, shapes)


def _apply(plan: StagePlan, fixes: list[Fix], peak: int) -> StagePlan:
    plan.fix_overrides = [o for f in fixes for o in f.overrides]
    notes = [f.note for f in fixes if f.note]
    plan.fix = " ".join(plan.fix_overrides) + (f" ({'; '.join(notes)})" if notes else "")
    plan.fix_peak = peak
    return plan


def plan_stage(name: str, cfg: DictConfig, shapes: Shapes) -> StagePlan:
    """Stage ``name``'s plan with its verdict. When it does not fit: the first candidate fix (``FIXES``, least
    disruptive first) that fits on its own; else candidates added greedily, each round the one that lowers the
    peak most (a fix setting the same keys as an earlier one, a smaller micro batch, replaces it), until it fits."""
    plan = STAGE_PLANNERS[name](cfg, shapes)
    if plan.fits:
        return plan
    if plan.refusal is not None:  # not a memory problem: the stage's own limit says what to change
        plan.fix = "raise data.max_feature_gb, or store fewer rows (data.max_prompts) or tokens (data.max_new_tokens)"
        return plan
    fixes = FIXES[name](cfg)
    for fix in fixes:
        fixed = _replan(name, cfg, shapes, fix.change)
        if fixed.fits:
            return _apply(plan, [fix], fixed.peak)
    chosen: dict[frozenset, Fix] = {}  # the keys a fix sets -> that fix
    peak = plan.peak
    while True:
        best = None
        for fix in fixes:
            trial = {**chosen, frozenset(fix.change): fix}
            merged = {k: v for f in trial.values() for k, v in f.change.items()}
            fixed = _replan(name, cfg, shapes, merged)
            if best is None or fixed.peak < best[0].peak:
                best = (fixed, trial)
        if best is None or best[0].peak >= peak:  # nothing lowers it further
            return plan
        peak, chosen = best[0].peak, best[1]
        if best[0].fits:
            return _apply(plan, list(chosen.values()), best[0].peak)


def check(cfg: DictConfig) -> None:
    """ConfigError for a cluster or plan setting that cannot be planned with, naming the fix."""
    c = cfg.cluster
    for key in ("gpu_memory_gib", "hbm_gbps", "bf16_tflops", "gpus_per_node", "intra_node_gbps", "inter_node_gbps",
                "nodes"):  # fmt: skip
        if not c[key] > 0:
            raise ConfigError(f"cluster.{key}={c[key]} must be positive; set it to your node's figure")
    s = assumptions(cfg)
    for key in ("prompt_tokens", "prompts", "eval_methods"):
        if not s[key] >= 1:
            raise ConfigError(f"stage.{key}={s[key]} must be at least 1")
    for key in ("mfu", "bandwidth_efficiency", "usable_memory"):
        if not 0 < s[key] <= 1:
            raise ConfigError(f"stage.{key}={s[key]} is a share: give a value in (0, 1], e.g. stage.{key}=0.4")
    bad = [x for x in s.stages if x not in STAGE_PLANNERS]
    if bad:
        raise ConfigError(
            f"stage.stages={list(s.stages)}: {bad} cannot be planned; choose from {', '.join(STAGE_PLANNERS)}"
        )


def plan_all(cfg: DictConfig) -> list[StagePlan]:
    """Every stage of ``cfg.stage.stages`` (default: :data:`DEFAULT_STAGES`) planned, with verdicts."""
    check(cfg)
    shapes = Shapes(cfg)
    return [plan_stage(name, cfg, shapes) for name in (assumptions(cfg).stages or DEFAULT_STAGES)]
