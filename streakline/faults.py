"""Named kill points for the kill harness: a test's child process dies there as a node failure or the OOM killer
would kill it, with no chance to clean up (SIGKILL), so the test can check that a rerun finishes the work.

    STREAKLINE_KILL_AT=distill:checkpointed:step-000006 python launch.py stage=distill ...

``kill_point(name)`` does nothing unless ``STREAKLINE_KILL_AT`` names that point. The points: ``distill:checkpointed:
<tag>`` (DeepSpeed state saved, not yet exported), ``distill:exported:<tag>`` (exported, not yet marked), and
``atomic:<file name>`` (an atomic write's temp file complete, not yet renamed; e.g. ``atomic:manifest.json``), and
``remove:<folder name>`` (a folder ``artifacts.remove_tree`` deletes, renamed away but not yet deleted; e.g. an old
checkpoint ``trainer.keep_last`` prunes).
Tests: ``python -m pytest tests/pipelines/test_kill_harness.py``.
"""

from __future__ import annotations

import os
import signal
import sys

KILL_AT = "STREAKLINE_KILL_AT"


def kill_point(name: str) -> None:
    """SIGKILL this process when ``STREAKLINE_KILL_AT`` equals ``name``; otherwise nothing."""
    if os.environ.get(KILL_AT) == name:
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
