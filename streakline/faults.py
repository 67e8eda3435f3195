"""Named fault points for the kill harness and the bad-input tests: at a point a test names, a child process dies
there as a node failure or the OOM killer would kill it (SIGKILL, no chance to clean up), finds its disk full, or
stalls until the test lets it go, so the test can check what a rerun, or a second process, does.

    STREAKLINE_KILL_AT=distill:checkpointed:step-000006 python launch.py stage=distill ...
    STREAKLINE_DISK_FULL_AT=atomic:shard-00000-of-00002.parquet python launch.py stage=trajectories ...
    STREAKLINE_STALL_AT=run:trajectories:locked STREAKLINE_STALL_UNTIL=/tmp/go python launch.py stage=trajectories ...

``kill_point(name)`` does nothing unless one of these variables names that point: ``STREAKLINE_KILL_AT`` (SIGKILL),
``STREAKLINE_DISK_FULL_AT`` (``OSError(ENOSPC)``, as a write to a full disk raises it) or ``STREAKLINE_STALL_AT``
(print ``stalled at <point>`` to stderr, then wait until the file ``STREAKLINE_STALL_UNTIL`` exists, at most ten
minutes). The points: ``distill:logged:<tag>`` (a step's metrics logged, maybe before any checkpoint),
``distill:checkpointed:<tag>`` (DeepSpeed state saved, not yet exported),
``distill:exported:<tag>`` (exported, not yet marked), ``distill:trained`` (trained and exported, the final
``drafter/`` not yet written), ``atomic:<file name>`` (an atomic write's temp file complete,
not yet renamed; e.g. ``atomic:manifest.json``), ``remove:<folder name>`` (a folder ``artifacts.remove_tree``
deletes, renamed away but not yet deleted; e.g. an old checkpoint ``trainer.keep_last`` prunes) and
``run:<stage>:locked`` (a run has taken its folder's lock and written nothing yet).
Tests: ``python -m pytest tests/pipelines/test_kill_harness.py tests/test_artifacts.py``.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
from pathlib import Path

KILL_AT = "STREAKLINE_KILL_AT"
DISK_FULL_AT = "STREAKLINE_DISK_FULL_AT"
STALL_AT = "STREAKLINE_STALL_AT"
STALL_UNTIL = "STREAKLINE_STALL_UNTIL"


def kill_point(name: str) -> None:
    """At the point ``name``: SIGKILL this process, raise ENOSPC or stall, as the variables above ask; else nothing."""
    if os.environ.get(KILL_AT) == name:
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    if os.environ.get(DISK_FULL_AT) == name:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if os.environ.get(STALL_AT) == name:
        print(f"stalled at {name} (PID {os.getpid()})", file=sys.stderr, flush=True)
        until = Path(os.environ.get(STALL_UNTIL, "/nonexistent/streakline-stall"))
        deadline = time.monotonic() + 600
        while not until.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
