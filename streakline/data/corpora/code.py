"""The code domain of the tiny world: the running interpreter's own standard-library sources.

Every machine that runs streakline has these files, so the tiny world's code corpus needs no download. Files are
listed in sorted relative-path order and split into ``train`` and ``heldout`` by a hash of the relative path alone,
so a file lands in the same split on every run and on every machine with the same standard library.

    for rec in code_texts("train"):          # {"path": "json/decoder.py", "text": "..."}
        ...
    ds = code_dataset("heldout")             # a datasets.IterableDataset streaming the same records
    key = corpus_fingerprint()               # "py3.11.7-<12 hex>": key caches on it

What is left out, and why: ``site-packages`` (not the standard library, differs per machine), ``test``/``tests``
(huge, repetitive and full of deliberately odd code), ``idlelib``, ``lib2to3``, ``turtledemo``, ``ensurepip``
(tooling and demos rather than library code) and files over 200 kB (generated tables).
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
import sys
import sysconfig
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SPLITS = ("train", "heldout")
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo",
                           "ensurepip", "__pycache__"})  # fmt: skip
MAX_FILE_BYTES = 200_000
HELDOUT_PERCENT = 10
# Changing the salt reshuffles the split; it is part of the fingerprint so caches notice.
_SPLIT_SALT = "streakline-code-split-v1"


@dataclass(frozen=True)
class SourceFile:
    path: str  # relative to the stdlib root, '/'-separated on every OS
    size: int  # bytes on disk
    split: str


def stdlib_root() -> Path:
    """The folder holding the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(rel_path: str) -> str:
    """``"heldout"`` for about HELDOUT_PERCENT percent of relative paths, ``"train"`` for the rest; stable forever."""
    digest = hashlib.sha256(f"{_SPLIT_SALT}:{rel_path}".encode()).digest()
    return "heldout" if int.from_bytes(digest[:8], "big") % 100 < HELDOUT_PERCENT else "train"


@functools.lru_cache(maxsize=4)
def list_files(root: str | None = None) -> tuple[SourceFile, ...]:
    """Every corpus file under ``root`` (default: the stdlib) in sorted relative-path order, with its split."""
    base = Path(root) if root is not None else stdlib_root()
    found: list[SourceFile] = []
    for dirpath, dirnames, filenames in os.walk(base):
        # Pruning in place stops os.walk from descending; sorting keeps nothing order-dependent.
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS and not d.startswith("."))
        for name in filenames:
            if not name.endswith(".py"):
                continue
            full = Path(dirpath) / name
            size = full.stat().st_size
            if size > MAX_FILE_BYTES:
                continue
            rel = full.relative_to(base).as_posix()
            found.append(SourceFile(rel, size, split_of(rel)))
    found.sort(key=lambda f: f.path)
    return tuple(found)


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")


def read_source(path: Path) -> str:
    """A source file's text, decoded as Python itself would (PEP 263 cookie) with newlines normalised to '\\n'."""
    raw = path.read_bytes()
    encoding, _ = tokenize.detect_encoding(io.BytesIO(raw).readline)
    text = raw.decode(encoding)
    if text.startswith("\ufeff"):
        text = text[1:]
    return text.replace("\r\n", "\n").replace("\r", "\n")


def code_texts(split: str, root: str | None = None) -> Iterator[dict[str, str]]:
    """Yield ``{"path", "text"}`` for every file of ``split`` ("train" or "heldout"), in sorted path order."""
    _check_split(split)
    base = Path(root) if root is not None else stdlib_root()
    for f in list_files(None if root is None else str(root)):
        if f.split != split:
            continue
        try:
            text = read_source(base / f.path)
        except (SyntaxError, UnicodeDecodeError):
            continue  # an undecodable file would fail on every machine alike, so skipping keeps runs identical
        yield {"path": f.path, "text": text}


def code_dataset(split: str, root: str | None = None):
    """``datasets.IterableDataset`` streaming the records of ``code_texts(split)``."""
    _check_split(split)
    import datasets  # heavy import, only paid by callers that want a dataset

    return datasets.IterableDataset.from_generator(_generate, gen_kwargs={"split": split, "root": root})


def _generate(split: str, root: str | None) -> Iterator[dict[str, str]]:
    # A module-level function (not a lambda) so datasets can fingerprint and pickle it.
    yield from code_texts(split, root)


def corpus_fingerprint(root: str | None = None) -> str:
    """``"py<version>-<12 hex>"``; changes with the Python version, the file list, any file size or the split rule."""
    h = hashlib.sha256(f"{_SPLIT_SALT}|{HELDOUT_PERCENT}|{MAX_FILE_BYTES}|{sorted(EXCLUDED_DIRS)}".encode())
    for f in list_files(None if root is None else str(root)):
        h.update(f"{f.path}\0{f.size}\n".encode())
    v = sys.version_info
    return f"py{v.major}.{v.minor}.{v.micro}-{h.hexdigest()[:12]}"
