"""stage=sweep (the nightly Fig. 7) and stage=pipeline (a chain of stages) on the micro world.
Run: ``python -m pytest tests/pipelines/test_sweep_and_pipeline.py``."""

import json
from pathlib import Path

import pytest

from streakline.artifacts import read_manifest
from streakline.config import compose_config
from streakline.evaluation.results import steps_curves
from streakline.pipelines import run_stage
from streakline.pipelines.common.lookup import stage_overrides
from streakline.world import attach_world
from tests.pipelines.test_distill import DATA, TRAIN

# the micro verifier repeats one token: degenerate_share=1 keeps tiny-math in the headline, so the figures are drawn
EVAL = ["settings.evaluate.benchmarks=[tiny-math]", "settings.evaluate.prompts=2", "settings.evaluate.max_new_tokens=8",
        "settings.evaluate.degenerate_share=1.0"]  # fmt: skip


def _common(root, experiment):
    return ["model=micro", f"run_root={root}", f"experiment.name={experiment}", *DATA, *TRAIN, *EVAL,
            "trainer.max_steps=4", "trainer.save_every=2", "trainer.eval_every=4"]  # fmt: skip


def _lines(path):
    return [json.loads(x) for x in Path(path).read_text().splitlines()]


def test_sweep_appends_one_point_per_new_checkpoint_and_skips_evaluated_ones(micro_world):
    root = micro_world[0]
    common = _common(root, "nightly")
    run_stage(compose_config(["stage=trajectories", *common]))
    first = run_stage(compose_config(["stage=sweep", *common, "stage.train=['method=ce_streak']"]))
    # Checkpoints at steps 2 and 4 (the final drafter holds step 4's weights) and step 0, the preset's drafter before
    # distillation: one point each, one benchmark.
    assert first.metrics["new_points"] == 3
    history = _lines(first.artifact)
    points = [r for r in history if r["checkpoint"]]
    assert sorted(r["steps"] for r in points) == [0, 2, 4]
    assert all(r["lossless"] for r in points)
    (base,) = [r for r in points if r["steps"] == 0]
    assert base["method"] == "base" and base["drafter"] is None and base["settings"]["distill_loss"] is None
    assert base["checkpoint"] == attach_world(compose_config(["stage=sweep", *common])).model.drafter.path
    assert all(r["settings"]["distill_loss"] == "ce_streak" for r in points if r["steps"])
    assert {r["method"] for r in history if not r["checkpoint"]} == {"vanilla", "ar_draft"}
    assert Path(first.details["figure"]).read_bytes()[:4] == b"\x89PNG"
    # The next night: nothing new, nothing appended.
    again = run_stage(compose_config(["stage=sweep", *common, "stage.train=['method=ce_streak']"]))
    assert again.metrics["new_points"] == 0 and _lines(again.artifact) == history
    # A new run appears (another method): exactly its checkpoints are added (step 0 is in the history already).
    third = run_stage(compose_config(["stage=sweep", *common, "stage.train=['method=ce_streak', 'method=ar_distill']"]))
    assert third.metrics["new_points"] == 2
    added = _lines(third.artifact)[len(history) :]
    assert sorted(r["steps"] for r in added if r["checkpoint"]) == [2, 4]
    assert {r["settings"]["distill_loss"] for r in added if r["checkpoint"]} == {"ar_distill"}
    # Fig. 7 from the whole history: both lines start at the one step-0 point.
    _, curves = steps_curves(_lines(third.artifact), 0.0)
    assert {loss: [s for s, _ in pts] for loss, pts in curves["tiny-math"].items()} == {
        "ce_streak": [0, 2, 4],
        "ar_distill": [0, 2, 4],
    }


def test_pipeline_runs_the_chain_and_a_rerun_is_cached(micro_world, capsys):
    root = micro_world[0]
    chain = "experiment.stages=[trajectories, 'distill method=ce_streak', 'evaluate stage.k_grid=[1]']"
    cfg = compose_config(["stage=pipeline", *_common(root, "chain"), "settings.evaluate.drafter_temperature_grid=[1.0]",
                          "settings.evaluate.temperatures=[0.0]", chain])  # fmt: skip
    assert stage_overrides(cfg, "distill method=ce_streak")[1][-2:] == ["stage=distill", "method=ce_streak"]
    out = run_stage(cfg)
    assert [s["stage"] for s in out.details["stages"]] == ["trajectories", "distill method=ce_streak",
                                                   "evaluate stage.k_grid=[1]"]  # fmt: skip
    report = out.details["report"]
    methods = {r["method"] for r in report.details["records"]}
    assert {"vanilla", "ar_draft", "base", "ce_streak", "grid K=1 tau=1", "ce_streak@2"} <= methods
    assert all(r["lossless"] for r in report.details["records"])
    # Fig. 7 from one evaluation: the intermediate checkpoint (step 2), the final drafter (4) and step 0, the base
    # drafter's row, which is evaluated once; the figure is drawn.
    _, curves = steps_curves(report.details["records"])
    assert {loss: [s for s, _ in pts] for loss, pts in curves["tiny-math"].items()} == {"ce_streak": [0, 2, 4]}
    assert [r["method"] for r in report.details["records"] if r["steps"] == 0] == ["base"]
    assert Path(report.details["figures"]["fig7_speedup_vs_steps.png"]).read_bytes()[:4] == b"\x89PNG"
    assert "## Speedup vs distillation steps (Fig. 7), T=0" in Path(report.details["markdown"]).read_text()
    # Every temperature of a distilled row: the verifier's, the drafter's as drafted, and those it was trained with.
    (row,) = [r for r in report.details["records"] if r["method"] == "ce_streak"]
    trained = read_manifest(Path(row["drafter"]).parent).config["method"]["drafter_temperature"]
    assert trained is not None and row["settings"]["train_drafter_temperature"] == trained
    data = (row["settings"]["data_temperature"], row["settings"]["data_top_p"])
    assert data == (cfg.data.temperature, cfg.data.top_p)
    assert row["settings"]["drafter_temperature"] == cfg.decoder.drafter_temperature and row["temperature"] == 0.0
    (base,) = [r for r in report.details["records"] if r["method"] == "base"]
    assert base["settings"]["train_drafter_temperature"] is None and base["settings"]["data_temperature"] is None
    assert "report: " in capsys.readouterr().out
    again = run_stage(cfg)
    assert again.details["report"].cached and again.details["report"].folder == report.folder


def test_pipeline_refuses_an_unknown_stage_in_the_chain():
    with pytest.raises(Exception, match="choose from"):
        compose_config(["stage=pipeline", "experiment.stages=['distil method=streak']"])
