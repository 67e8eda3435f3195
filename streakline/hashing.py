"""Content hashes for run keys: data files, checkpoint folders, folders a stage wrote (docs/artifacts.md, "When a key
moves").

    digest = file_sha256(path, cache)     # sha256 of a file, cached in the JSON file `cache` by path, size, mtime
    print_ = folder_fingerprint(folder)   # a checkpoint folder without reading its weights (100 GB in milliseconds)
    origin = run_output(folder)           # "<experiment>/<stage>/<hash>/<part>" when a finished stage wrote it

A run key that names a file by its path reuses a result made from whatever the file held then; one that holds these
reuses it only for the same content. Tests: ``python -m pytest tests/pipelines/test_fingerprints.py
tests/world/test_imports.py``.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from streakline.artifacts import MANIFEST_NAME, manifest_or_none, write_json_atomic

# A file changed within this many seconds of being hashed may change again within the same mtime tick (Linux stamps
# files with a coarse clock), so its hash is not remembered: the next look reads it again.
RACY_SECONDS = 2.0
# Weight files: fingerprinted by name, size, mtime and (safetensors) header, never read whole.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack", ".npz")
# Other files of a checkpoint folder (config.json, tokenizer files, chat templates, generation_config.json) are hashed
# whole up to this size; a larger one (rare: an odd extra file) by name, size and mtime.
SMALL_FILE = 64 << 20
# How far above a checkpoint folder the run folder that wrote it may be (<run>/drafter, <run>/checkpoints/step-N).
RUN_DEPTH = 3


def file_sha256(path: Path, cache: Path) -> str:
    """sha256 of ``path``, remembered in the JSON file ``cache`` by path, size and mtime (a changed file is hashed
    again; a file modified in the last ``RACY_SECONDS`` is not remembered; an unreadable cache is only a slower
    run)."""
    stat = path.stat()
    entry = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    if entry in known:
        return known[entry]
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    value = digest.hexdigest()
    if time.time() - stat.st_mtime_ns / 1e9 < RACY_SECONDS:
        return value  # an edit in the same clock tick would keep size and mtime: hash it again next time
    known[entry] = value
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(cache, known)
    except OSError:
        pass  # a read-only run root still works; it only hashes again next time
    return value


def folder_fingerprint(folder: str | Path) -> str:
    """16-hex identity of a checkpoint folder, read in milliseconds whatever its size: every top-level file but
    hidden ones; a weight file (``WEIGHT_SUFFIXES``) by name, size and mtime plus, for safetensors, the sha256 of its
    header (8-byte length + the JSON of every tensor's name, dtype, shape and offsets); any other file (config.json,
    tokenizer files, templates) by content. Subfolders are not read (the loaders do not read them either).

    The mtime is there because a header is the same for other values of the same shapes: a fine-tune saved over the
    folder moves the fingerprint, and so does a copy that does not keep times (a rerun, never a wrong reuse)."""
    folder = Path(folder)
    parts = {}
    for path in sorted(folder.iterdir()):
        if path.name.startswith(".") or not path.is_file():
            continue
        stat = path.stat()
        if path.suffix in WEIGHT_SUFFIXES or stat.st_size > SMALL_FILE:
            part = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
            if path.suffix == ".safetensors":
                part["header"] = _safetensors_header(path)
            parts[path.name] = part
        else:
            parts[path.name] = hashlib.sha256(path.read_bytes()).hexdigest()
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def _safetensors_header(path: Path) -> str:
    """sha256 of a safetensors file's first 8 + N bytes (N: the little-endian length in its first 8)."""
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        return hashlib.sha256(head + f.read(min(n, 100 << 20))).hexdigest()


def run_output(folder: str | Path) -> str | None:
    """``"<experiment>/<stage>/<hash>/<relative path>"`` when ``folder`` lies in the run folder of a finished stage
    (a built world, an import, a distill export), else None. Such a folder holds what its run key made, so its path
    is already an exact key (the run folder is never rewritten once complete)."""
    folder = Path(folder).expanduser().absolute()
    for parent in [folder, *folder.parents][: RUN_DEPTH + 1]:
        if not (parent / MANIFEST_NAME).is_file():
            continue
        m = manifest_or_none(parent)
        if m is None or m.status != "complete" or m.config_hash != parent.name:
            return None
        return "/".join([m.experiment, m.stage, m.config_hash, *folder.relative_to(parent).parts])
    return None


def hub_snapshot(repo_id: str, repo_type: str = "model") -> Path | None:
    """The local Hugging Face cache's snapshot folder of ``repo_id`` (its ``refs/main``), or None when it is not
    cached; never asks the network. The folder's name is the commit."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, repo_type=repo_type, local_files_only=True))
    except Exception:  # the hub client raises several types for "not cached"
        return None


def sha256_cache(run_root: str | Path) -> Path:
    """The one ``file_sha256`` cache of a run root: ``<run_root>/.sha256.json`` (a dot file: no experiment's folder,
    so a run root without a world gains none)."""
    return Path(run_root) / ".sha256.json"
