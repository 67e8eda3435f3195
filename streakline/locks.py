"""One writer per run folder: the lock a pipeline stage holds on its run folder while it writes there, so that a
second process (another run of the same config, another torchrun job) is refused in one line instead of writing into
it too (docs/artifacts.md, "Locks").

The lock is an exclusive ``fcntl.flock`` on ``<run folder>/.lock``, whose content names the holder (host, PID, start
time, torchrun job). The kernel drops it when its holder dies, so a killed run never blocks the next. ``StageRun``
(``artifacts.py``) takes it for the whole of a run; the other ranks of a torchrun job wait until rank 0 holds it for
their job instead of taking it themselves::

    with RunLock(folder):                 # RunLockedError (a UserError: one line, status 2) while another holds it
        ...                               # write into folder
    wait_for_job_lock(folder)             # ranks other than 0: until the lock names this job (nothing outside one)
    lock_holder(folder)                   # {"host": ..., "pid": ..., "started_at": ..., "job": ...} or {}
    with update_lock(path):               # waits its turn: one read-modify-write of a shared file at a time
        ...                               # read path, change it, write it back (atomically)

This module sits below ``artifacts.py``: it imports only ``streakline.errors`` and the standard library, and never
torch. Tests: ``python -m pytest tests/test_artifacts.py`` (its "one writer per run folder" section: two processes,
a killed holder, a dead holder whose forked child keeps the lock, two jobs' ranks) and ``python -m pytest
tests/test_bad_inputs.py -k two_runs_of_one_config`` (two concurrent runs from the command line).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Iterator, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from streakline.errors import ArtifactError, RunLockedError

log = logging.getLogger(__name__)

LOCK_NAME = ".lock"  # inside the run folder; a dot-name, so no output glob sees it (checksum listings skip it)
_LOCK_TRIES = 5


def _utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def torchrun_job() -> str | None:
    """An id shared by every rank of this process's torchrun job and by no job running beside it (its rendezvous
    address and run id: two live jobs cannot listen on one port), or None outside such a job."""
    env = os.environ
    if "RANK" not in env or not (env.get("MASTER_ADDR") and env.get("MASTER_PORT")):
        return None
    return f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}/{env.get('TORCHELASTIC_RUN_ID', '')}"


def _proc_start(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot, from /proc), or None where /proc does not say."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()  # the command name in parentheses may hold spaces
    return fields[19] if len(fields) > 19 else None


def _pid_alive(pid: int, start: str | None) -> bool:
    """Whether ``pid`` is a live process on this host, and the same one that started at ``start`` (when given)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: alive
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except (OSError, IndexError):
        return True
    if state in ("Z", "X"):  # killed, not yet reaped by its parent: it holds nothing any more
        return False
    return start is None or _proc_start(pid) in (None, start)


def _read_holder(fd: int) -> dict[str, Any]:
    try:
        data = json.loads(os.pread(fd, 4096, 0).decode("utf-8") or "{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_holder(fd: int) -> None:
    """Record this process as the holder in a lock file it has just locked: host, PID and its start, the time, and
    the torchrun job (``_read_holder`` reads it back for the message a waiting or refused process gives)."""
    me = {
        "host": socket.gethostname(), "pid": os.getpid(), "pid_start": _proc_start(os.getpid()),
        "started_at": _utc_now(), "job": torchrun_job(),
    }  # fmt: skip
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(me) + "\n").encode("utf-8"), 0)


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _holder_text(holder: Mapping[str, Any]) -> str:
    if not holder.get("pid"):
        return "a process that has not yet recorded who it is"
    return f"PID {holder['pid']} on host {holder.get('host', '?')}, running since {holder.get('started_at', '?')}"


class RunLock:
    """The lock that makes one process the only writer of a run folder: an exclusive ``fcntl.flock`` on
    ``<folder>/.lock``, which records the holder's host, PID, start time and torchrun job.

    The kernel drops a flock when its process dies, so a killed run never blocks the next; a lock still held for a
    holder that is gone (a forked child kept the descriptor) is broken when the holder's host is this one and its
    PID is dead. Releasing deletes the file while still holding it; a process that locked the old file meanwhile
    sees it is no longer the one at the path and tries again, so two processes never both hold the lock.
    """

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> RunLock:
        """Take the lock or raise RunLockedError naming its holder; ArtifactError where the filesystem cannot lock."""
        for _ in range(_LOCK_TRIES):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                holder = _read_holder(fd)
                stale = exc.errno in (errno.EAGAIN, errno.EACCES) and self._stale(holder)
                if stale and _same_file(fd, self.path):
                    # the holder is dead but a child it forked keeps the lock: a new file at the path is a new lock
                    log.warning("breaking the lock of dead PID %s in %s", holder.get("pid"), self.folder)
                    with contextlib.suppress(OSError):
                        self.path.unlink()
                os.close(fd)
                if stale:
                    continue
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise ArtifactError(
                        f"cannot lock the run folder {self.folder} ({exc.strerror}): its filesystem does not support "
                        "file locks; set run_root=<a folder on a local or lock-capable filesystem>"
                    ) from exc
                job = torchrun_job()
                raise RunLockedError(
                    f"the run folder {self.folder} is being written by another process ({_holder_text(holder)}); "
                    "wait for it to finish or stop it, then rerun",
                    holder,
                    same_job=job is not None and holder.get("job") == job,
                ) from None
            if not _same_file(fd, self.path):  # its holder released (and deleted) it while we waited: try anew
                os.close(fd)
                continue
            _write_holder(fd)
            self._fd = fd
            return self
        raise ArtifactError(f"could not lock the run folder {self.folder}: its lock kept changing hands; rerun")

    @staticmethod
    def _stale(holder: Mapping[str, Any]) -> bool:
        pid = holder.get("pid")
        if not isinstance(pid, int) or holder.get("host") != socket.gethostname() or pid == os.getpid():
            return False
        return not _pid_alive(pid, holder.get("pid_start"))

    def release(self) -> None:
        """Delete the lock file and drop the lock; nothing when not held."""
        if self._fd is None:
            return
        if _same_file(self._fd, self.path):
            with contextlib.suppress(OSError):
                self.path.unlink()
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


def lock_holder(folder: str | os.PathLike) -> dict[str, Any]:
    """What ``<folder>/.lock`` says of its holder (``{}`` when there is no lock file or it says nothing). The
    record may be stale; only ``RunLock.acquire`` knows whether the lock is held."""
    try:
        fd = os.open(Path(folder) / LOCK_NAME, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return {}
    try:
        return _read_holder(fd)
    finally:
        os.close(fd)


def wait_for_job_lock(folder: str | os.PathLike, timeout: float = 600.0, poll: float = 0.2) -> None:
    """For a rank other than 0 of a torchrun job: return once the run folder's lock is held for this job (rank 0
    takes it), so that the ranks of one job share it and a second job's ranks never join the first's folder.
    RunLockedError after ``timeout`` seconds without it; nothing outside a torchrun job."""
    job = torchrun_job()
    if job is None:
        return
    deadline = time.monotonic() + timeout
    while True:
        holder = lock_holder(folder)
        if holder.get("job") == job:
            return
        if time.monotonic() > deadline:
            raise RunLockedError(
                f"rank 0 of this job did not take the lock of {folder} within {timeout:.0f} s (it holds: "
                f"{_holder_text(holder) if holder else 'nothing'}); another run may be writing it: wait for it to "
                "finish or stop it, then rerun",
                holder,
            )
        time.sleep(poll)


@contextlib.contextmanager
def update_lock(path: str | os.PathLike, timeout: float = 600.0, poll: float = 0.1) -> Iterator[None]:
    """Hold, for a read-modify-write of the shared file ``path`` (a study's ledger, which two reports of a Slurm
    multirun may update at once), an exclusive ``fcntl.flock`` on ``.<name>.lock`` beside it; a second writer waits
    its turn instead of being refused, so it reads the first one's result and neither update is lost. The lock file
    stays (deleting it would let a waiter and a newcomer lock two files); its dot-name keeps it out of listings.
    ArtifactError after ``timeout`` seconds of waiting, naming the holder, or where the filesystem cannot lock."""
    path = Path(path)
    lock = path.parent / f".{path.name}.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise ArtifactError(
                        f"cannot lock {lock} to update {path} ({exc.strerror}): its filesystem does not support file "
                        "locks; keep the file on a local or lock-capable filesystem"
                    ) from exc
                if time.monotonic() > deadline:
                    raise ArtifactError(
                        f"another process ({_holder_text(_read_holder(fd))}) has held {lock} for over {timeout:.0f} s "
                        f"while it updates {path}; wait for it to finish or stop it, then rerun"
                    ) from None
                time.sleep(poll)
        _write_holder(fd)
        yield
    finally:
        os.close(fd)  # drops the flock
