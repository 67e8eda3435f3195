"""Tests for streakline.artifacts: config hashes, atomic writes, manifests, run folders and StageRun."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from streakline import artifacts
from streakline.artifacts import ArtifactError, Manifest, StageRun
from streakline.config import ConfigError

CFG = {"model": {"layers": 2, "width": 64}, "lr": 3e-4, "paths": {"out": "/tmp/a"}, "tags": ["x", {"k": 1}]}


def _manifest(**over) -> Manifest:
    fields = {"stage": "train", "experiment": "tiny", "config": CFG, "config_hash": "abc", "status": "complete"}
    return Manifest(**{**fields, **over})


# --- config_hash -------------------------------------------------------------------------------------------------


def test_hash_is_12_hex_and_independent_of_key_order():
    reordered = {"tags": ["x", {"k": 1}], "paths": {"out": "/tmp/a"}, "lr": 3e-4, "model": {"width": 64, "layers": 2}}
    h = artifacts.config_hash(CFG)
    assert re.fullmatch(r"[0-9a-f]{12}", h)
    assert artifacts.config_hash(reordered) == h
    assert artifacts.config_hash(json.loads(json.dumps(CFG))) == h


def test_hash_changes_when_a_value_changes():
    changed = json.loads(json.dumps(CFG))
    changed["model"]["width"] = 65
    assert artifacts.config_hash(changed) != artifacts.config_hash(CFG)


def test_exclude_ignores_dotted_keys_and_does_not_mutate_input():
    other = {**CFG, "paths": {"out": "/elsewhere"}}
    assert artifacts.config_hash(other) != artifacts.config_hash(CFG)
    assert artifacts.config_hash(other, exclude=["paths.out"]) == artifacts.config_hash(CFG, exclude=["paths.out"])
    assert artifacts.config_hash(CFG, exclude=["no.such.key", "model.nope"]) == artifacts.config_hash(CFG)
    assert artifacts.config_hash(CFG, exclude=["tags.1.k"]) == artifacts.config_hash({**CFG, "tags": ["x", {}]})
    assert CFG["paths"] == {"out": "/tmp/a"}


def test_omegaconf_config_hashes_like_plain_dict():
    omegaconf = pytest.importorskip("omegaconf")
    cfg = omegaconf.OmegaConf.create({"a": {"b": 1}, "c": "${a.b}"})
    assert artifacts.config_hash(cfg) == artifacts.config_hash({"c": 1, "a": {"b": 1}})


def test_hash_rejects_objects_json_cannot_encode():
    with pytest.raises(TypeError):
        artifacts.config_hash({"f": object()})


# --- run_dir and atomic writes -----------------------------------------------------------------------------------


def test_run_dir_is_absolute_and_created(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = artifacts.run_dir("runs", "tiny", "train", "0123456789ab")
    assert path.is_absolute() and path.is_dir()
    assert path == tmp_path / "runs" / "tiny" / "train" / "0123456789ab"
    with pytest.raises(ValueError):
        artifacts.run_dir(tmp_path, "../evil", "train", "h")


def test_write_json_atomic_round_trips_without_leftovers(tmp_path):
    target = tmp_path / "x.json"
    artifacts.write_json_atomic(target, {"a": [1, 2], "p": Path("/q")})
    assert json.loads(target.read_text()) == {"a": [1, 2], "p": "/q"}
    artifacts.write_text_atomic(tmp_path / "y.txt", "hello")
    assert (tmp_path / "y.txt").read_text() == "hello"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.json", "y.txt"]


def test_failed_serialisation_leaves_old_file_intact(tmp_path):
    target = tmp_path / "x.json"
    artifacts.write_json_atomic(target, {"good": True})
    for bad in ({"bad": object()}, {"nan": float("nan")}):
        with pytest.raises((TypeError, ValueError)):
            artifacts.write_json_atomic(target, bad)
    assert json.loads(target.read_text()) == {"good": True}
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]


# --- manifests ---------------------------------------------------------------------------------------------------


def test_manifest_round_trip(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "metrics.json").write_text("{}")
    m = _manifest(outputs=["model", "metrics.json"], metrics={"loss": 1.5}, git_sha=None, error=None)
    assert Manifest.from_dict(m.to_dict()) == m
    artifacts.write_manifest(tmp_path, m)
    assert artifacts.read_manifest(tmp_path) == m


def test_write_manifest_refuses_missing_or_escaping_outputs(tmp_path):
    with pytest.raises(ArtifactError, match=r"weights\.bin.*do not exist"):
        artifacts.write_manifest(tmp_path, _manifest(outputs=["weights.bin"]))
    with pytest.raises(ArtifactError, match="inside the run folder"):
        artifacts.write_manifest(tmp_path, _manifest(outputs=["../x"]))
    assert not (tmp_path / "manifest.json").exists()


def test_read_manifest_missing_names_folder_and_fix(tmp_path):
    with pytest.raises(ArtifactError, match="rerun") as err:
        artifacts.read_manifest(tmp_path)
    assert str(tmp_path) in str(err.value)


@pytest.mark.parametrize(
    "content",
    [
        '{"stage": "train", "experim',  # truncated
        "[1, 2]",  # not an object
        '{"stage": "train"}',  # required fields missing
        json.dumps({**_manifest().to_dict(), "outputs": "a.bin"}),  # wrong type
        json.dumps({**_manifest().to_dict(), "status": "running"}),  # unknown status
    ],
)
def test_read_manifest_bad_content_names_folder(tmp_path, content):
    (tmp_path / "manifest.json").write_text(content)
    with pytest.raises(ArtifactError, match="rerun") as err:
        artifacts.read_manifest(tmp_path)
    assert str(tmp_path) in str(err.value)
    assert isinstance(err.value, RuntimeError)


# --- find_complete -----------------------------------------------------------------------------------------------


def test_find_complete_only_accepts_complete_runs_with_all_outputs(tmp_path):
    h = "0123456789ab"
    assert artifacts.find_complete(tmp_path, "tiny", "train", h) is None  # no folder
    d = artifacts.run_dir(tmp_path, "tiny", "train", h)
    assert artifacts.find_complete(tmp_path, "tiny", "train", h) is None  # folder, no manifest
    (d / "model.bin").write_text("w")
    artifacts.write_manifest(d, _manifest(config_hash=h, status="failed", outputs=["model.bin"]))
    assert artifacts.find_complete(tmp_path, "tiny", "train", h) is None  # failed
    artifacts.write_manifest(d, _manifest(config_hash=h, outputs=["model.bin"]))
    assert artifacts.find_complete(tmp_path, "tiny", "train", h) == d
    (d / "model.bin").unlink()
    assert artifacts.find_complete(tmp_path, "tiny", "train", h) is None  # output deleted afterwards
    (d / "manifest.json").write_text('{"stage": ')
    assert artifacts.find_complete(tmp_path, "tiny", "train", h) is None  # corrupt


# --- StageRun ----------------------------------------------------------------------------------------------------


def test_stage_run_success_writes_complete_manifest(tmp_path):
    with StageRun(tmp_path, "tiny", "train", CFG, inputs={"data": Path("/d")}, exclude=["paths"]) as run:
        assert run.dir.is_dir() and run.dir.name == artifacts.config_hash(CFG, exclude=["paths"])
        run.add_output("model.bin").write_text("w")
        run.add_output(run.dir / "sub" / "a.txt")
        (run.dir / "sub").mkdir()
        (run.dir / "sub" / "a.txt").write_text("a")
        run.metrics["loss"] = 0.5
    m = artifacts.read_manifest(run.dir)
    assert m.status == "complete" and m.error is None
    assert m.outputs == ["model.bin", "sub/a.txt"]
    assert m.metrics == {"loss": 0.5} and m.inputs == {"data": "/d"} and m.config == CFG
    assert m.python and m.host and m.started_at <= m.finished_at and m.finished_at.endswith("+00:00")
    assert "pytest" not in m.package_versions  # only the names asked for
    assert artifacts.find_complete(tmp_path, "tiny", "train", run.cfg_hash) == run.dir
    with pytest.raises(ArtifactError, match="outside"):
        run.add_output(tmp_path / "elsewhere.txt")


def test_stage_run_exception_writes_failed_manifest_and_reraises(tmp_path):
    with pytest.raises(ZeroDivisionError):
        with StageRun(tmp_path, "tiny", "train", CFG) as run:
            run.add_output("model.bin").write_text("partial")
            run.add_output("never_written.bin")
            1 / 0  # noqa: B018
    m = artifacts.read_manifest(run.dir)
    assert m.status == "failed" and "ZeroDivisionError" in m.error
    assert m.outputs == ["model.bin"]  # only what exists, so the failure record itself is consistent
    assert artifacts.find_complete(tmp_path, "tiny", "train", run.cfg_hash) is None


def test_a_user_error_leaves_no_folder_only_when_the_run_made_it_and_wrote_nothing(tmp_path):
    with pytest.raises(ConfigError):
        with StageRun(tmp_path, "tiny", "train", CFG) as run:
            raise ConfigError("bad input")
    assert not (tmp_path / "tiny").exists()  # the experiment and stage folders it made went too
    # something written: the failure record stays, to inspect and resume
    with pytest.raises(ConfigError):
        with StageRun(tmp_path, "tiny", "train", CFG) as run:
            run.add_output("part.bin").write_text("partial")
            raise ConfigError("bad input")
    assert artifacts.read_manifest(run.dir).status == "failed"
    # an existing folder (an earlier attempt's) is never removed, and an error that is not the user's keeps its record
    (run.dir / "part.bin").unlink()
    (run.dir / "manifest.json").unlink()
    for error in (ConfigError, ZeroDivisionError):
        with pytest.raises(error):
            with StageRun(tmp_path, "tiny", "train", CFG):
                raise error("x")
        assert artifacts.read_manifest(run.dir).status == "failed"


def test_remove_tree_cut_short_is_finished_by_the_next_sweep(tmp_path):
    keep, doomed = tmp_path / "step-000004", tmp_path / "step-000002"
    for folder in (keep, doomed):
        (folder / "sub").mkdir(parents=True)
        (folder / "sub" / "w.bin").write_bytes(b"x")
    artifacts.remove_tree(doomed)
    assert not doomed.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["step-000004"]
    # a kill between the rename and the deletion leaves the temp-named folder; the sweep removes it, and only it
    (tmp_path / "step-000003").mkdir()
    (tmp_path / "step-000003").rename(tmp_path / ".step-000003.0badcafe.tmp")
    (tmp_path / ".half.json.12345678.tmp").write_text("{")
    assert artifacts.sweep_temp_files(tmp_path) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000004"] and (keep / "sub" / "w.bin").is_file()


def test_stage_run_missing_output_on_clean_exit_fails(tmp_path):
    with pytest.raises(ArtifactError, match="forgot.bin"):
        with StageRun(tmp_path, "tiny", "train", CFG) as run:
            run.add_output("forgot.bin")
    m = artifacts.read_manifest(run.dir)
    assert m.status == "failed" and "forgot.bin" in m.error


def test_failed_rerun_keeps_earlier_complete_manifest(tmp_path):
    with StageRun(tmp_path, "tiny", "train", CFG) as good:
        good.add_output("model.bin").write_text("w")
        good.metrics["loss"] = 0.5
    before = (good.dir / "manifest.json").read_text()
    with pytest.raises(RuntimeError, match="boom"):
        with StageRun(tmp_path, "tiny", "train", CFG):
            raise RuntimeError("boom")
    assert (good.dir / "manifest.json").read_text() == before
    failed = artifacts.read_manifest(good.dir, artifacts.FAILED_MANIFEST_NAME)
    assert failed.status == "failed" and "boom" in failed.error
    assert artifacts.find_complete(tmp_path, "tiny", "train", good.cfg_hash) == good.dir
    with StageRun(tmp_path, "tiny", "train", CFG) as again:  # a later success supersedes the failure record
        again.add_output("model.bin")
    assert not (good.dir / artifacts.FAILED_MANIFEST_NAME).exists()


def test_unserialisable_metrics_fail_the_run_but_keep_good_manifest(tmp_path):
    with StageRun(tmp_path, "tiny", "train", CFG) as good:
        pass
    before = (good.dir / "manifest.json").read_text()
    with pytest.raises(TypeError):
        with StageRun(tmp_path, "tiny", "train", CFG) as run:
            run.metrics["tensor"] = object()
    assert (good.dir / "manifest.json").read_text() == before
    failed = artifacts.read_manifest(run.dir, artifacts.FAILED_MANIFEST_NAME)
    assert failed.status == "failed" and failed.metrics == {} and "TypeError" in failed.error


# --- provenance --------------------------------------------------------------------------------------------------


def _git(repo: Path, *args: str) -> None:
    """git in ``repo`` as a throwaway identity, unsigned: the tests' own commits."""
    ident = ["-c", "user.name=t", "-c", "user.email=t@example.com", "-c", "commit.gpgsign=false"]
    subprocess.run(["git", *ident, *args], cwd=repo, check=True, capture_output=True)


@pytest.mark.skipif(shutil.which("git") is None, reason="git not on PATH")
def test_git_sha_inside_and_outside_a_repo(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # never find a repo above tmp_path
    repo, plain = tmp_path / "repo", tmp_path / "plain"
    repo.mkdir()
    plain.mkdir()
    assert artifacts.git_sha(plain) is None
    assert artifacts.git_sha(tmp_path / "does-not-exist") is None

    _git(repo, "init", "-q")
    assert artifacts.git_sha(repo) is None  # no commit yet
    (repo / "f.txt").write_text("1")
    _git(repo, "add", "f.txt")
    _git(repo, "commit", "-q", "-m", "init")
    sha = artifacts.git_sha(repo)
    assert re.fullmatch(r"[0-9a-f]{40}", sha)
    (repo / "untracked.txt").write_text("u")
    assert artifacts.git_sha(repo) == sha  # untracked files do not make the tree dirty
    (repo / "f.txt").write_text("2")
    assert artifacts.git_sha(repo) == sha + "-dirty"


@pytest.mark.skipif(shutil.which("git") is None, reason="git not on PATH")
def test_manifest_records_the_commit_the_run_started_at(tmp_path, monkeypatch):
    # a long run that someone commits beside while it trains: its code is the code it started with
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    repo = tmp_path / "repo"
    repo.mkdir()

    _git(repo, "init", "-q")
    (repo / "f.txt").write_text("1")
    _git(repo, "add", "f.txt")
    _git(repo, "commit", "-q", "-m", "first")
    first = artifacts.git_sha(repo)
    with StageRun(tmp_path / "runs", "tiny", "train", CFG, repo_dir=repo) as run:
        (repo / "f.txt").write_text("2")
        _git(repo, "commit", "-q", "-am", "second")
    assert artifacts.git_sha(repo) != first
    assert run.manifest.git_sha == first == artifacts.read_manifest(run.dir).git_sha


def test_git_sha_without_git_on_path(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert artifacts.git_sha(tmp_path) is None


def test_package_versions_skips_missing_packages():
    versions = artifacts.package_versions(["pytest", "surely-not-an-installed-package-xyz"])
    assert set(versions) == {"pytest"} and versions["pytest"] == pytest.__version__
    assert set(artifacts.package_versions()) <= set(artifacts.DEFAULT_PACKAGES)


# --- one writer per run folder (docs/artifacts.md, Locks) ---------------------------------------------------------

# A child that holds a run folder's lock: ``StageRun`` on argv[1], prints "held <pid>", waits for the file argv[2],
# then finishes the run (writes a complete manifest). With argv[3] == "fork", it first forks a child that keeps the
# lock's descriptor (as a forked data-loader worker would), prints its PID and sleeps.
HOLDER = """
import os, sys, time
from streakline.artifacts import StageRun
with StageRun(sys.argv[1], "exp", "train", {"a": 1}) as run:
    if len(sys.argv) > 3 and sys.argv[3] == "fork":
        child = os.fork()
        if child == 0:
            time.sleep(120)
            os._exit(0)
        print("child", child, flush=True)
    print("held", os.getpid(), flush=True)
    while not os.path.exists(sys.argv[2]):
        time.sleep(0.02)
"""


def _holder(tmp_path: Path, *extra: str, env: dict | None = None) -> tuple[subprocess.Popen, dict[str, int]]:
    import os
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path / "runs"), str(tmp_path / "go"), *extra],
        stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})},
    )  # fmt: skip
    said = {}
    while "held" not in said:
        line = proc.stdout.readline()
        assert line, f"the holder exited early with {proc.wait()}"
        word, pid = line.split()
        said[word] = int(pid)
    return proc, said


def test_a_second_writer_of_a_run_folder_refuses_naming_the_holder(tmp_path):
    import socket

    proc, said = _holder(tmp_path)
    try:
        with pytest.raises(artifacts.RunLockedError) as err:
            with StageRun(tmp_path / "runs", "exp", "train", {"a": 1}):
                pytest.fail("a second writer got in")
        message = str(err.value)
        assert "\n" not in message and "is being written by another process" in message
        assert f"PID {said['held']}" in message and socket.gethostname() in message and "running since 20" in message
        assert isinstance(err.value, ArtifactError) and not err.value.same_job
        run = artifacts.run_path(tmp_path / "runs", "exp", "train", artifacts.config_hash({"a": 1}))
        assert [p.name for p in run.iterdir()] == [artifacts.LOCK_NAME]  # the refused run wrote nothing there
    finally:
        (tmp_path / "go").touch()
        assert proc.wait(timeout=30) == 0
    assert artifacts.read_manifest(run).status == "complete"
    assert not (run / artifacts.LOCK_NAME).exists()  # released: the folder holds the run's files only
    with StageRun(tmp_path / "runs", "exp", "train", {"a": 1}) as again:  # and the folder is free again
        assert (again.dir / artifacts.LOCK_NAME).is_file()


def test_a_killed_holder_never_blocks_a_rerun(tmp_path):
    import signal

    proc, _ = _holder(tmp_path)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    run = artifacts.run_path(tmp_path / "runs", "exp", "train", artifacts.config_hash({"a": 1}))
    assert (run / artifacts.LOCK_NAME).is_file()  # left behind, but no process holds it any more
    with StageRun(tmp_path / "runs", "exp", "train", {"a": 1}) as rerun:
        assert artifacts.lock_holder(rerun.dir)["pid"] != proc.pid
    assert artifacts.read_manifest(run).status == "complete"


def test_the_lock_of_a_dead_holder_is_broken_even_while_a_forked_child_keeps_it(tmp_path):
    import os
    import signal

    proc, said = _holder(tmp_path, "fork")
    try:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        os.kill(said["child"], 0)  # alive, and its inherited descriptor still holds the flock
        with StageRun(tmp_path / "runs", "exp", "train", {"a": 1}) as rerun:
            assert artifacts.lock_holder(rerun.dir)["pid"] == os.getpid()
            with pytest.raises(artifacts.RunLockedError):  # and it is this process's now, not up for grabs
                artifacts.RunLock(rerun.dir).acquire()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(said["child"], signal.SIGKILL)


def test_the_ranks_of_one_torchrun_job_share_its_lock_and_no_other_job_joins(tmp_path, monkeypatch):
    job = {"RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511", "TORCHELASTIC_RUN_ID": "a"}
    proc, said = _holder(tmp_path, env=job)  # rank 0 of job a
    try:
        run = artifacts.run_path(tmp_path / "runs", "exp", "train", artifacts.config_hash({"a": 1}))
        for key, value in {**job, "RANK": "1"}.items():
            monkeypatch.setenv(key, value)
        artifacts.wait_for_job_lock(run, timeout=5)  # rank 1 of job a: rank 0 holds it for the job; go on
        with pytest.raises(artifacts.RunLockedError) as err:  # a rank of job a taking it itself: the job's own lock
            StageRun(tmp_path / "runs", "exp", "train", {"a": 1}).__enter__()
        assert err.value.same_job and err.value.holder["pid"] == said["held"]
        monkeypatch.setenv("MASTER_PORT", "29512")  # rank 1 of another job on the same folder: never joins
        with pytest.raises(artifacts.RunLockedError, match="did not take the lock"):
            artifacts.wait_for_job_lock(run, timeout=0.5, poll=0.05)
    finally:
        (tmp_path / "go").touch()
        assert proc.wait(timeout=30) == 0


def test_a_refused_run_leaves_no_lock_and_no_folder(tmp_path):
    with pytest.raises(ConfigError):
        with StageRun(tmp_path, "exp", "train", {"a": 2}) as run:
            assert (run.dir / artifacts.LOCK_NAME).is_file()
            raise ConfigError("bad setting")
    assert list(tmp_path.iterdir()) == []


def test_wait_for_complete_returns_the_folder_another_rank_finishes_and_names_a_hung_one(tmp_path):
    """A torchrun rank waits for the shared folder another rank of its job makes (an import), and gives up with the
    fix."""
    import threading
    import time

    digest = artifacts.config_hash(CFG)

    def rank_0():
        time.sleep(0.3)
        with StageRun(tmp_path, "world", "import", CFG) as run:
            (run.dir / "model").mkdir()
            run.add_output("model")

    maker = threading.Thread(target=rank_0)
    maker.start()
    found = artifacts.wait_for_complete(tmp_path, "world", "import", digest, timeout=60, poll=0.05)
    maker.join()
    assert found == artifacts.find_complete(tmp_path, "world", "import", digest) and (found / "model").is_dir()
    with pytest.raises(artifacts.RunLockedError, match="the rank making .* did not finish .* prompt_ids=\\[1\\]"):
        artifacts.wait_for_complete(tmp_path, "world", "import", "0" * 12, timeout=0.2, poll=0.05)


def test_wait_for_complete_with_a_damage_check_waits_until_the_folder_is_repaired(tmp_path):
    """A complete folder the check finds damaged (the world's checksums) is not taken: the wait goes on until the
    maker repairs it, and a timeout names the problem and the caller's way to make it in one process."""
    import threading
    import time

    digest = artifacts.config_hash(CFG)
    with StageRun(tmp_path, "world", "bootstrap", CFG) as run:  # complete, but with a file its check refuses
        (run.dir / "weights").write_text("bad")
        run.add_output("weights")
    checked = []

    def damage(folder: Path) -> str | None:
        checked.append(folder)
        return None if (folder / "weights").read_text() == "good" else "weights does not match its checksum"

    with pytest.raises(artifacts.RunLockedError) as err:
        artifacts.wait_for_complete(tmp_path, "world", "bootstrap", digest, timeout=0.2, poll=0.05, damage=damage,
                                    make="python launch.py stage=bootstrap model=micro")  # fmt: skip
    message = str(err.value)
    assert "\n" not in message and f"the rank making {run.dir} did not finish it within 0 s" in message
    assert "it is complete but damaged: weights does not match its checksum" in message
    assert "make it in one process first (python launch.py stage=bootstrap model=micro)" in message
    assert "prompt_ids" not in message and checked and set(checked) == {run.dir}

    def repair():
        time.sleep(0.3)
        (run.dir / "weights").write_text("good")

    fixer = threading.Thread(target=repair)
    fixer.start()
    t0 = time.monotonic()
    found = artifacts.wait_for_complete(tmp_path, "world", "bootstrap", digest, timeout=60, poll=0.05, damage=damage)
    fixer.join()
    assert found == run.dir and (found / "weights").read_text() == "good"
    assert time.monotonic() - t0 >= 0.25  # held while damaged, not returned at the first (complete) sight


def test_a_rank_waiting_for_the_world_another_rank_builds_gives_up_in_one_line(tmp_path, monkeypatch):
    """ensure_world on a rank whose job's other rank holds the world's lock waits for it (wait_for_complete with the
    world's checksum check), and a hung builder ends the wait with the bootstrap command, not an endless loop."""
    from streakline.config import compose_config
    from streakline.world import build as world

    cfg = compose_config(["stage=bootstrap", "model=micro", f"run_root={tmp_path}"])
    digest = artifacts.config_hash(world.world_key(cfg))
    folder = artifacts.run_dir(tmp_path, world.WORLD_EXPERIMENT, world.STAGE, digest)
    job = {"RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29513", "TORCHELASTIC_RUN_ID": "w"}
    for key, value in job.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(world, "WORLD_WAIT_S", 0.3)
    with artifacts.RunLock(folder):  # the builder rank of this job: holds the lock and never finishes
        with pytest.raises(artifacts.RunLockedError) as err:
            world.ensure_world(cfg, progress=False)
    message = str(err.value)
    assert "\n" not in message and f"the rank making {folder} did not finish it within 0 s" in message
    assert "make it in one process first (python launch.py stage=bootstrap model=micro " in message
    assert "prompt_ids" not in message and "damaged" not in message
    assert [p.name for p in folder.iterdir()] == []  # the waiting rank wrote nothing there


def test_a_run_root_with_too_little_room_is_refused_saying_what_it_has_and_needs(small_disk):
    """The pre-check writes nothing, so its refusal claims no failed write: it states the space free and the
    minimum (issue 62, item 3); a disk with more than the minimum free passes."""
    from streakline.errors import MIN_FREE_BYTES, DiskFullError

    tight, roomy = small_disk(1000), small_disk(MIN_FREE_BYTES // 1024 + 64)
    with pytest.raises(DiskFullError) as refused:
        artifacts.check_run_root(tight)
    message = str(refused.value)
    assert f"the disk holding {tight} has 1000.0 KiB free, less than the 1.0 MiB a run needs" in message
    assert "failed" not in message and "set run_root=" in message and "\n" not in message
    assert not any(tight.iterdir())  # refused before anything was written there
    artifacts.check_run_root(roomy)
