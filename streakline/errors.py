"""The one base class of every mistake a user can fix: a bad setting, a missing or mismatched checkpoint, an
unreadable data file, an artifact made for another model.

Each kind keeps its own type where it is raised (``ConfigError`` in ``config/``, ``CheckpointError`` in ``models/``,
``BenchmarkError`` in ``data/``, ...), and every such type derives from :class:`UserError`. The command line catches
``UserError`` alone and prints its message as one line with exit status 2; anything else is a bug in streakline and
keeps its traceback. ``STREAKLINE_DEBUG=1`` (or the override ``debug=true``) shows the traceback of a ``UserError``
too, for when the message is not enough.

    class ShardError(UserError, ValueError): ...   # a new kind: also a ValueError, so existing handlers still match

The run folders' errors live here too, not in ``artifacts.py``: ``ArtifactError`` and ``RunLockedError`` are raised
both there and in ``locks.py``, which sits below it and must not import it. So does the full disk, which any write
may meet (an atomic file, a checkpoint export, DeepSpeed's state)::

    except OSError as exc:
        if is_disk_full(exc):                  # ENOSPC, EDQUOT, or a library's own wording of them
            raise disk_full_error(path, exc) from exc   # DiskFullError: the file, its folder, the space free there

A folder checked before anything is written there (``artifacts.check_run_root``) is refused with
``low_space_error``, which says what it has and the minimum (``MIN_FREE_BYTES``), not that a write failed.

``streakline.artifacts`` re-exports all of these. Tests: ``python -m pytest tests/test_bad_inputs.py
tests/test_artifacts.py``.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

DEBUG_ENV = "STREAKLINE_DEBUG"


class UserError(Exception):
    """Input the user can fix; the message names the thing at fault and the fix, on one line."""


def debugging() -> bool:
    """True when the user asked for full tracebacks (``STREAKLINE_DEBUG`` set to anything but ``""`` or ``0``)."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


class ArtifactError(UserError, RuntimeError):
    """A run folder or manifest is missing, unreadable or inconsistent; the message says how to fix it."""


class RunLockedError(ArtifactError):
    """Another process is writing this run folder (it holds the folder's lock). ``holder``: what the lock file says
    of it (``host``, ``pid``, ``started_at``, ``job``); ``same_job``: the holder is a rank of this process's own
    torchrun job."""

    def __init__(self, message: str, holder: Mapping[str, Any] | None = None, same_job: bool = False) -> None:
        super().__init__(message)
        self.holder, self.same_job = dict(holder or {}), same_job


class DiskFullError(ArtifactError):
    """A write found its disk (or the user's quota) full; the message names the file, its folder and the space free."""


_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` is a write failing for want of space (ENOSPC, or EDQUOT: the user's quota), also as a library
    that wraps the OS error in its own type says it (safetensors: ``StorageFull``)."""
    if isinstance(exc, OSError) and exc.errno in _DISK_FULL:
        return True
    text = str(exc)
    return any(sign in text for sign in ("No space left on device", "StorageFull", "Disk quota exceeded"))


# Below this much free space a disk counts as full: what a write that filled it leaves, and too little for a job's
# first writes (Hydra's log and config under run_root, before any stage code could say what went wrong).
MIN_FREE_BYTES = 1 << 20


def free_bytes(path: str | os.PathLike) -> int | None:
    """The bytes free on the disk holding ``path`` (its nearest existing folder), None when it cannot be asked."""
    probe = Path(path).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return shutil.disk_usage(probe).free
    except OSError:
        return None


def nearly_full(path: str | os.PathLike) -> bool:
    """Whether the disk holding ``path`` has less than ``MIN_FREE_BYTES`` free (False when it cannot be asked)."""
    free = free_bytes(path)
    return free is not None and free < MIN_FREE_BYTES


def low_space_error(path: str | os.PathLike, free: int) -> DiskFullError:
    """The one-line refusal of a folder whose disk has ``free`` bytes, under ``MIN_FREE_BYTES``, before anything is
    written there: what it has and what it needs (no write has failed, so none is claimed)."""
    return DiskFullError(
        f"the disk holding {Path(path).absolute()} has {_bytes(free)} free, less than the {_bytes(MIN_FREE_BYTES)} a "
        "run needs before it starts (Hydra writes its log and config there first); free some space there or set "
        "run_root=<a folder on a disk with room>"
    )


def disk_full_error(
    path: str | os.PathLike, exc: BaseException | None = None, folder: bool = False, kept: str | None = None
) -> DiskFullError:
    """The one-line error for a write to the file ``path`` that found no space: what, where and how much is free
    there. ``folder``: ``path`` is only the folder the write went to (the failing call did not name its file).
    ``kept``: what the failed write left as it was (e.g. "the earlier export at ... is kept"); by default the
    general "what the run finished is kept"."""
    path = Path(path).absolute()
    free = free_bytes(path if folder else path.parent)
    room = "free space unknown" if free is None else f"{_bytes(free)} free there"
    quota = " (the user's disk quota is used up)" if isinstance(exc, OSError) and exc.errno == errno.EDQUOT else ""
    what = f"a write under {path}" if folder else f"writing {path.name} in {path.parent}"
    return DiskFullError(
        f"the disk is full{quota}: {what} failed ({room}); free some space there "
        f"(or set run_root=<a folder on a disk with room>) and rerun: {kept or 'what the run finished is kept'}"
    )
