"""Shared pytest setup: deterministic CPU torch, no network, W&B offline."""

import os

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of tiny-model tests (``pytestmark = pytest.mark.usefixtures("one_thread")``): a
    second thread only adds synchronisation, and on a shared 2-core machine two threads contending with another job
    made such tests 10-15x slower (55 s vs 3.4 s measured). The session's setting comes back after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def micro_world(tmp_path_factory):
    """``(run_root, cfg, result)`` of ``stage=bootstrap model=micro``: built once (about a minute on 2 cores) and
    shared by the stage tests. A test that damages it must leave it rebuilt (the bootstrap cache tests do)."""
    from streakline.config import compose_config
    from streakline.pipelines import run_stage

    root = tmp_path_factory.mktemp("micro_runs")
    cfg = compose_config(["stage=bootstrap", "model=micro", f"run_root={root}"])
    return root, cfg, run_stage(cfg)


@pytest.fixture
def small_disk(tmp_path):
    """``small_disk(kib)``: a folder on a real filesystem of ``kib`` KiB (a tmpfs mounted under ``tmp_path``,
    unmounted after the test), so that a write past it fails as on a full disk, with the real error of whatever
    library writes. Mounting needs root (or CAP_SYS_ADMIN): elsewhere the test is skipped, saying so."""
    import shutil
    import subprocess

    mounted = []

    def make(kib: int):
        where = tmp_path / f"disk{len(mounted)}"
        where.mkdir()
        if shutil.which("mount") is None:
            pytest.skip("no mount command to make a small filesystem")
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(where)],
                              capture_output=True, text=True)  # fmt: skip
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a small filesystem here (needs root): {proc.stderr.strip()[:120]}")
        mounted.append(where)
        return where

    yield make
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)
