"""The plan as text: a header with the cluster and the assumptions, then per stage its memory per GPU by what it is
for, its disk, its time and its verdict, and the reasoning lines under it.

    print(format_plan(cfg, plans))

Tests: ``python -m pytest tests/planning -q``.
"""

from __future__ import annotations

from omegaconf import DictConfig

from .memory import GIB
from .stages import StagePlan, assumptions, mfu, usable, world
from .timing import human_seconds

WIDTH = 34  # the label column


def _row(label: str, value: str, extra: str = "") -> str:
    return f"    {label:<{WIDTH}}{value:>12}{('  ' + extra) if extra else ''}"


def header(cfg: DictConfig) -> list[str]:
    c, a = cfg.cluster, assumptions(cfg)
    return [
        f"plan: model={cfg.model.name} (verifier {cfg.model.verifier.name}, drafter {cfg.model.drafter.name}, "
        f"target {cfg.model.target.name}) on cluster={c.name}: {c.nodes} node(s) x {c.gpus_per_node} GPUs = "
        f"{world(cfg)} GPUs of {c.gpu_memory_gib:g} GiB ({usable(cfg) / GIB:.1f} GiB usable each)",
        f"assumed: prompts of {a.prompt_tokens} tokens, {a.prompts} trajectory prompts when data.max_prompts is "
        f"null, MFU {mfu(cfg):.2f}{' measured in ' + a.mfu_from if a.mfu_from else ''}, "
        f"{a.bandwidth_efficiency:.0%} of HBM bandwidth per decode step "
        "(stage.prompt_tokens, stage.prompts, stage.mfu or stage.mfu_from, stage.bandwidth_efficiency)",
    ]


def format_stage(plan: StagePlan) -> list[str]:
    lines = [f"== {plan.stage}: {plan.what}", "  memory per GPU"]
    for label, n in plan.memory.items():
        lines.append(_row(label, f"{n / GIB:.2f} GiB"))
    lines.append(_row("peak", f"{plan.peak / GIB:.2f} GiB", f"of {plan.usable / GIB:.1f} usable"))
    lines.append("  disk")
    for label, n in plan.disk.items():
        lines.append(_row(label, f"{n / 1e9:.1f} GB"))
    lines.append("  time")
    lines.append(_row(f"one {plan.step_label}", human_seconds(plan.step)))
    lines.append(_row("whole stage", human_seconds(plan.seconds), f"on {plan.gpus} GPU(s)"))
    lines.append(f"  verdict: {plan.verdict}")
    lines += [f"    - {note}" for note in plan.notes]
    return lines


def format_plan(cfg: DictConfig, plans: list[StagePlan]) -> str:
    """The whole plan, one stage after another."""
    lines = header(cfg)
    for plan in plans:
        lines += ["", *format_stage(plan)]
    return "\n".join(lines)
