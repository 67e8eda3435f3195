"""The check at distill start on a GPU: this rank's planned peak against the free memory the rank finds there.

``stage=distill`` on CUDA asks ``torch.cuda.mem_get_info`` on every rank (the one CUDA call, in
``pipelines/distill.py``) and hands the free bytes to :func:`distill_start_check`. The distill plan is made for the
run as it is: ``cluster.nodes x cluster.gpus_per_node`` are its ranks (ZeRO divides by them), and the free memory is
the usable memory of each GPU, so the verdict's fix (``verdicts.FIXES``) is the change that makes this run fit the
memory it found. Rank 0 holds the held-out verifier; the other ranks are planned without it.

A plan over the free memory prints one warning line naming the fix, and training goes on: the plan is an estimate
(docs/planning.md, "At distill start on a GPU"), and a run that would have fit must not be stopped by it. That differs
from a Slurm submission, which is refused before it queues (``gate.py``): nothing has started there and the fix is
cheap to apply. ``trainer.plan_check=false`` skips the check.

    fits, line, planned = distill_start_check(cfg, free=free_bytes, rank=0, world=8, gpus_per_node=8, device="cuda:0")
    free_memory_message(planned=90 * GIB, free=79 * GIB, device="cuda:0", rank=0, fix="trainer.zero_stage=3 ...")
    metrics, line = peak_against_plan(planned=planned, allocated=..., reserved=..., device="cuda:0", rank=0)

At the end of the run rank 0 sets the peak CUDA memory its tensors took (``torch.cuda.max_memory_allocated``) and
what the caching allocator held for them (``max_memory_reserved``) beside its plan (:func:`peak_against_plan`): it
prints the line and the run's metrics record the figures, so every GPU run measures the planner (``bench/gpu.sh``
collects the lines of its distill parts).

Tests: ``python -m pytest tests/planning/test_free_memory.py -q``.
"""

from __future__ import annotations

import copy

from omegaconf import DictConfig, OmegaConf, open_dict

from streakline.errors import UserError

from .memory import GIB
from .stages import Shapes, StagePlan
from .verdicts import plan_stage

SKIP = "trainer.plan_check=false skips this check"


def free_memory_message(
    *, planned: int, free: int, device: str, rank: int, fix: str | None = None, fix_peak: int | None = None
) -> tuple[bool, str]:
    """``(fits, line)``: whether ``planned`` bytes fit in the ``free`` bytes of ``device``, and the line to print.
    Over the free memory the line is a warning naming ``fix`` (with the peak it plans, ``fix_peak``), or saying that
    no change the planner tries fits it."""
    where = f"{device} (rank {rank})"
    if planned <= free:
        return True, (f"distill: the plan's peak on {where} is {planned / GIB:.1f} GiB of {free / GIB:.1f} GiB free")
    if fix is None:
        remedy = "no change the planner tries fits it (more nodes, a larger GPU or a smaller model)"
    else:
        remedy = f"fix: {fix}" + (f" ({fix_peak / GIB:.1f} GiB)" if fix_peak is not None else "")
    return False, (
        f"distill: WARNING the plan's peak on {where} is {planned / GIB:.1f} GiB but {free / GIB:.1f} GiB is free; "
        f"{remedy}; training goes on (the plan is an estimate; {SKIP})"
    )


def plan_for_rank(cfg: DictConfig, *, free: int, rank: int, world: int, gpus_per_node: int) -> StagePlan:
    """stage=distill's plan, with its verdict, for rank ``rank`` of ``world`` ranks (``gpus_per_node`` a node) whose
    GPU has ``free`` bytes free: the cluster sized to the run, the usable memory of a GPU that free memory (the CUDA
    context this process made is already out of it), and for a rank other than 0 no held-out verifier. ``cfg`` is
    left as it was."""
    cfg = copy.deepcopy(cfg)
    local = max(1, min(gpus_per_node, world))
    with open_dict(cfg):
        cfg.cluster.name = "cuda"  # this run's GPUs, whatever cluster= says (cpu, the default, plans SDPA's CPU path)
        cfg.cluster.nodes = max(1, world // local)
        cfg.cluster.gpus_per_node = local
        cfg.cluster.gpu_memory_gib = free / GIB
        OmegaConf.update(cfg, "settings.plan.usable_memory", 1.0, merge=True)
        if rank != 0:  # only rank 0 builds the held-out evaluator's verifier (pipelines/distill.py)
            cfg.trainer.eval_prompts = 0
    return plan_stage("distill", cfg, Shapes(cfg))


def distill_start_check(
    cfg: DictConfig, *, free: int, rank: int, world: int, gpus_per_node: int, device: str
) -> tuple[bool, str, int | None]:
    """``(fits, line, planned)`` for this rank at distill start (see the module docstring): ``planned`` is the plan's
    peak in bytes, for :func:`peak_against_plan` at the end. A config the planner cannot plan (shapes it cannot
    find) fits, with a line saying so and no peak: the check never stops a run."""
    try:
        plan = plan_for_rank(cfg, free=free, rank=rank, world=world, gpus_per_node=gpus_per_node)
    except UserError as e:
        return True, f"distill: no plan to check against the free memory on {device} ({e}); {SKIP}", None
    fits, line = free_memory_message(
        planned=plan.peak, free=free, device=device, rank=rank, fix=plan.fix, fix_peak=plan.fix_peak
    )
    return fits, line, plan.peak


def peak_against_plan(*, planned: int, allocated: int, reserved: int, device: str, rank: int) -> tuple[dict, str]:
    """``(metrics, line)`` at the end of a GPU run: the peak bytes its tensors took (``allocated``) and the caching
    allocator held (``reserved``) against the plan's ``planned`` peak. The plan models the tensors, so
    ``allocated / planned`` is the planner's error; what ``reserved`` adds is the allocator's slack, which
    ``settings.plan.usable_memory`` leaves room for (docs/planning.md)."""
    ratio = allocated / planned if planned > 0 else float("nan")
    metrics = {
        "plan_peak_gib": round(planned / GIB, 3),
        "peak_allocated_gib": round(allocated / GIB, 3),
        "peak_reserved_gib": round(reserved / GIB, 3),
        "peak_over_plan": round(ratio, 3),
    }
    line = (
        f"distill: peak on {device} (rank {rank}): {allocated / GIB:.2f} GiB allocated, {reserved / GIB:.2f} GiB "
        f"reserved; the plan said {planned / GIB:.2f} GiB (measured / planned {ratio:.2f})"
    )
    return metrics, line
