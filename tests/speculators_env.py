"""The ``speculators`` package (the reference DFlash implementation vLLM serves) for the tests that compare with it,
installed beside the project rather than into it, and a way to run code under it.

``speculators_folder()`` installs it from PyPI on first use (``pip install --no-deps --target``) into
``~/.cache/streakline/speculators-<version>`` (``$XDG_CACHE_HOME`` is honoured) and reuses it afterwards; nothing
goes into the project's environment. Without access to the package index the calling test is skipped, any other
install failure fails it. ``run_under_speculators`` runs a script in a subprocess (this interpreter, that folder
first on ``PYTHONPATH``), so none of its imports or registrations reach the test process.

Only the few packages its import needs beyond this project's environment are installed (``EXTRA_REQUIREMENTS``),
not its full ``install_requires`` (torchvision, torchaudio, datasets, ... are never imported on the paths the tests
take). ``speculators`` 0.9.0 pins ``transformers<=5.19`` and ``torch<=2.14.1``; the environment's own
``torch``/``transformers`` are used, so a release of either that breaks ``speculators`` shows up here first.

Used by ``tests/models/test_dflash_speculators.py`` (checkpoints and logits) and
``tests/alignment/test_dpace_speculators.py`` (the D-PACE loss). Measured on 2 shared CPU cores: the install about
4 s (3 MB downloaded, 33 MB on disk).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from streakline.models.dflash_checkpoint import SPECULATORS_VERSION

# What importing speculators (its models and losses) and DFlashDraftModel.from_pretrained need that this project's
# environment lacks (found by importing it with only these beside it): its data/training modules, imported by the
# package's __init__, import openai and hs_connectors; its weight loader imports loguru. hs-connectors is pinned
# exactly by speculators 0.9.0; the other two are the versions the tests were written against.
REQUIREMENTS = (f"speculators=={SPECULATORS_VERSION}", "hs-connectors==0.9.0", "openai==3.57.0", "loguru==0.7.3")
EXTRA_REQUIREMENTS = REQUIREMENTS[1:]
MARKER = ".streakline-complete"  # written last: its presence (with these requirements) means the install is whole

# pip's messages when the package index cannot be reached (no network, no proxy, DNS failure)
_OFFLINE_SIGNS = (
    "NewConnectionError",
    "Failed to establish a new connection",
    "Temporary failure in name resolution",
    "Name or service not known",
    "Network is unreachable",
    "ProxyError",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "No route to host",
)


def _cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "streakline"


def _install(target: Path) -> None:
    """``pip install --no-deps --target`` of REQUIREMENTS into ``target`` (absent), atomically: a temporary folder
    beside it, the marker last, then renamed into place. Skips the test when the index cannot be reached."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-input", "--disable-pip-version-check",
           "--timeout", "30", "--retries", "1", "--target", str(tmp), *REQUIREMENTS]  # fmt: skip
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            output = done.stdout + done.stderr
            if any(sign in output for sign in _OFFLINE_SIGNS):
                pytest.skip(
                    f"cannot reach the package index to install speculators=={SPECULATORS_VERSION} (no network?)"
                )
            pytest.fail(f"installing {' '.join(REQUIREMENTS)} failed (pip exit {done.returncode}):\n{output[-4000:]}")
        (tmp / MARKER).write_text("\n".join(REQUIREMENTS) + "\n")
        try:
            os.replace(tmp, target)
        except OSError:  # another process installed it meanwhile: use theirs if it is whole
            if not _complete(target):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _complete(folder: Path) -> bool:
    marker = folder / MARKER
    return marker.is_file() and marker.read_text().split() == list(REQUIREMENTS)


def speculators_folder() -> Path:
    """A folder holding speculators (and the extras its import needs), installed from PyPI once and reused."""
    target = _cache_root() / f"speculators-{SPECULATORS_VERSION}"
    if not _complete(target):
        shutil.rmtree(target, ignore_errors=True)  # a partial or outdated install
        _install(target)
    return target


def run_under_speculators(folder: Path, script: Path, *args: str, cwd: Path, timeout: float = 600) -> str:
    """Run ``script`` with this interpreter and speculators' ``folder`` first on ``PYTHONPATH``, offline for the
    Hugging Face libraries; fails the test with the end of its output unless it exits 0. Returns its stdout."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(folder), env.get("PYTHONPATH")) if p)
    done = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout
    )
    assert done.returncode == 0, f"the speculators driver {script.name} failed:\n{(done.stdout + done.stderr)[-6000:]}"
    return done.stdout
