"""stage=scaling end to end on the micro world at its smallest: throughput runs on 1 and 2 gloo ranks started by
torchrun (ZeRO-2), two losses' acceptance runs in process, and the report; a rerun with another fitted metric reads
every distill run back from its key without starting a rank, and logs the figures to W&B (offline); with
``stage.launch=external`` the missing world size becomes a Slurm job in commands.sh. Bad settings are refused first.

    python -m pytest tests/pipelines/test_scaling.py -q
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest

from streakline.artifacts import read_manifest
from streakline.config import ConfigError, compose_config
from streakline.pipelines import load_stage, run_stage
from streakline.pipelines import scaling as stage_module
from streakline.pipelines.common.data_scaling import token_runs

SMALL = [
    "experiment.name=scaling-e2e",  # its own trajectories and runs: no reuse of test_experiments' (other cadence)
    "data.max_new_tokens=16",
    "data.samples_per_prompt=1",
    "data.batch_size=8",
    "trainer.max_steps=4",
    "trainer.save_every=4",
    "trainer.eval_every=2",  # two held-out checks per run: two points per loss, a slope to fit
    "trainer.log_every=1",
    "trainer.eval_prompts=2",
    "trainer.warmup_steps=1",
    "trainer.micro_batch_size=2",
    "settings.scaling.world_sizes=[1,2]",
    "settings.scaling.throughput_steps=4",
    "settings.scaling.global_batch=4",
    "settings.scaling.data_sizes=[8]",
]


def _config(root: Path, *extra: str):
    return compose_config(["stage=scaling", "experiment=scaling", "model=micro", f"run_root={root}", *SMALL, *extra])


@pytest.mark.parametrize(
    ("setting", "match"),
    [
        ("stage.world_sizes=[1,3]", r"must split evenly over every world size \(not over \[3\]\).*global_batch=33"),
        ("stage.world_sizes=[2,2]", "distinct rank counts"),
        ("stage.launch=mpi", "choose from: torchrun, external"),
        ("stage.metric=loss", "choose from: decoder_streak, sim_streak"),
        ("stage.methods=[ce_streak,nope]", r"name no method preset: \['nope'\]"),
        ("stage.ranks_per_node=4", r"must fill whole nodes"),
    ],
)
def test_bad_settings_are_refused_before_any_work(setting, match):
    extra = ["stage.world_sizes=[2,6]", "stage.global_batch=12"] if "ranks_per_node" in setting else []
    cfg = compose_config(["stage=scaling", "experiment=scaling", *extra, setting])
    with pytest.raises(ConfigError, match=match):
        load_stage("scaling").check(cfg)


def test_the_slurm_job_of_a_run_holds_exactly_its_nodes():
    line = stage_module.sbatch_command(16, ["stage=distill", "trainer.micro_batch_size=2"], 8)
    assert "--nodes=2 --ntasks-per-node=1 --gpus-per-node=8 " in line
    assert (
        "-m streakline.launch.slurm --nproc-per-node 8 -- " in line
        and "stage=distill trainer.micro_batch_size=2" in line
    )
    assert "--nodes=1 " in stage_module.sbatch_command(4, ["stage=distill"], None)


@pytest.mark.slow
@pytest.mark.distributed
def test_scaling_reports_throughput_and_fits_and_a_rerun_reuses_every_run(micro_world, monkeypatch):
    from tests.alignment.test_telemetry import _complete_records
    from tests.launch.test_slurm import _wandb_records

    root = Path(micro_world[0])
    result = run_stage(_config(root, "trainer.wandb_project=null"))
    summary = result.details["summary"]

    rows = summary["throughput"]
    assert [(r["world_size"], r["micro_batch"]) for r in rows] == [(1, 4), (2, 2)]
    assert rows[0]["efficiency"] == 1.0 and all(r["label_tokens_per_s"] > 0 and r["intervals"] == 3 for r in rows)
    for r in rows:  # each world size is its own run, and it ran on that many ranks under ZeRO-2
        manifest = read_manifest(r["folder"])
        assert manifest.metrics["run/world_size"] == r["world_size"] and manifest.metrics["run/zero_stage"] == 2
    assert rows[1]["per_rank"] == pytest.approx(rows[1]["label_tokens_per_s"] / 2)

    for loss in ("ce_streak", "distillspec"):
        points = [p for p in summary["acceptance"] if p["method"] == loss]
        assert [p["step"] for p in points] == [2, 4] and points[0]["label_tokens"] < points[1]["label_tokens"]
        fit = summary["fits"][loss]
        assert fit is None or math.isfinite(fit["exponent"])
    folder = Path(result.folder)
    text = (folder / "scaling.md").read_text()
    assert "| world size | micro batch |" in text and "exponent b" in text
    assert {Path(p).name for p in result.details["figures"].values()} == {"throughput.png", "acceptance.png"}
    assert all(Path(p).read_bytes()[:4] == b"\x89PNG" for p in result.details["figures"].values())
    assert read_manifest(folder).metrics["efficiency/ranks2"] == pytest.approx(rows[1]["efficiency"])

    # Another fitted metric is another report, from the same runs: no rank may start (every run is found by its key).
    def no_ranks(*args, **kwargs):
        raise AssertionError("a finished throughput run was started again")

    monkeypatch.setattr(stage_module, "_torchrun", no_ranks)
    again = run_stage(_config(root, "settings.scaling.metric=sim_streak", "trainer.wandb_project=scaling-test"))
    assert not again.cached and again.folder != result.folder
    assert [r["folder"] for r in again.details["summary"]["throughput"]] == [r["folder"] for r in rows]
    assert {p["folder"] for p in again.details["summary"]["acceptance"]} == {p["folder"] for p in summary["acceptance"]}
    (log,) = Path(again.folder).glob("wandb/offline-run-*/run-*.wandb")
    history = set()
    for rec in _complete_records(log, _wandb_records):
        if rec.WhichOneof("record_type") == "history":
            history |= {item.key or "/".join(item.nested_key) for item in rec.history.item}
    media = {key.split("/")[0] for key in history if key.endswith("/_type")}  # an image or table: its fields
    assert {"throughput", "acceptance", "throughput_runs", "acceptance_points"} <= media
    assert {"efficiency/ranks2", "tokens_per_s_per_rank/ranks2"} <= history
    assert run_stage(_config(root, "settings.scaling.metric=sim_streak")).cached  # the same report: reused whole

    # On a cluster: the runs that exist are read back, the missing one is written out as its Slurm job.
    with pytest.raises(ConfigError, match=r"1 throughput run\(s\) are not made yet; submit the Slurm jobs in"):
        run_stage(_config(root, "settings.scaling.launch=external", "settings.scaling.world_sizes=[1,2,4]"))
    (commands,) = (root / "scaling-e2e" / "scaling").glob("*/commands.sh")
    (job,) = [line for line in commands.read_text().splitlines() if line.startswith("sbatch")]
    assert "--nodes=1" in job and "--nproc-per-node 4" in job and "trainer.micro_batch_size=1" in job


def test_token_sizes_read_nested_subsets_of_one_set_with_seeds_at_the_ends(micro_world):
    """stage.token_sizes: no throughput (world_sizes=[]), one trajectory set, one run per (loss, size, seed) on a
    nested subset of that many completion tokens, each one point (its best check under trainer.patience)."""
    root = Path(micro_world[0])
    result = run_stage(_config(
        root, "experiment.name=scaling-tokens", "data.max_prompts=12", "settings.scaling.world_sizes=[]",
        "settings.scaling.methods=[ce_streak]", "settings.scaling.token_sizes=[40,120]", "settings.scaling.seeds=[1]",
        "settings.scaling.metric=sim_streak", "trainer.patience=1", "trainer.eval_every=1", "trainer.max_steps=6",
        "trainer.wandb_project=null",
    ))  # fmt: skip
    summary = result.details["summary"]
    assert summary["throughput"] == []
    points = summary["acceptance"]
    assert sorted((p["data_size"], p["seed"]) for p in points) == [(40, 0), (40, 1), (120, 0), (120, 1)]
    assert len({p["folder"] for p in points}) == 4 and all(p["label_tokens"] == p["data_size"] for p in points)
    sets = {read_manifest(p["folder"]).config["trajectories"] for p in points}
    assert len(sets) == 1  # one trajectory set, read as subsets
    assert {p["set"] for p in points} == {Path(s).parent.name for s in sets}  # each point names its set's key
    for p in points:
        m = read_manifest(p["folder"]).metrics
        assert p["value"] == m["best/sim_streak"] and p["step"] == m["steps"] <= 6
    text = (Path(result.folder) / "scaling.md").read_text()
    assert "| loss | training tokens | seed | steps | sim_streak | set | run |" in text and "tokens for 2" in text
    assert f"| {points[0]['set']} | `{Path(points[0]['folder']).name}` |" in text
    assert "trajectory sets" not in text  # one set: nothing to warn of
    assert "## Throughput" not in text
    # one line: its per-slot acceptance at its largest size, seed 0 (seed 1 beside it is the spread, not a line)
    assert set(result.details["figures"]) == {"acceptance", "slots"}
    assert "## Per-slot acceptance at 120 training tokens" in text and "| ce_streak | 0 | " in text
    with pytest.raises(ConfigError, match="stage.seeds adds seeds at the ends of stage.token_sizes"):
        load_stage("scaling").check(compose_config(["stage=scaling", "experiment=scaling", "stage.seeds=[1]"]))
    # a size past the set is refused once the set exists, before any run trains, naming a set that would hold it
    held = read_manifest(Path(sets.pop()).parent).metrics["completion_tokens"]
    runs = sorted(p for p in (root / "scaling-tokens" / "distill").iterdir())
    with pytest.raises(ConfigError, match=rf"reaches {held + 1:,} .* holds {held:,} in 12 rows .*data.max_prompts=1\d"):
        run_stage(_config(
            root, "experiment.name=scaling-tokens", "data.max_prompts=12", "settings.scaling.world_sizes=[]",
            "settings.scaling.methods=[ce_streak]", f"settings.scaling.token_sizes=[40,{held + 1}]",
            "trainer.max_steps=6", "trainer.wandb_project=null",
        ))  # fmt: skip
    assert sorted((root / "scaling-tokens" / "distill").iterdir()) == runs  # nothing trained

    # stage.prior: a later sitting (here: one size, one seed) reads the earlier report's points where it has no run
    earlier = json.loads((Path(result.folder) / "scaling.json").read_text())
    mine = next(p for p in earlier["acceptance"] if (p["data_size"], p["seed"]) == (40, 0))
    mine["value"] = -1.0  # the earlier report's copy of a point this sitting measures again: the run must win
    other = next(p for p in earlier["acceptance"] if (p["data_size"], p["seed"]) == (120, 1))
    other["set"] = "trajectories 0123456789ab: another machine's set, in words"  # a hand-written ledger entry
    next(p for p in earlier["acceptance"] if (p["data_size"], p["seed"]) == (40, 1)).pop("set")  # one that names none
    ledger = root / "ledger.json"
    ledger.write_text(json.dumps(earlier))

    def later_cfg():
        return _config(
            root, "experiment.name=scaling-tokens", "data.max_prompts=12", "settings.scaling.world_sizes=[]",
            "settings.scaling.methods=[ce_streak]", "settings.scaling.token_sizes=[40]", "settings.scaling.seeds=[]",
            "settings.scaling.metric=sim_streak", "trainer.patience=1", "trainer.eval_every=1", "trainer.max_steps=6",
            "trainer.wandb_project=null", f"settings.scaling.prior=[{ledger}]",
        )  # fmt: skip

    later = run_stage(later_cfg())
    assert sorted((root / "scaling-tokens" / "distill").iterdir()) == runs  # the 40-token run was reused
    merged = {(p["data_size"], p["seed"]): p for p in later.details["summary"]["acceptance"]}
    assert set(merged) == {(40, 0), (40, 1), (120, 0), (120, 1)}
    assert "prior" not in merged[40, 0] and merged[40, 0]["value"] == next(
        p["value"] for p in points if (p["data_size"], p["seed"]) == (40, 0))  # fmt: skip
    assert all(merged[k]["prior"] == "ledger.json" for k in ((40, 1), (120, 0), (120, 1)))
    fit = later.details["summary"]["fits"]["ce_streak"]
    assert fit is not None and fit["points"] == 4  # both sizes: the earlier sitting's reach the fit
    text = (Path(later.folder) / "scaling.md").read_text()
    assert "*prior: ledger.json*" in text
    # a point of another set: the report counts the points of each set and says they are not nested across sets
    assert f"The points read 2 trajectory sets: `{mine['set']}` (2), `0123456789ab` (1)." in text
    ledger.write_text(json.dumps({**earlier, "acceptance": earlier["acceptance"][:1]}))  # edited: a new report
    assert not run_stage(later_cfg()).cached
    for text, match in (("{", "is not readable JSON"), (json.dumps({**earlier, "metric": "decoder_streak"}),
                        "holds 'decoder_streak' points and this study fits stage.metric=sim_streak")):  # fmt: skip
        ledger.write_text(text)
        with pytest.raises(ConfigError, match=match):
            load_stage("scaling").check(later_cfg())
    ledger.unlink()
    with pytest.raises(ConfigError, match="ledger.json does not exist"):
        load_stage("scaling").check(later_cfg())


def test_a_ledger_gathers_the_sittings_and_rewriting_it_changes_nothing(micro_world, tmp_path, capsys):
    """stage.ledger: a file the study reads like a prior and writes its measured points back to. A missing one is
    started; a point of the same line, size and seed is replaced by the run, the file's others are kept and join
    the report; the same points write the same file, so the report after it is reused."""
    root = Path(micro_world[0])
    ledger = tmp_path / "study" / "ledger.json"  # its folder does not exist yet either

    def cfg(*extra):
        return _config(
            root, "experiment.name=scaling-tokens", "data.max_prompts=12", "settings.scaling.world_sizes=[]",
            "settings.scaling.methods=[ce_streak]", "settings.scaling.token_sizes=[40]", "settings.scaling.seeds=[]",
            "settings.scaling.metric=sim_streak", "trainer.patience=1", "trainer.eval_every=1", "trainer.max_steps=6",
            "trainer.wandb_project=null", f"settings.scaling.ledger={ledger}", *extra,
        )  # fmt: skip

    first = run_stage(cfg())
    (measured,) = first.details["summary"]["acceptance"]
    said = capsys.readouterr().out  # the study's plan, before the run trained
    found = Path(measured["folder"]).name  # to train here, or found where an earlier test made the same run
    assert re.search(r"scaling: 1 distill run\(s\): [01] found by their keys, [01] to train\n", said)
    assert re.search(rf"scaling:   (to train  ce_streak at 40 tokens, seed 0|found     ce_streak at 40 tokens, seed 0: "
                     rf"{found})\n", said)  # fmt: skip
    written = json.loads(ledger.read_text())
    assert written["metric"] == "sim_streak" and written["setup"] == {"experiment": "scaling-tokens", "model": "micro"}
    (point,) = written["acceptance"]
    assert {k: point[k] for k in ("method", "data_size", "seed", "value")} == {
        k: measured[k] for k in ("method", "data_size", "seed", "value")}  # fmt: skip
    run = read_manifest(measured["folder"])
    assert Path(point["folder"]).name == Path(measured["folder"]).name and point["finished"] == run.finished_at
    assert point["set"] == Path(run.config["trajectories"]).parent.name
    records = [json.loads(x) for x in (Path(measured["folder"]) / "metrics.jsonl").read_text().splitlines()]
    at_best = next(r for r in records if r["step"] == run.metrics["best_step"] and "eval/tiny-math/sim_streak" in r)
    assert point["benchmarks"] == {k.split("/")[1]: v for k, v in at_best.items() if k.endswith("/sim_streak")}
    assert point["slots"] == {k.split("/")[1]: v for k, v in at_best.items() if k.endswith("/alpha")} != {}
    assert measured["slots"] == point["slots"]  # the report's point carries them too (its per-slot section)
    assert sum(point["benchmarks"].values()) / len(point["benchmarks"]) == pytest.approx(point["value"])

    # another sitting's point (another size) and a stale copy of the measured one: the run replaces the copy
    other = {**point, "data_size": 999, "value": 0.5, "folder": "runs/gone", "machine": "another one"}
    ledger.write_text(json.dumps({**written, "acceptance": [{**point, "value": -1.0, "note": "by hand"}, other]}))
    capsys.readouterr()
    second = run_stage(cfg())
    assert not second.cached  # the file's contents are part of the report's key
    said = capsys.readouterr().out
    assert "1 found by their keys, 0 to train; 2 point(s) of earlier sittings from stage.ledger / stage.prior" in said
    assert f"scaling:   found     ce_streak at 40 tokens, seed 0: {Path(measured['folder']).name}\n" in said
    got = {p["data_size"]: p for p in second.details["summary"]["acceptance"]}
    assert got[40]["value"] == measured["value"] and "prior" not in got[40] and got[999]["prior"] == "ledger.json"
    kept = json.loads(ledger.read_text())["acceptance"]
    assert [p["data_size"] for p in kept] == [40, 999] and kept[0] == {**point, "note": "by hand"} and kept[1] == other
    before = ledger.read_bytes()
    third = run_stage(cfg())  # the file changed (the stale copy replaced): one more report, and the same file
    assert ledger.read_bytes() == before
    assert run_stage(cfg()).cached and third.folder != second.folder and ledger.read_bytes() == before
    # a copy another run made (another folder): its notes in words describe that run, so they go with it
    ledger.write_text(json.dumps({**written, "acceptance": [{**point, "folder": "runs/older", "sitting": "first"}]}))
    run_stage(cfg())
    (replaced,) = json.loads(ledger.read_text())["acceptance"]
    assert replaced == point and "sitting" not in replaced
    ledger.write_text(json.dumps({**written, "metric": "decoder_streak"}))
    with pytest.raises(ConfigError, match="stage.ledger: .* holds 'decoder_streak' points .* or another file"):
        load_stage("scaling").check(cfg())
    with pytest.raises(ConfigError, match="stage.ledger records a data-scaling study, and stage.token_sizes is empty"):
        load_stage("scaling").check(cfg("settings.scaling.token_sizes=[]"))


# A second report writing the ledger: composes the study's settings (argv[1]), says "ready", writes its point (argv[2])
LEDGER_WRITER = """
import json, sys
from streakline.config import compose_config
from streakline.pipelines.common.data_scaling import write_ledger
cfg = compose_config(json.loads(sys.argv[1]))
print("ready", flush=True)
write_ledger(cfg, [json.loads(sys.argv[2])])
"""


def test_two_reports_writing_one_ledger_at_once_both_land(tmp_path):
    """stage.ledger under a Slurm multirun: a report that finds the ledger being updated waits for the update and
    reads its result, so neither report's points are lost (locks.update_lock); a holder that never lets go is named
    after the timeout."""
    import subprocess
    import sys

    from streakline.errors import ArtifactError
    from streakline.locks import update_lock
    from streakline.pipelines.common import data_scaling

    ledger = tmp_path / "ledger.json"
    overrides = ["stage=scaling", "experiment=scaling", "model=micro", "settings.scaling.token_sizes=[40]",
                 f"settings.scaling.ledger={ledger}"]  # fmt: skip
    cfg = compose_config(overrides)

    def point(size):
        return {"method": "ce_streak", "loss": "ce_streak", "data_size": size, "seed": 0, "step": 4,
                "label_tokens": size, "value": size / 100, "folder": str(tmp_path / f"gone{size}")}  # fmt: skip

    with update_lock(ledger):  # this process is a report in the middle of its update
        child = subprocess.Popen(
            [sys.executable, "-c", LEDGER_WRITER, json.dumps(overrides), json.dumps(point(40))],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert child.stdout.readline().strip() == "ready", f"the writer exited early with {child.poll()}"
            with pytest.raises(subprocess.TimeoutExpired):
                child.wait(timeout=1.5)  # it waits for the lock instead of writing over this update
            assert not ledger.exists()
            data_scaling._update_ledger(cfg, ledger, [point(120)])
            with pytest.raises(ArtifactError, match=rf"another process \(PID {os.getpid()} on host .*\) has held "):
                with update_lock(ledger, timeout=0.3):
                    pytest.fail("a second update got in")
        except BaseException:
            child.kill()
            raise
    assert child.wait(timeout=60) == 0
    written = json.loads(ledger.read_text())["acceptance"]
    assert [(p["data_size"], p["value"]) for p in written] == [(40, 0.4), (120, 1.2)]


def test_arms_side_by_side_and_their_drafters_decoded_beside_vanilla_and_ngram(micro_world, capsys, tmp_path):
    """stage.arms: two recipes in one report (lines <arm>:<loss>, an arm's every-other size and overrides);
    stage.evaluate: each seed-0 drafter decodes held-out prompts beside vanilla and ngram, every row lossless, in
    speedup.png; with stage.ledger the decodes go to the file, and a later sitting that decodes nothing draws them."""
    from streakline.config.schema import ScalingArm

    root = Path(micro_world[0])
    cfg = _config(
        root, "experiment.name=scaling-tokens", "data.max_prompts=12", "settings.scaling.world_sizes=[]",
        "settings.scaling.token_sizes=[40,80,120]", "settings.scaling.metric=sim_streak",
        "settings.scaling.evaluate=true",
        "trainer.max_steps=2", "trainer.eval_every=2", "trainer.wandb_project=null", "settings.evaluate.prompts=1",
        "settings.evaluate.max_new_tokens=8", "settings.evaluate.benchmarks=[tiny-math]",
        "settings.evaluate.temperatures=[0.0]", "settings.evaluate.degenerate_share=1.0",
    )  # fmt: skip
    cfg.stage.arms = [
        ScalingArm(name="a", methods=["ce_streak"]),
        ScalingArm(name="b", methods=["streak"], every=2, adapt="mdm", run_overrides=["trainer.lr=1e-3"]),
    ]
    result = run_stage(cfg)
    said = capsys.readouterr().out  # the plan: five runs, arm b's each after its adaptation
    assert re.search(r"scaling: 5 distill run\(s\): \d found by their keys, \d to train", said)
    assert len(re.findall(r"scaling:   (to train|found   ) {2}b:streak at (40|120) tokens, seed 0.* \(from its mdm "
                          r"adaptation, (found|to train)\)\n", said)) == 2  # fmt: skip
    summary = result.details["summary"]
    got = sorted((p["method"], p["data_size"]) for p in summary["acceptance"])
    assert got == [("a:ce_streak", 40), ("a:ce_streak", 80), ("a:ce_streak", 120), ("b:streak", 40), ("b:streak", 120)]
    lr = {p["method"]: read_manifest(p["folder"]).config["trainer"]["lr"] for p in summary["acceptance"]}
    assert lr["b:streak"] == 1e-3 and lr["a:ce_streak"] != 1e-3  # an arm's overrides reach its runs only
    for p in summary["acceptance"]:  # arm b starts from an mdm run on the same subset, made first
        start = Path(read_manifest(p["folder"]).config["drafter"])  # the weights it started from (its run key)
        adapted = read_manifest(start.parent) if (start.parent / "manifest.json").is_file() else None
        if p["method"] == "b:streak":
            assert adapted.stage == "distill" and adapted.config["method"]["name"] == "mdm"
            assert adapted.status == "complete" and adapted.config["trainer"]["train_tokens"] == p["data_size"]
        else:
            assert adapted is None or adapted.stage != "distill"  # the preset's drafter (the world's)
    wall = summary["wall_clock"]
    assert sorted((r["method"], r["data_size"]) for r in wall["rows"]) == got  # every point's drafter decoded
    assert all(r["lossless"] and r["speedup"] > 0 for r in wall["rows"])
    assert set(wall["ngram"]) == {"tiny-math/T0"} and wall["ngram"]["tiny-math/T0"] > 0
    text = (Path(result.folder) / "scaling.md").read_text()
    assert "## Wall-clock speedup against training tokens" in text and "**tiny-math, T=0** (ngram: " in text
    assert "| line | 40 | 80 | 120 |" in text and "| b:streak | " in text  # a line per recipe, a column per size
    assert set(result.details["figures"]) == {"acceptance", "speedup", "slots"}  # slots: both lines at 120
    assert "## Per-slot acceptance at 120 training tokens" in text
    assert read_manifest(result.folder).metrics["speedup/ngram/tiny-math/T0"] == wall["ngram"]["tiny-math/T0"]
    ledger = tmp_path / "ledger.json"
    cfg.stage.ledger = str(ledger)
    run_stage(cfg)  # every run and the decodes found by their keys; a new report, which writes the ledger
    kept = json.loads(ledger.read_text())["wall_clock"]
    (evaluate,) = {r["evaluate"] for r in kept}  # the one evaluate run that decoded them all
    assert kept == wall["rows"] and read_manifest(evaluate).stage == "evaluate"
    before = ledger.read_bytes()
    cfg.stage.evaluate = False  # a later sitting that decodes nothing: the speedups come from the ledger
    later = run_stage(cfg).details["summary"]
    rows = later["wall_clock"]["rows"]
    assert [{k: v for k, v in r.items() if k != "prior"} for r in rows] == wall["rows"]
    assert {r["prior"] for r in rows} == {"ledger.json"}
    assert later["wall_clock"]["ngram"] == wall["ngram"] and "speedup" in later["figures"]
    assert ledger.read_bytes() == before  # prior rows are not written back as measured
    cfg.stage.evaluate, cfg.stage.ledger = True, None
    cfg.stage.arms = [ScalingArm(name="a", methods=["ce_streak"]), ScalingArm(name="a", methods=["streak"])]
    with pytest.raises(ConfigError, match="distinct names"):
        load_stage("scaling").check(cfg)


def test_token_runs_put_the_extra_seeds_at_the_ends():
    cfg = compose_config(["stage=scaling", "experiment=scaling", "stage.methods=[a,b]",
                          "stage.token_sizes=[300,10,100]", "stage.seeds=[0,7]"])  # fmt: skip
    runs = [(r.label, r.size, r.seed) for r in token_runs(cfg)]
    assert runs == [
        (m, size, seed) for m in "ab" for size, seeds in ((10, (0, 7)), (100, (0,)), (300, (0, 7))) for seed in seeds
    ]  # fmt: skip  (seed 0 is the config's: not run twice)
