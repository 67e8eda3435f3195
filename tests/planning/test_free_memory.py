"""The check at distill start on a GPU (planning/free_memory.py), on CPU: the message for planned against free bytes,
the plan sized to the run's ranks and to the free memory, rank 0's held-out verifier, and a stage's own settings.

Run: python -m pytest tests/planning/test_free_memory.py -q
"""

from omegaconf import OmegaConf

from streakline.config import compose_config
from streakline.planning.free_memory import distill_start_check, free_memory_message, peak_against_plan, plan_for_rank
from streakline.planning.memory import GIB
from streakline.planning.stages import Shapes, plan_distill, plan_evaluate

# DiffuCoder-7B planned at its hub shapes on the meta device: ZeRO-2 over 8 GPUs, the held-out verifier on rank 0
DISTILL = ["stage=distill", "model=diffucoder", "trainer=zero2"]


def test_a_plan_within_the_free_memory_fits_and_says_by_how_much():
    fits, line = free_memory_message(planned=20 * GIB, free=75 * GIB, device="cuda:0", rank=0)
    assert fits and "20.0 GiB of 75.0 GiB free" in line and "WARNING" not in line


def test_a_plan_over_the_free_memory_warns_once_naming_the_fix():
    fits, line = free_memory_message(planned=90 * GIB, free=79 * GIB, device="cuda:3", rank=3,
                                     fix="trainer.activation_checkpointing=true", fix_peak=40 * GIB)  # fmt: skip
    assert not fits and "\n" not in line
    assert "WARNING" in line and "cuda:3 (rank 3)" in line and "90.0 GiB but 79.0 GiB is free" in line
    assert "fix: trainer.activation_checkpointing=true (40.0 GiB)" in line
    assert "trainer.plan_check=false" in line and "training goes on" in line
    _, none = free_memory_message(planned=90 * GIB, free=79 * GIB, device="cuda:0", rank=0)
    assert "no change the planner tries fits it" in none


def test_the_plan_is_sized_to_the_run_and_its_free_memory():
    cfg = compose_config(DISTILL)
    plan = plan_for_rank(cfg, free=70 * GIB, rank=0, world=16, gpus_per_node=8)
    assert plan.gpus == 16 and abs(plan.usable - 70 * GIB) <= 1  # the free memory is what it must fit in
    assert cfg.cluster.nodes == 1 and cfg.cluster.name == "cpu" and "plan" not in cfg.settings  # cfg untouched
    # planned as the GPUs it runs on, not as cluster=cpu (whose masks SDPA's CPU path keeps per layer)
    assert plan.memory["attention masks"] == _masks_planned_on(cfg, "a100-80g")
    # ZeRO-2 divides the optimizer states by the ranks
    fewer = plan_for_rank(cfg, free=70 * GIB, rank=0, world=8, gpus_per_node=8)
    assert fewer.memory["optimizer states"] > plan.memory["optimizer states"]


def _masks_planned_on(cfg, cluster):
    """The attention-mask term of ``cfg``'s distill plan on ``cluster``."""
    other = compose_config([*DISTILL, f"cluster={cluster}"])
    return plan_distill(other, Shapes(other)).memory["attention masks"]


def test_only_rank_0_holds_the_held_out_verifier():
    cfg = compose_config(DISTILL)
    zero = plan_for_rank(cfg, free=200 * GIB, rank=0, world=8, gpus_per_node=8)
    other = plan_for_rank(cfg, free=200 * GIB, rank=1, world=8, gpus_per_node=8)
    held = zero.memory["held-out verifier (rank 0)"]
    assert held > 10 * GIB and "held-out verifier (rank 0)" not in other.memory
    assert zero.peak - other.peak == held


def test_distill_start_names_the_planners_fix_when_the_gpu_is_short():
    cfg = compose_config(DISTILL)
    big = plan_for_rank(cfg, free=10**15, rank=0, world=8, gpus_per_node=8)
    fits, line, planned = distill_start_check(
        cfg, free=big.peak // 2, rank=0, world=8, gpus_per_node=8, device="cuda:0"
    )
    assert not fits and "WARNING" in line and "fix: " in line and planned == big.peak
    fixed = plan_for_rank(cfg, free=big.peak // 2, rank=0, world=8, gpus_per_node=8)
    assert fixed.fix is not None and fixed.fix.split(" (")[0] in line  # the verdict's own fix, as overrides
    fits, line, _ = distill_start_check(cfg, free=2 * big.peak, rank=0, world=8, gpus_per_node=8, device="cuda:0")
    assert fits and "WARNING" not in line


def test_a_config_the_planner_cannot_plan_never_stops_the_run():
    cfg = compose_config([*DISTILL, "model.drafter.hub_id=nobody/unknown-model"])
    fits, line, planned = distill_start_check(cfg, free=GIB, rank=0, world=1, gpus_per_node=1, device="cuda:0")
    assert fits and "no plan to check" in line and planned is None


def test_the_end_of_run_line_sets_the_measured_peak_beside_the_plan():
    metrics, line = peak_against_plan(planned=20 * GIB, allocated=23 * GIB, reserved=26 * GIB, device="cuda:0",
                                      rank=0)  # fmt: skip
    assert metrics == {"plan_peak_gib": 20.0, "peak_allocated_gib": 23.0, "peak_reserved_gib": 26.0,
                       "peak_over_plan": 1.15}  # fmt: skip
    assert "\n" not in line and "23.00 GiB allocated, 26.00 GiB reserved" in line
    assert "the plan said 20.00 GiB (measured / planned 1.15)" in line


def test_a_stage_is_planned_with_its_own_command_line_settings():
    """stage=evaluate stage.batch_size=8 plans batch 8 (settings.evaluate is for other stages' configs)."""
    cfg = compose_config(["stage=evaluate", "model=tiny", "stage.batch_size=8"])
    eight = plan_evaluate(cfg, Shapes(cfg))
    OmegaConf.update(cfg, "stage.batch_size", 1)
    one = plan_evaluate(cfg, Shapes(cfg))
    assert eight.memory["verifier KV cache"] == 8 * one.memory["verifier KV cache"]
