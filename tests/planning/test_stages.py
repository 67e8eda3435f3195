"""stage=plan on every shipped preset, verdicts whose fixes really fit, the refusals, and the stage itself.

Run: python -m pytest tests/planning/test_stages.py -q
"""

import re

import pytest
import torch
from omegaconf import OmegaConf

from streakline.config import CONF_DIR, ConfigError, compose_config
from streakline.config.overrides import group_options
from streakline.config.schema import STAGES
from streakline.models import Transformer, TransformerConfig, save_pretrained
from streakline.pipelines import run_stage
from streakline.planning.stages import DEFAULT_STAGES, STAGE_PLANNERS
from streakline.planning.verdicts import FIXES, plan_all

A100S = ["stage=plan", "cluster=a100-80g", "cluster.nodes=4"]
# the DFlash pairing the presets ship for (conf/checkpoint/qwen3-8b-dflash.yaml)
DFLASH = ["model.verifier=qwen3-8b", "model.drafter=qwen3-8b-dflash", "method=dflash_ce"]


def test_the_planners_are_a_registry_of_stages():
    assert set(STAGE_PLANNERS) <= set(STAGES) and set(FIXES) == set(STAGE_PLANNERS)
    assert set(DEFAULT_STAGES) == set(STAGE_PLANNERS)


@pytest.mark.parametrize("model", group_options(CONF_DIR, "model"))
def test_every_model_preset_plans_every_stage(model):
    """Real presets at their hub shapes, the tiny worlds at their arch blocks, smol at its GGUF's: no world built,
    no weights read, every stage with a peak, a disk and a time."""
    cfg = compose_config([*A100S, f"model={model}", "trainer=zero3"])
    plans = plan_all(cfg)
    assert [p.stage for p in plans] == list(DEFAULT_STAGES)
    for p in plans:
        assert p.peak > 0 and p.seconds > 0 and p.step > 0, p.stage
        assert all(v >= 0 for v in (*p.memory.values(), *p.disk.values())), p.stage
        assert p.verdict.startswith("fits" if p.fits else "does not fit")


def test_the_dflash_preset_plans_with_its_verifier_features():
    cfg = compose_config([*A100S, *DFLASH, "trainer=zero2", "stage.stages=[distill]"])
    distill = _plan_of(cfg, "distill")
    assert "teacher weights" in distill.memory  # the verifier runs for the online features
    assert distill.memory["DFlash features"] > 0
    stored = _plan_of(cfg, "distill", **{"method.features": "stored"})
    assert "teacher weights" not in stored.memory


def _replan(overrides, stage):
    return _plan_of(compose_config(overrides), stage)


def _plan_of(cfg, stage, **changes):
    """The plan of ``stage`` for ``cfg`` with ``changes`` ({"cluster.nodes": 4}) set in place (one compose)."""
    for key, value in changes.items():
        OmegaConf.update(cfg, key, value, merge=False)
    return next(p for p in plan_all(cfg) if p.stage == stage)


@pytest.mark.parametrize(
    ("overrides", "stage"),
    [
        # DiffuCoder-7B on a node of 40 GB GPUs, ZeRO-2, micro batches of 4 x 8 windows of 2k tokens: past 36 GiB
        (
            [
                "cluster.nodes=1",
                "cluster=a100-40g",
                "model=diffucoder",
                "trainer=zero2",
                "trainer.micro_batch_size=4",
                "data.max_new_tokens=2048",
            ],
            "distill",
        ),  # fmt: skip
        # Qwen2.5-72B (145 GB of bf16) as the trajectory verifier on one 80 GB GPU
        (["model=qwen2.5-72b"], "trajectories"),
    ],
    ids=["distill", "trajectories"],
)
def test_a_config_too_big_says_so_and_its_fix_really_fits(overrides, stage):
    plan = _replan([*A100S, *overrides, "stage.stages=[" + stage + "]"], stage)
    assert not plan.fits
    assert plan.verdict.startswith("does not fit:") and "fix: " in plan.verdict
    assert plan.fix_overrides, plan.verdict
    # the fix is command-line overrides: composed as a user would type them, the stage fits
    fixed = _replan([*A100S, *overrides, "stage.stages=[" + stage + "]", *plan.fix_overrides], stage)
    assert fixed.fits, (plan.fix, fixed.verdict)
    assert fixed.peak == plan.fix_peak


def test_a_small_config_fits_and_names_no_fix():
    plan = _replan([*A100S, "model=diffucoder", "trainer=zero3", "stage.stages=[distill]"], "distill")
    assert plan.fits and plan.fix is None and plan.verdict.startswith("fits:")


def test_more_nodes_lower_zero3_memory_but_not_zero2_weights():
    base = [*A100S, "model=diffucoder", "stage.stages=[distill]"]
    cfg = compose_config([*base, "trainer=zero3"])
    weights = {}
    for zero in (3, 2):
        changes = {"trainer.zero_stage": zero}
        weights[zero] = [_plan_of(cfg, "distill", **changes, **{"cluster.nodes": n}).memory["weights"] for n in (1, 4)]
    z3, z2 = weights[3], weights[2]
    assert z3[1] < z3[0] and z2[1] == z2[0]


def test_stored_features_past_the_limit_are_the_stages_own_refusal():
    overrides = [*A100S, *DFLASH, "data.feature_layers=[2,10,18,26,34]", "data.max_prompts=100000",
                 "stage.stages=[trajectories]"]  # fmt: skip
    plan = _replan(overrides, "trajectories")
    assert not plan.fits and "data.max_feature_gb" in plan.verdict
    assert plan.disk["features"] > 50e9


def test_bad_plan_settings_are_one_line_config_errors():
    cfg = compose_config(["stage=plan"])  # one compose; each bad value set in place, then put back
    cases = [
        ("cluster.gpu_memory_gib", 0.0, "cluster.gpu_memory_gib=0.0 must be positive"),
        ("stage.mfu", 1.5, "stage.mfu=1.5 is a share"),
        ("stage.stages", ["doctor"], "['doctor'] cannot be planned; choose from trajectories"),
    ]
    for key, value, message in cases:
        good = OmegaConf.select(cfg, key)
        OmegaConf.update(cfg, key, value, merge=False)
        with pytest.raises(ConfigError, match=re.escape(message)) as err:
            plan_all(cfg)
        assert "\n" not in str(err.value)
        OmegaConf.update(cfg, key, good, merge=False)


def test_a_role_of_unknown_shapes_names_the_fix():
    cfg = compose_config(["stage=plan", "model=diffucoder", "model.drafter.hub_id=streakline-tests/absent"])
    with pytest.raises(ConfigError, match=r"set model\.drafter\.path to a folder holding its config\.json"):
        plan_all(cfg)


def test_a_folder_is_planned_from_its_config_json(tmp_path):
    cfg = TransformerConfig(
        vocab_size=96, hidden_size=48, intermediate_size=80, num_layers=3, num_heads=4, num_kv_heads=2, qkv_bias=True
    )
    save_pretrained(Transformer(cfg).to(torch.float32), tmp_path / "verifier")
    plan = _replan(
        ["stage=plan", "model=diffucoder", f"model.verifier.path={tmp_path / 'verifier'}", "stage.stages=[evaluate]"],
        "evaluate",
    )
    assert plan.memory["verifier weights"] == cfg.num_parameters() * 2  # the preset's bf16


def test_stage_plan_prints_and_writes_nothing(tmp_path, capsys):
    cfg = compose_config([*A100S, "model=tiny", f"run_root={tmp_path / 'runs'}"])
    result = run_stage(cfg)
    text = capsys.readouterr().out
    for stage in DEFAULT_STAGES:
        assert f"== {stage}:" in text
    assert "verdict: fits" in text and set(result.metrics) == set(DEFAULT_STAGES)
    # no world was built and no run folder or checkpoint written
    assert result.folder is None
    assert not any(p.is_file() for p in (tmp_path / "runs").rglob("*"))


def test_a_measured_mfu_replaces_the_default(tmp_path):
    """The median of a run's logged MFU (telemetry's metrics.jsonl: null on CPU steps, other keys around it)."""
    run = tmp_path / "distill-run"
    run.mkdir()
    lines = ['{"step": 10, "mfu": 0.2}', '{"step": 20, "mfu": null}', '{"step": 30, "mfu": 0.3, "loss": 1.0}',
             '{"step": 40, "mfu": 0.5}', '{"step": 40, "eval/tiny-math/sim_streak": 1.2}']  # fmt: skip
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    # one node (NVLink) and long rows: compute bound, so the step time scales with 1 / MFU
    base = [*A100S, "cluster.nodes=1", "data.max_new_tokens=1024", "model=diffucoder", "trainer=zero3",
            "stage.stages=[distill]", "stage.mfu=0.6"]  # fmt: skip
    cfg = compose_config(base)
    default = _plan_of(cfg, "distill")
    measured = _plan_of(cfg, "distill", **{"stage.mfu_from": str(run)})
    assert "MFU 0.60" in default.notes[-2] and "MFU 0.30" in measured.notes[-2]
    assert measured.step == pytest.approx(default.step * 0.6 / 0.3)
    (run / "metrics.jsonl").write_text('{"step": 10, "mfu": null}\n')
    with pytest.raises(ConfigError, match="logs no MFU"):
        _plan_of(cfg, "distill")


def test_trying_fixes_leaves_the_config_as_it_was():
    """Fix trials change the config in place and restore it, including nodes they create (settings.spot)."""
    cfg = compose_config(["stage=plan", "model=diffucoder", "cluster=a100-80g", "cluster.gpu_memory_gib=16",
                          "cluster.gpus_per_node=1", "stage.stages=[spot,distill]"])  # fmt: skip
    before = OmegaConf.to_yaml(cfg)
    spot, distill = plan_all(cfg)
    assert not spot.fits and spot.fix is None  # SDAR-8B's 15.3 GiB of weights: no smaller batch helps
    assert not distill.fits
    assert OmegaConf.to_yaml(cfg) == before and "spot" not in cfg.settings


def test_lora_trains_the_adapters_only():
    cfg = compose_config([*A100S, "model=diffucoder", "trainer=zero2", "stage.stages=[distill]"])
    full = _plan_of(cfg, "distill")
    lora = _plan_of(cfg, "distill", **{"trainer.lora.enabled": True})
    # rank 16 on q/k/v/o of 28 layers: about 10M adapter parameters against 7.6B
    assert lora.memory["optimizer states"] < full.memory["optimizer states"] / 200
    assert full.memory["weights"] < lora.memory["weights"] < full.memory["weights"] * 1.01


def _distill_plan(*overrides):
    return _replan([*A100S, "model=diffucoder", "stage.stages=[distill]", *overrides], "distill")


def test_distill_is_timed_in_the_precision_its_trainer_multiplies_in():
    """An fp32 trainer under autocast (the default) runs bf16 GEMMs; with trainer.autocast=off they are fp32, 16x
    slower on an A100 (19.5 against 312 TFLOP/s). The gradients an fp32 trainer reduces are fp32: twice the bytes of
    a bf16 trainer's. Its checkpoints hold 12 bytes a parameter (fp32 weights and two moments), a bf16 trainer's 14."""
    one = ["cluster.nodes=1", "cluster.gpus_per_node=1", "trainer=zero2", "trainer.precision=fp32"]
    amp, off = _distill_plan(*one), _distill_plan(*one, "trainer.autocast=off")
    assert off.step / amp.step == pytest.approx(312 / 19.5)
    assert "in bf16 at MFU" in " ".join(amp.notes) and "in fp32 at MFU" in " ".join(off.notes)

    def moved(plan) -> float:
        return float(re.search(r"moves ([0-9.]+) GB per rank", " ".join(plan.notes)).group(1))

    fp32, bf16 = _distill_plan("trainer=zero2", "trainer.precision=fp32"), _distill_plan("trainer=zero2")
    assert moved(fp32) == pytest.approx(2 * moved(bf16), rel=0.02)
    per = {p: plan.disk["DeepSpeed checkpoints"] for p, plan in (("fp32", fp32), ("bf16", bf16))}
    assert per["fp32"] / per["bf16"] == pytest.approx(12 / 14)


def test_the_zero3_fix_is_the_plan_trainer_zero3_gets():
    """The fix labelled "as trainer=zero3", pasted back, plans exactly what trainer=zero3 does."""
    base = ["cluster.nodes=1", "cluster=a100-40g", "trainer=zero2", "trainer.micro_batch_size=4",
            "data.max_new_tokens=2048"]  # fmt: skip
    fix = next(f for f in FIXES["distill"](compose_config([*A100S, "model=diffucoder", *base])) if "zero3" in f.note)
    pasted = _distill_plan(*base, *fix.overrides)
    zero3 = _distill_plan(*[o for o in base if not o.startswith("trainer=")], "trainer=zero3")
    assert (pasted.peak, pasted.step, pasted.disk) == (zero3.peak, zero3.step, zero3.disk)
