"""The kill harness: a stage's process SIGKILLed at named points across its life (``streakline/faults.py``), then
rerun, must finish with exactly the outputs of an uninterrupted run, and leave no temp file behind.

distill is killed six times in a row on one run (before its first checkpoint, which restarts it from step 0 with
the dead attempt's metrics gone; mid training after a checkpoint; after the last checkpoint but before its export,
which once left a run that could never finish; after the export but before it was recorded; mid prune; during the
manifest write), trajectories, spot and spiffy once each while a shard or the graph is being written.
The killed processes are forked from a warm parent that has done the imports (``tests/forked_cli.py``).
Run: ``python -m pytest tests/pipelines/test_kill_harness.py``."""

import os
import re
import signal
from pathlib import Path

import pytest
import torch

from streakline.alignment.block_traces import read_trace_shards
from streakline.artifacts import read_manifest
from streakline.config import compose_config
from streakline.data.trajectories import load_trajectories
from streakline.faults import KILL_AT
from streakline.models import load_pretrained
from streakline.pipelines import run_stage
from tests.forked_cli import Completed, WarmLauncher

ROOT = Path(__file__).resolve().parents[2]
DATA = ["data.max_prompts=12", "data.samples_per_prompt=1", "data.max_new_tokens=16", "data.num_shards=2",
        "data.batch_size=6", "data.prompt_sources=[tiny-math-train]", "data.mix_weights=[]"]  # fmt: skip
TRAIN = ["method=ce_streak", "trainer.max_steps=6", "trainer.save_every=3", "trainer.keep_last=1",
         "trainer.eval_every=6", "trainer.log_every=1", "trainer.eval_prompts=2", "trainer.micro_batch_size=2",
         "trainer.windows_per_seq=4"]  # fmt: skip
SPOT = ["stage.prompt_sources=[tiny-math-train]", "stage.prompts=6", "stage.max_new_tokens=16", "stage.num_shards=2",
        "stage.batch_size=3", "stage.top_k=8", "stage.horizon=3", "stage.d_model=32", "stage.layers=1",
        "stage.heads=4", "stage.ffn=64", "stage.max_block=8", "stage.steps=10", "stage.train_batch=16"]  # fmt: skip
SPIFFY = ["stage.prompt_sources=[tiny-math-train]", "stage.prompts=4", "stage.max_new_tokens=16", "stage.horizon=3",
          "stage.budget=4", "stage.batch_size=4", "stage.top_k=8"]  # fmt: skip

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def _overrides(root, experiment, stage, *extra):
    return [f"stage={stage}", "model=micro", f"run_root={root}", f"experiment.name={experiment}", *DATA, *extra]


@pytest.fixture(scope="module")
def launcher():
    with WarmLauncher(cwd=ROOT) as warm:
        yield warm


def _killed_at(launcher: WarmLauncher, point: str, overrides: list[str]) -> Completed:
    """Run ``launch.py`` with ``overrides`` in a child process (forked warm, ``tests/forked_cli.py``) that SIGKILLs
    itself at ``point``."""
    env = dict(os.environ, **{KILL_AT: point, "WANDB_MODE": "disabled"})  # resumability, not telemetry
    proc = launcher.run(overrides, env)
    assert proc.returncode == -signal.SIGKILL, f"not killed at {point}: rc {proc.returncode}\n{proc.stderr[-3000:]}"
    return proc


def _temp_files(folder: Path) -> list[Path]:
    return list(folder.rglob(".*.tmp"))  # an atomic write's file, or a folder remove_tree renamed away


def _loss_lines(folder: Path) -> list[tuple[int, float]]:
    """(step, loss) of each training line of the metrics log, in file order: a step logged twice is there twice."""
    import json

    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines) if "loss" in r]


@pytest.fixture(scope="module")
def root(micro_world):
    return micro_world[0]


def test_distill_killed_six_times_finishes_like_an_uninterrupted_run(root, launcher):
    for experiment in ("kill-ref", "kill-distill"):
        run_stage(compose_config(_overrides(root, experiment, "trajectories")))
    reference = run_stage(compose_config(_overrides(root, "kill-ref", "distill", *TRAIN)))
    args = _overrides(root, "kill-distill", "distill", *TRAIN)
    for point in (
        "distill:logged:step-000002",  # before the first checkpoint: restarts from step 0, steps 1-2 logged again
        "distill:checkpointed:step-000003",  # mid training: resumes from step 3
        "distill:checkpointed:step-000006",  # last checkpoint saved, never exported
        "distill:exported:step-000006",  # exported, not recorded as exported
        "remove:step-000003",  # the older checkpoint (keep_last=1) renamed away, not yet deleted
        "atomic:manifest.json",  # everything done but the manifest, killed mid-write
    ):
        _killed_at(launcher, point, args)
    (run,) = Path(root, "kill-distill", "distill").iterdir()  # its key names its own trajectories folder
    assert not (run / "manifest.json").exists() and _temp_files(run)  # the last kill left its temp manifest
    done = run_stage(compose_config(args))
    assert done.folder == run and not done.cached and done.details["resumed_from"] == 6
    assert read_manifest(run).status == "complete" and not _temp_files(run)
    ref, got = load_pretrained(reference.artifact).state_dict(), load_pretrained(done.artifact).state_dict()
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000003", "step-000006"]
    # keep_last=1: one DeepSpeed checkpoint left, and nothing of the one whose deletion was cut short
    assert sorted(p.name for p in (run / "deepspeed").iterdir() if p.is_dir()) == ["step-000006"]
    # every step logged once, with the uninterrupted run's losses; the final metrics recovered from the log
    assert _loss_lines(run) == _loss_lines(reference.folder) and [s for s, _ in _loss_lines(run)] == list(range(1, 7))
    for key, value in read_manifest(reference.folder).metrics.items():
        if not key.startswith("label_tokens"):  # a throughput: wall-clock, not a result
            assert read_manifest(run).metrics[key] == value, key


@pytest.mark.parametrize(
    ("stage", "extra", "point"),
    [
        ("trajectories", [], "atomic:shard-00001-of-00002.parquet"),
        ("spot", SPOT, "atomic:shard-00001-of-00002.parquet"),
        ("spiffy", SPIFFY, "atomic:graph.json"),
    ],
)
def test_a_stage_killed_mid_write_finishes_on_rerun_with_the_same_outputs(root, launcher, stage, extra, point):
    reference = run_stage(compose_config(_overrides(root, f"kill-{stage}-ref", stage, *extra)))
    args = _overrides(root, f"kill-{stage}", stage, *extra)
    _killed_at(launcher, point, args)
    run = Path(root, f"kill-{stage}", stage, reference.folder.name)  # the same key: the same folder name
    assert _temp_files(run) and not (run / "manifest.json").exists()
    done = run_stage(compose_config(args))
    assert done.folder == run and read_manifest(run).status == "complete" and not _temp_files(run)
    if stage == "trajectories":
        ref, got = load_trajectories(reference.artifact), load_trajectories(done.artifact)
        assert ref["completion_ids"] == got["completion_ids"] and len(got) == 12
    elif stage == "spot":
        ref, got = read_trace_shards(reference.folder / "shards"), read_trace_shards(run / "shards")
        assert [t.prompt for t in ref] == [t.prompt for t in got]
        assert all(
            (a.tokens == b.tokens).all()
            for x, y in zip(ref, got, strict=True)
            for a, b in zip(x.steps, y.steps, strict=True)
        )
        assert done.metrics["heldout"] == reference.metrics["heldout"]
    else:
        assert Path(done.artifact).read_text() == Path(reference.artifact).read_text()


def test_a_sigterm_says_what_was_kept_and_the_rerun_goes_on(root, tmp_path):
    """SIGTERM (a scheduler stopping the job) mid trajectories: one line naming what was kept and how to go on,
    status 143, and the rerun samples only the shard that was not finished."""
    import subprocess
    import sys
    import time

    from streakline.faults import STALL_AT, STALL_UNTIL

    args = _overrides(root, "sigterm", "trajectories")
    env = dict(os.environ, **{STALL_AT: "atomic:shard-00001-of-00002.parquet", STALL_UNTIL: str(tmp_path / "never")})
    proc = subprocess.Popen([sys.executable, "launch.py", *args], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    seen = []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # shard 0 is on disk once the process stalls writing shard 1
        line = proc.stderr.readline()
        seen.append(line)
        if "stalled at" in line or not line:  # (after the progress bar's carriage returns, on its line)
            break
    assert "stalled at" in seen[-1], "".join(seen)[-3000:]
    proc.send_signal(signal.SIGTERM)
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 143, err[-3000:]
    said = [line for line in err.splitlines() if line.startswith("streakline: ")]
    assert len(said) == 1, err[-3000:]  # one line (a progress bar the exit closes may follow it)
    assert "stage=trajectories stopped by SIGTERM" in said[0] and "run the same command again" in said[0]
    assert "Traceback" not in err
    done = run_stage(compose_config(args))
    assert done.details["generated_shards"] == [1] and len(load_trajectories(done.artifact)) == 12


FINAL = ["method=ce_streak", "trainer.max_steps=2", "trainer.save_every=2", "trainer.eval_every=2",
         "trainer.log_every=1", "trainer.eval_prompts=2", "trainer.micro_batch_size=2",
         "trainer.windows_per_seq=4"]  # fmt: skip


def test_a_full_disk_at_the_final_export_leaves_no_half_drafter_and_the_rerun_writes_it(root, tmp_path, small_disk):
    """The run's distill folder on a real small filesystem, filled while the trained run waits to write its final
    ``drafter/`` (stalled at ``distill:trained``): the copy fails in one line naming the file and saying what was
    kept, ``drafter/`` is absent rather than half written, and a rerun after space is freed writes it whole from
    the kept export (issue 62, item 2)."""
    import subprocess
    import sys
    import time

    from streakline.faults import STALL_AT, STALL_UNTIL

    run_stage(compose_config(_overrides(root, "full-final", "trajectories")))
    disk = small_disk(64 * 1024)
    Path(root, "full-final", "distill").symlink_to(disk)  # the distill runs of this experiment live on it
    args = _overrides(root, "full-final", "distill", *FINAL)
    go = tmp_path / "go"
    env = dict(os.environ, **{STALL_AT: "distill:trained", STALL_UNTIL: str(go), "WANDB_MODE": "disabled"})
    proc = subprocess.Popen([sys.executable, "launch.py", *args], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    seen = []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        seen.append(line)
        if "stalled at" in line or not line:
            break
    assert "stalled at distill:trained" in seen[-1], "".join(seen)[-3000:]
    (on_disk,) = disk.iterdir()
    run = Path(root, "full-final", "distill", on_disk.name)  # as the run names it (through the link)
    export = run / "checkpoints" / "step-000002"
    files = {p.name: p.read_bytes() for p in export.iterdir()}
    stat = os.statvfs(disk)
    with open(disk / "filler", "wb") as f:  # leave half of what the copy needs
        f.write(b"\0" * (stat.f_bavail * stat.f_frsize - sum(map(len, files.values())) // 2 // 4096 * 4096))
    go.touch()
    err = "".join(seen) + proc.stderr.read()
    assert proc.wait(timeout=120) == 2, err[-3000:]
    said = [line for line in err.splitlines() if line.startswith("streakline: ")]
    assert len(said) == 1 and "Traceback" not in err, err[-3000:]
    named = re.search(rf"the disk is full: writing (\S+) in {re.escape(str(run / 'drafter'))} failed \(", said[0])
    assert named and named.group(1) in files, said[0]
    assert f"{run / 'drafter'} was not written (no half-written copy is left)" in said[0]
    assert f"the export it copies, {export}, is kept" in said[0]
    assert not (run / "drafter").exists() and not _temp_files(run) and read_manifest(run).status == "failed"
    assert {p.name: p.read_bytes() for p in export.iterdir()} == files

    (disk / "filler").unlink()
    done = run_stage(compose_config(args))
    assert done.folder == run and read_manifest(run).status == "complete"
    assert {p.name: p.read_bytes() for p in (run / "drafter").iterdir()} == files
