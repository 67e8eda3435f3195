"""Run folders, config hashes and manifests: how a pipeline stage records what it made and knows what it can skip.

Every stage writes into ``<root>/<experiment>/<stage>/<config-hash>/`` and finishes by writing
``manifest.json`` there (atomically, last). A folder whose manifest says ``complete`` and whose listed
outputs all exist is a finished result that a later run with the same config may reuse.

Typical use inside a stage::

    done = find_complete(root, "tiny", "distill", config_hash(cfg, exclude=["wandb"]))
    if done is None:
        with StageRun(root, "tiny", "distill", cfg, inputs={"teacher": teacher_hash}, exclude=["wandb"]) as run:
            save_checkpoint(run.add_output("checkpoint"))  # add_output returns the absolute path
            run.metrics["loss"] = 1.23
        done = run.dir

This module is near ground level: it imports only ``errors``, ``faults`` and ``locks`` (the run folder's lock, one
writer at a time) from the rest of streakline, and never imports torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import re
import secrets
import shutil
import socket
import subprocess
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path, PurePath
from typing import IO, Any

# the error types (and the disk-full check) and the run lock live in errors.py and locks.py; their names are
# re-exported here for callers
from streakline.errors import (  # noqa: F401
    MIN_FREE_BYTES,
    ArtifactError,
    DiskFullError,
    RunLockedError,
    UserError,
    disk_full_error,
    free_bytes,
    is_disk_full,
    low_space_error,
    nearly_full,
)
from streakline.faults import kill_point
from streakline.locks import (  # noqa: F401
    LOCK_NAME,
    RunLock,
    _holder_text,
    _utc_now,
    lock_holder,
    torchrun_job,
    wait_for_job_lock,
)

log = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
FAILED_MANIFEST_NAME = "manifest.failed.json"
STATUSES = ("complete", "failed")
DEFAULT_PACKAGES = (
    "torch", "transformers", "deepspeed", "peft", "datasets", "hydra-core", "ray", "triton", "safetensors",
    "streakline",
)  # fmt: skip


def check_run_root(root: str | os.PathLike) -> None:
    """Make ``root`` (``run_root``) if missing and raise ArtifactError unless this user can write there. Checked
    before any work: found at the first write, it would cost the work done until then."""
    root = Path(root).absolute()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ArtifactError(
            f"run_root={root} cannot be created ({e.strerror}); set run_root=<a writable folder>"
        ) from e
    if not os.access(root, os.W_OK | os.X_OK):
        try:
            read_only = bool(os.statvfs(root).f_flag & os.ST_RDONLY)
        except OSError:
            read_only = False
        if read_only:
            raise ArtifactError(
                f"run_root={root} is on a read-only filesystem; set run_root=<a folder on a writable filesystem>"
            )
        raise ArtifactError(f"run_root={root} is not writable by this user; set run_root=<a writable folder>")
    free = free_bytes(root)
    if free is not None and free < MIN_FREE_BYTES:  # Hydra writes its log and config there before any stage code
        raise low_space_error(root, free)


def _plain(cfg: Any) -> Any:
    """Turn an OmegaConf config (or any Mapping) into plain dicts/lists; other values pass through."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # omegaconf is optional for this module; plain dicts work without it
        pass
    else:
        if isinstance(cfg, (DictConfig, ListConfig)):
            return OmegaConf.to_container(cfg, resolve=True)
    # Rebuilding every container also gives callers a private copy that excluding keys may mutate.
    if isinstance(cfg, Mapping):
        return {k: _plain(v) for k, v in cfg.items()}
    if isinstance(cfg, (list, tuple)):
        return [_plain(v) for v in cfg]
    return cfg


def _drop(tree: Any, dotted: str) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        if isinstance(tree, dict):
            tree = tree.get(part)
        elif isinstance(tree, list) and part.isdigit() and int(part) < len(tree):
            tree = tree[int(part)]
        else:
            return  # an excluded key that is absent is simply not there to ignore
    if isinstance(tree, dict):
        tree.pop(leaf, None)


def _json_default(obj: Any) -> Any:
    # Paths are common in configs and have one obvious spelling; anything else must be made plain by the caller,
    # because a repr-based fallback would make hashes depend on memory addresses or library versions.
    if isinstance(obj, PurePath):
        return str(obj)
    raise TypeError(f"cannot serialise {type(obj).__name__} to JSON: {obj!r}")


def config_hash(cfg: Any, exclude: Iterable[str] = ()) -> str:
    """12-hex-char SHA-256 of ``cfg`` as canonical JSON, independent of key order; ``exclude``: dotted keys to skip."""
    tree = _plain(cfg)
    for key in exclude:
        _drop(tree, key)
    text = json.dumps(tree, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=_json_default)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]


def run_path(root: str | os.PathLike, experiment: str, stage: str, cfg_hash: str) -> Path:
    """Absolute ``root/<experiment>/<stage>/<cfg_hash>/`` without creating it (a consumer looking for a run must
    not leave an empty folder behind when the run is not there)."""
    for value in (experiment, stage, cfg_hash):
        # These become folder names; a slash or '..' would silently put the run somewhere else.
        if not value or value in (".", "..") or "/" in value or "\\" in value:
            raise ValueError(f"{value!r} is not usable as a run folder name component")
    return Path(root).expanduser().resolve() / experiment / stage / cfg_hash


def run_dir(root: str | os.PathLike, experiment: str, stage: str, cfg_hash: str) -> Path:
    """Absolute ``root/<experiment>/<stage>/<cfg_hash>/``, created if missing."""
    path = run_path(root, experiment, stage, cfg_hash)
    path.mkdir(parents=True, exist_ok=True)
    return path


# atomic_file's temp names, ".<name>.<8 hex>.tmp" (made below; sweep_temp_files finds what a killed writer left)
_TEMP_NAME = re.compile(r"^\..+\.[0-9a-f]{8}\.tmp$")


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "w") -> Iterator[IO]:
    """Open a file that appears at ``path`` only once the ``with`` block finishes; readers see the old file or the
    whole new one, never a part. ``mode`` is "w" (text, utf-8) or "wb". On an exception nothing is left behind.

    The temp file is a unique dot-name beside ``path`` (concurrent writers never share one, and globs such as
    ``shard-*.parquet`` skip it); it is fsynced before the rename, and the folder after it. A disk found full
    raises ``DiskFullError`` (a ``UserError``) naming the file, its folder and the space left.
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"mode must be 'w' or 'wb', got {mode!r}")
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    # os.open with 0o666 lets the umask decide permissions, unlike mkstemp's fixed 0o600.
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as exc:
        if is_disk_full(exc):
            raise disk_full_error(path, exc) from exc
        raise
    try:
        with os.fdopen(fd, mode, **({"encoding": "utf-8"} if mode == "w" else {})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        kill_point(f"atomic:{path.name}")  # the kill harness: a temp file complete, not yet in place
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if is_disk_full(exc):  # a full disk is the user's to fix: one line naming the file, not a traceback
            raise disk_full_error(path, exc) from exc
        raise
    # Make the rename itself durable; some filesystems cannot fsync a directory, which is harmless.
    with contextlib.suppress(OSError):
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` so that readers see either the old file or the whole new one, never a part."""
    with atomic_file(path, "w") as f:
        f.write(text)


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """Serialise ``obj`` fully, then write it atomically; a serialisation error leaves ``path`` untouched."""
    text = json.dumps(obj, indent=2, ensure_ascii=False, allow_nan=False, default=_json_default) + "\n"
    write_text_atomic(path, text)


_OPT_STR = (str, type(None))
_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    "stage": str, "experiment": str, "config": dict, "config_hash": str, "status": str, "inputs": dict,
    "outputs": list, "metrics": dict, "git_sha": _OPT_STR, "package_versions": dict, "python": str, "host": str,
    "started_at": str, "finished_at": str, "error": _OPT_STR,
}  # fmt: skip
_REQUIRED = ("stage", "experiment", "config", "config_hash", "status")


@dataclasses.dataclass
class Manifest:
    """What one stage run made, from what, with which code; stored as ``manifest.json`` in its run folder."""

    stage: str
    experiment: str
    config: dict[str, Any]
    config_hash: str
    status: str  # "complete" | "failed"
    inputs: dict[str, str] = dataclasses.field(default_factory=dict)
    outputs: list[str] = dataclasses.field(default_factory=list)
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)
    git_sha: str | None = None
    package_versions: dict[str, str] = dataclasses.field(default_factory=dict)
    python: str = ""
    host: str = ""
    started_at: str = ""
    finished_at: str = ""
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> Manifest:
        """Build a Manifest from parsed JSON, raising ArtifactError when a field is missing or has the wrong type."""
        if not isinstance(data, dict):
            raise ArtifactError(f"manifest must be a JSON object, got {type(data).__name__}")
        # Optional fields may be absent so that manifests written before a field existed still load.
        if missing := [k for k in _REQUIRED if k not in data]:
            raise ArtifactError(f"manifest lacks required fields {missing}")
        if wrong := [k for k, kind in _FIELD_TYPES.items() if k in data and not isinstance(data[k], kind)]:
            raise ArtifactError(f"manifest fields {wrong} have the wrong JSON type")
        if data["status"] not in STATUSES:
            raise ArtifactError(f"manifest status {data['status']!r} is not one of {STATUSES}")
        return cls(**{k: data[k] for k in _FIELD_TYPES if k in data})


def _missing_outputs(directory: Path, outputs: Iterable[str]) -> list[str]:
    return [rel for rel in outputs if not (directory / rel).exists()]


def write_manifest(directory: str | os.PathLike, manifest: Manifest, name: str = MANIFEST_NAME) -> Path:
    """Atomically write ``manifest`` as ``directory/name`` after checking every listed output exists there."""
    directory = Path(directory)
    if manifest.status not in STATUSES:
        raise ArtifactError(f"manifest status {manifest.status!r} is not one of {STATUSES}")
    if any(PurePath(rel).is_absolute() or ".." in PurePath(rel).parts for rel in manifest.outputs):
        raise ArtifactError(f"outputs must be relative paths inside the run folder {directory}: {manifest.outputs}")
    if missing := _missing_outputs(directory, manifest.outputs):
        raise ArtifactError(
            f"cannot write manifest in {directory}: listed outputs {missing} do not exist there; "
            "write them before the manifest or drop them from the output list"
        )
    write_json_atomic(directory / name, manifest.to_dict())
    return directory / name


def read_manifest(directory: str | os.PathLike, name: str = MANIFEST_NAME) -> Manifest:
    """Load ``directory/name``; raise ArtifactError naming the folder and the fix if it is missing or unusable."""
    path = Path(directory) / name
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ArtifactError(f"no {name} in {directory}: the stage did not finish there; rerun it") from None
    except OSError as exc:
        raise ArtifactError(f"cannot read {path}: {exc}; check the folder's permissions") from exc
    try:
        return Manifest.from_dict(json.loads(text))
    except (ValueError, ArtifactError) as exc:  # JSONDecodeError is a ValueError
        raise ArtifactError(
            f"{name} in {directory} is truncated or not a streakline manifest ({exc}); delete the folder and rerun"
        ) from exc


def manifest_or_none(directory: str | os.PathLike, name: str = MANIFEST_NAME) -> Manifest | None:
    """The manifest in ``directory``, or None when there is none or it cannot be read: for callers to whom such a
    folder is simply not a finished run (lookups, reports); ``read_manifest`` says why, for those who must."""
    try:
        return read_manifest(directory, name)
    except ArtifactError:
        return None


def complete_runs(root: str | os.PathLike, experiment: str, stage: str) -> Iterator[tuple[Path, Manifest]]:
    """``(folder, manifest)`` of every run of ``stage`` in ``experiment`` whose manifest says complete, by folder."""
    for path in sorted(Path(root, experiment, stage).glob(f"*/{MANIFEST_NAME}")):
        manifest = manifest_or_none(path.parent)
        if manifest is not None and manifest.status == "complete":
            yield path.parent, manifest


def find_complete(root: str | os.PathLike, experiment: str, stage: str, cfg_hash: str) -> Path | None:
    """The run folder if it holds a complete manifest for this stage and hash whose outputs all exist, else None."""
    path = run_path(root, experiment, stage, cfg_hash)
    manifest = manifest_or_none(path)
    if manifest is None or manifest.status != "complete" or manifest.stage != stage or manifest.config_hash != cfg_hash:
        return None
    return None if _missing_outputs(path, manifest.outputs) else path


_GIT_ENV_OVERRIDES = ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE")


def git_sha(repo_dir: str | os.PathLike | None = None) -> str | None:
    """HEAD commit of the repo holding ``repo_dir`` (default: this package's source), ``-dirty`` if tracked files
    changed; None outside git, without git, or before the first commit. Never raises."""
    cwd = Path(repo_dir) if repo_dir is not None else Path(__file__).resolve().parent
    # A GIT_DIR inherited from a hook or wrapper would make git describe some other repository.
    env = {k: v for k, v in os.environ.items() if k not in _GIT_ENV_OVERRIDES}

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=10, check=True)
        return done.stdout.strip()

    try:
        sha = git("rev-parse", "HEAD")
        if not re.fullmatch(r"[0-9a-f]{40}|[0-9a-f]{64}", sha):
            return None
        return sha + "-dirty" if git("status", "--porcelain", "--untracked-files=no") else sha
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def package_versions(names: Iterable[str] = DEFAULT_PACKAGES) -> dict[str, str]:
    """Installed versions of ``names``; packages that are not installed are left out."""
    versions = {}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def sweep_temp_files(folder: str | os.PathLike) -> int:
    """Delete the temp files ``atomic_file`` leaves when a process is killed mid-write (never a finished file), and
    the temp-named folders a killed ``remove_tree`` leaves, anywhere under ``folder``; returns how many. A stage run
    calls it on start: its folder is its own."""
    n = 0
    for path in sorted(Path(folder).rglob(".*.tmp")):
        if not _TEMP_NAME.match(path.name):
            continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        elif path.exists():
            path.unlink(missing_ok=True)
        else:
            continue  # inside a folder removed above
        n += 1
    return n


def remove_tree(path: str | os.PathLike) -> None:
    """Delete the folder ``path`` so that a kill at any moment leaves it whole under its name or gone from it: one
    rename to a temp name beside it (atomic; no glob for the old name sees it any more), then the deletion, which
    ``sweep_temp_files`` finishes on the next start if a kill cut it short."""
    path = Path(path)
    doomed = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    path.rename(doomed)
    kill_point(f"remove:{path.name}")  # the kill harness: renamed away, not yet deleted
    shutil.rmtree(doomed)


# How a waiting rank's message says to make a shared folder in one process: any stage that loads the same models
# makes the imports they need.
_MAKE_BY_ANY_STAGE = (
    "any stage with the same model settings does, e.g. python launch.py stage=decode <those settings> prompt_ids=[1]"
)


def wait_for_complete(
    root: str | os.PathLike,
    experiment: str,
    stage: str,
    cfg_hash: str,
    timeout: float = 3600.0,
    poll: float = 0.5,
    *,
    damage: Callable[[Path], str | None] | None = None,
    make: str = _MAKE_BY_ANY_STAGE,
) -> Path:
    """For the ranks of a torchrun job that did not get the lock of a shared artifact one of them makes (an import of
    the verifier's weights, the tiny world): the run folder once it is complete. RunLockedError after ``timeout``
    seconds (torchrun stops the other ranks when one fails, so a long wait means a hung maker).

    ``damage``: a further check of a complete folder, the problem in a few words or None; a folder it finds damaged
    counts as not made yet (its maker rebuilds it), and the timeout's message names the problem. ``make``: how to make
    the folder in one process, for that message (default: any stage with the same model settings)."""
    deadline = time.monotonic() + timeout
    while True:
        problem = None
        found = find_complete(root, experiment, stage, cfg_hash)
        if found is not None:
            problem = damage(found) if damage is not None else None
            if problem is None:
                return found
        if time.monotonic() > deadline:
            folder = run_path(root, experiment, stage, cfg_hash)
            holder = lock_holder(folder)
            damaged = f"; it is complete but damaged: {problem}" if problem else ""
            raise RunLockedError(
                f"the rank making {folder} did not finish it within {timeout:.0f} s (its lock is held by: "
                f"{_holder_text(holder) if holder else 'nobody'}{damaged}); see that rank's error, or make it in one "
                f"process first ({make}), then start the job again",
                holder,
            )
        time.sleep(poll)


class StageRun:
    """Context manager for one stage run: makes the folder, then writes the manifest last, complete or failed.

    A failed run never overwrites a complete ``manifest.json`` from an earlier run in the same folder; its
    record goes to ``manifest.failed.json`` instead, so the good result stays usable and the failure inspectable.
    A run refused for bad input (a ``UserError``) in a folder it made and wrote nothing to leaves no folder behind:
    there is nothing to inspect or resume, and the message is on the terminal.

    From ``__enter__`` to the end of ``__exit__`` the run holds the folder's :class:`RunLock`: a second process that
    opens a ``StageRun`` on the same folder meanwhile gets ``RunLockedError`` (one line naming the holder) and
    writes nothing there.
    """

    def __init__(
        self, root: str | os.PathLike, experiment: str, stage: str, cfg: Any,
        inputs: Mapping[str, str | os.PathLike] | None = None, exclude: Iterable[str] = (),
        packages: Iterable[str] = DEFAULT_PACKAGES, repo_dir: str | os.PathLike | None = None,
    ) -> None:  # fmt: skip
        self.root, self.experiment, self.stage = root, experiment, stage
        self.config = _plain(cfg)
        if not isinstance(self.config, dict):
            raise TypeError(f"a stage config must be a mapping, got {type(cfg).__name__}")
        self.cfg_hash = config_hash(self.config, exclude)
        self.inputs = {k: str(v) for k, v in (inputs or {}).items()}
        self.packages, self.repo_dir = tuple(packages), repo_dir
        self.metrics: dict[str, Any] = {}
        self.outputs: list[str] = []
        self.manifest: Manifest | None = None
        self.dir = run_path(root, experiment, stage, self.cfg_hash)
        self._started_at = ""
        self._git_sha: str | None = None
        self._made_folder = False
        self._lock = RunLock(self.dir)
        self._abandoned = False

    def add_output(self, relpath: str | os.PathLike) -> Path:
        """Record a file or folder (relative to ``run.dir``) as an output; returns its absolute path."""
        path = Path(relpath)
        if path.is_absolute():
            try:
                path = path.resolve().relative_to(self.dir)
            except ValueError:
                raise ArtifactError(f"output {relpath} is outside the run folder {self.dir}") from None
        if ".." in path.parts:
            raise ArtifactError(f"output {relpath} escapes the run folder {self.dir}")
        rel = path.as_posix()
        if rel not in self.outputs:
            self.outputs.append(rel)
        return self.dir / rel

    def abandon(self) -> None:
        """Leave the run without writing a manifest (the caller found, under the lock, that another process has
        completed this folder meanwhile); ``__exit__`` then only releases the lock."""
        self._abandoned = True

    def __enter__(self) -> StageRun:
        self._made_folder = not self.dir.exists()
        folder = run_dir(self.root, self.experiment, self.stage, self.cfg_hash)
        try:
            self._lock.acquire()
        except ArtifactError:
            if self._made_folder:
                _remove_empty(folder, stop=Path(self.root))
            raise
        kill_point(f"run:{self.stage}:locked")  # the kill harness and lock tests: the lock held, nothing written
        swept = sweep_temp_files(folder)
        if swept:
            log.info("removed %d temp file(s) a killed run left in %s", swept, folder)
        self._started_at = _utc_now()
        # The code that runs is the code at the start: a commit made while a two-hour run trains is not its code.
        self._git_sha = git_sha(self.repo_dir)
        return self

    def _manifest(self, status: str, error: str | None) -> Manifest:
        outputs = self.outputs if status == "complete" else [o for o in self.outputs if (self.dir / o).exists()]
        return Manifest(
            stage=self.stage, experiment=self.experiment, config=self.config, config_hash=self.cfg_hash,
            status=status, inputs=dict(self.inputs), outputs=list(outputs), metrics=dict(self.metrics),
            git_sha=self._git_sha, package_versions=package_versions(self.packages),
            python=platform.python_version(), host=socket.gethostname(), started_at=self._started_at,
            finished_at=_utc_now(), error=error,
        )  # fmt: skip

    def _record_failure(self, error: str) -> None:
        earlier = manifest_or_none(self.dir)
        earlier_ok = earlier is not None and earlier.status == "complete"
        name = FAILED_MANIFEST_NAME if earlier_ok else MANIFEST_NAME
        manifest = self._manifest("failed", error)
        # Unencodable metrics must not cost us the failure record, so retry without them; and whatever goes wrong
        # here, the stage's own error must stay the one that surfaces.
        for metrics in (manifest.metrics, {}):
            try:
                manifest.metrics = metrics
                write_manifest(self.dir, manifest, name)
                self.manifest = manifest
                return
            except Exception as err:
                if isinstance(err, DiskFullError):  # the stage's own error says it, in one line: no traceback here
                    log.warning("no failure record of %s in %s: the disk is full", self.stage, self.dir)
                    return
                log.exception("writing the failure record of %s in %s failed", self.stage, self.dir)

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        try:
            return self._finish(exc_type, exc, tb)
        finally:
            self._lock.release()

    def _finish(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if self._abandoned and exc is None:
            return False
        if exc is None:
            try:
                manifest = self._manifest("complete", None)
                write_manifest(self.dir, manifest)
            except Exception as err:
                self._record_failure(f"writing the complete manifest failed: {type(err).__name__}: {err}")
                raise
            self.manifest = manifest
            # An older failure record describes a run this success supersedes.
            (self.dir / FAILED_MANIFEST_NAME).unlink(missing_ok=True)
            return False
        if isinstance(exc, UserError) and self._made_folder and _holds_no_files(self.dir):
            self._lock.release()  # before the folder goes: the lock file is the last thing in it
            shutil.rmtree(self.dir, ignore_errors=True)  # at most empty subfolders (shards/) the run made
            _remove_empty(self.dir.parent, stop=Path(self.root))
            return False
        self._record_failure("".join(traceback.format_exception(exc_type, exc, tb)))
        return False  # never swallow the stage's exception


def _holds_no_files(folder: Path) -> bool:
    """Whether ``folder`` holds nothing but (empty) subfolders and its lock file: a run that wrote nothing."""
    return all((p.is_dir() and not p.is_symlink()) or p.name == LOCK_NAME for p in folder.rglob("*"))


def _remove_empty(folder: Path, stop: Path) -> None:
    """Remove ``folder`` and then each parent below ``stop`` for as long as they are empty."""
    stop = stop.absolute()
    while folder != stop and stop in folder.parents:
        try:
            folder.rmdir()
        except OSError:  # not empty (another run lives there) or already gone
            return
        folder = folder.parent
