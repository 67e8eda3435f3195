"""Two cold builds of the micro world are the same bit for bit: every weight and tokenizer file has the same sha256.

One build is the session's (``micro_world``: this process, the suite's two torch threads); the other is a fresh
``python launch.py stage=bootstrap model=micro`` in its own run root, with one thread and another hash seed, so a
draw that depends on thread count, dict/set order or the process would show. About 20 s on 2 CPU cores.

    .venv/bin/python -m pytest tests/world/test_reproducible.py -q
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

from streakline.artifacts import read_manifest

ROOT = Path(__file__).resolve().parents[2]


def _hashes(folder: Path) -> dict[str, str]:
    """sha256 of every file of the world's models and tokenizer (not its report, logs or manifest: timings)."""
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for part in ("tokenizer", "verifier", "drafter", "target")
        for p in sorted((folder / part).rglob("*"))
        if p.is_file()
    }


def test_two_cold_builds_of_the_micro_world_are_identical(micro_world, tmp_path):
    _, _, first = micro_world
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONHASHSEED": "12345"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), "stage=bootstrap", "model=micro", f"run_root={tmp_path}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (second,) = (tmp_path / "world" / "bootstrap").iterdir()
    assert second.name == first.folder.name  # the same key
    assert read_manifest(second).status == "complete"
    ours, theirs = _hashes(first.folder), _hashes(second)
    assert any(name.endswith(".safetensors") for name in ours) and len(ours) >= 12
    assert theirs == ours
