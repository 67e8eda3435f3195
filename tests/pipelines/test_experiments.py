"""Every shipped experiment (``conf/experiment/*.yaml``, found on disk, so a new file is covered without editing this
one) runs end to end with ``stage=pipeline`` on the micro world, shrunk by overrides that change sizes only; an
experiment that lists no stages is refused with a clear error. Run:
``python -m pytest tests/pipelines/test_experiments.py`` (about 2 minutes on 2 cores, the micro world included)."""

import json
import shlex
from pathlib import Path

import pytest

from streakline.artifacts import read_manifest
from streakline.config import ConfigError, compose_config
from streakline.evaluation.results import line_name, steps_curves
from streakline.pipelines import run_stage
from streakline.pipelines.common.lookup import stage_overrides
from streakline.pipelines.evaluate import discover
from streakline.world import attach_world

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml"))

# Sizes only: what the experiment itself sets (its chain, data.topk_logprobs, methods, grids) is what is tested.
SMALL = [
    "data.prompt_sources=[tiny-math-train]",  # tiny-code-train parses the stdlib's files: seconds per stage
    "data.mix_weights=[]",
    "data.max_prompts=8",
    "data.samples_per_prompt=1",
    "data.max_new_tokens=16",
    "data.num_shards=2",
    "data.batch_size=8",
    "trainer.max_steps=4",
    "trainer.save_every=2",  # a checkpoint at step 2 and the final one at 4: Fig. 7 curves of 3 points with step 0
    "trainer.eval_every=4",
    "trainer.eval_prompts=1",
    "trainer.eval_sources=[tiny-math]",
    "settings.evaluate.degenerate_share=1.0",  # the micro verifier repeats one token: keep the figures drawn
    "trainer.micro_batch_size=2",
    "trainer.warmup_steps=1",
    "trainer.windows_per_seq=4",
    "trainer.wandb_project=null",
    "settings.evaluate.prompts=1",
    "settings.evaluate.max_new_tokens=8",
    "settings.evaluate.benchmarks=[tiny-math]",
    "settings.spot.prompt_sources=[tiny-math-train]",
    "settings.spot.prompts=4",
    "settings.spot.max_new_tokens=8",
    "settings.spot.num_shards=1",
    "settings.spot.batch_size=4",
    "settings.spot.d_model=32",
    "settings.spot.layers=1",
    "settings.spot.heads=4",
    "settings.spot.ffn=64",
    "settings.spot.max_block=8",
    "settings.spot.steps=5",
    "settings.spot.train_batch=16",
    "settings.spiffy.prompt_sources=[tiny-math-train]",
    "settings.spiffy.prompts=2",
    "settings.spiffy.max_new_tokens=8",
    "settings.spiffy.horizon=3",
    "settings.spiffy.batch_size=2",
    "settings.scaling.throughput_steps=2",
    "settings.scaling.global_batch=2",
    "settings.scaling.data_sizes=[8]",
]


# An entry's own step counts are sizes too (smol_e2e trains its DFlash drafters longer): they give way to SMALL's.
ENTRY_SIZES = ("trainer.max_steps", "trainer.save_every")


def _small_entry(entry: str) -> str:
    words = shlex.split(entry)
    kept = [w for w in words if w.split("=", 1)[0] not in ENTRY_SIZES]
    return entry if kept == words else shlex.join(kept)


def _config(root, experiment):
    overrides = ["stage=pipeline", "model=micro", f"experiment={experiment}", f"run_root={root}", *SMALL]
    cfg = compose_config(overrides)
    scaling = cfg.settings.get("scaling") or {}
    if scaling.get("world_sizes", [1]):  # more ranks start torchrun: tests/pipelines/test_scaling.py runs 1 and 2
        overrides.append("settings.scaling.world_sizes=[1]")
    if scaling.get("token_sizes"):  # subsets of the 8 x 16-token set, and no extra seed
        overrides += ["settings.scaling.token_sizes=[30,60]", "settings.scaling.seeds=[]"]
    cfg = compose_config(overrides)
    if cfg.data.feature_layers:  # layer ids are a shape, like the sizes above: the micro DFlash drafter's
        layers = compose_config(["model=micro", "model.drafter=micro-dflash"]).model.drafter.target_layer_ids
        cfg = compose_config([*overrides, f"data.feature_layers=[{','.join(map(str, layers))}]"])
    cfg.experiment.stages = [_small_entry(e) for e in cfg.experiment.stages]
    return cfg


def _manifest_folder(output: Path, root: Path) -> Path | None:
    """The run folder (the one holding manifest.json) that a stage's output lies in, if it has one."""
    for folder in (output, *output.parents):
        if (folder / "manifest.json").is_file():
            return folder
        if folder == root:
            return None
    return None


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_shipped_experiment_runs_end_to_end(micro_world, experiment):
    root = Path(micro_world[0])
    if not compose_config(["stage=doctor", f"experiment={experiment}", *SMALL]).experiment.stages:
        with pytest.raises(ConfigError, match=rf"experiment='{experiment}' lists none; pick one such as"):
            _config(root, experiment)
        return
    cfg = _config(root, experiment)
    out = run_stage(cfg)

    # Every stage ran, in the listed order, and left a complete result.
    assert [s["stage"] for s in out.details["stages"]] == list(cfg.experiment.stages)
    for step in out.details["stages"]:
        output = Path(step["output"])
        assert output.exists(), step
        folder = _manifest_folder(output, root)
        if step["stage"].split()[0] != "sweep":  # the sweep keeps a history, not a run folder
            assert folder is not None and read_manifest(folder).status == "complete", step

    names = [entry.split()[0] for entry in cfg.experiment.stages]
    if "evaluate" in names:
        report = out.details["report"]
        doc = json.loads((report.folder / "results.json").read_text())
        records = doc["records"]
        assert records and all(r["lossless"] for r in records), [r["method"] for r in records if not r["lossless"]]
        entry = next(e for e in cfg.experiment.stages if e.split()[0] == "evaluate")  # with the entry's overrides
        evaluation = attach_world(compose_config(stage_overrides(cfg, entry)[1]))
        expected = {m.name for m in discover(evaluation)}
        assert expected <= {r["method"] for r in records}
        # Fig. 7: every distilled loss has its checkpoints and the base drafter at step 0 (unless the experiment
        # leaves the undistilled rows out: stage.base=false, make demo), and the figure is drawn; a DFlash drafter's
        # line (dflash:<loss>) starts at dflash:base, what its run started from.
        _, curves = steps_curves(records)
        losses = {line_name(r["settings"]["distill_loss"], r["decoder"])
                  for r in records if r["settings"].get("distill_loss")}  # fmt: skip
        base = evaluation.stage.base
        for loss in losses:
            assert [s for s, _ in curves["tiny-math"][loss]] == ([0, 2, 4] if base else [2, 4]), loss
            start = "dflash:base" if loss.startswith("dflash:") else "base"
            if base:
                assert curves["tiny-math"][loss][0][1]["method"] == start, loss
            else:
                assert not any(r["method"] == start for r in records), loss
        if losses:
            assert "fig7_speedup_vs_steps.png" in report.details["figures"]
    if "sweep" in names:
        sweep = next(s for s in out.details["stages"] if s["stage"].split()[0] == "sweep")
        history = [json.loads(x) for x in Path(sweep["output"]).read_text().splitlines()]
        points = [r for r in history if r.get("checkpoint")]
        trained = {e.split("=", 1)[1].split()[0] for e in cfg.settings.sweep.train}
        by_loss = {r["settings"]["distill_loss"]: [] for r in points if r["steps"]}
        for r in points:
            if r["steps"]:
                by_loss[r["settings"]["distill_loss"]].append(r["steps"])
        assert {loss: sorted(steps) for loss, steps in by_loss.items()} == dict.fromkeys(trained, [2, 4])
        assert [r["steps"] for r in points if r["method"] == "base"] == [0]  # step 0, once
        assert all(r["lossless"] for r in history)
        assert (Path(sweep["output"]).parent / "fig7_speedup_vs_steps.png").read_bytes()[:4] == b"\x89PNG"


def test_tiny_e2e_saves_checkpoints_for_a_fig7_curve():
    """make demo-tiny's distill runs leave at least 4 intermediate checkpoints (with the final one and step 0: a curve
    of 6 points per loss); checked on the composed config, no run needed."""
    cfg = compose_config(["stage=pipeline", "experiment=tiny_e2e"])
    saves = range(cfg.trainer.save_every, cfg.trainer.max_steps, cfg.trainer.save_every)
    assert len(saves) >= 4, list(saves)
