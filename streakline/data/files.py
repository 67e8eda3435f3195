"""Local data files as the prompt-set loaders read them (``benchmarks.py`` for benchmarks, ``conversations.py``
for conversation sets): .jsonl, .json and .parquet, a JSON file possibly gzipped, with every unreadable file refused
by name and the fix; malformed JSON Lines refused with their line numbers, or, inside ``bad_lines(True)``
(``data.skip_bad_lines=true``), left out and counted for the manifest. ``hub_offline`` forces datasets and
huggingface_hub offline around a read of the local Hugging Face cache.

    rows = read_records("/data/he.jsonl.gz")                       # [{...}, ...]
    rows, lines = read_numbered(path, kind="conversation", error=ConversationError)
    with bad_lines(True) as tally: rows = read_records(path)       # tally.skipped: lines left out

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/data/test_files.py tests/data/test_benchmarks.py
"""

from __future__ import annotations

import contextlib
import contextvars
import gzip
import json
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from streakline.errors import UserError

FILE_SUFFIXES = (".jsonl", ".json", ".parquet")  # a .jsonl or .json file may also be gzipped: name.jsonl.gz


class DataFileError(UserError, ValueError):
    """A local data file that cannot be read as records; the loaders raise their own subclass of it."""


def read_records(
    path: str | Path, *, kind: str = "benchmark", error: type[DataFileError] = DataFileError
) -> list[dict[str, Any]]:
    """The rows of a local .jsonl, .json (a list of objects, ``{"data": [...]}``, or JSON Lines) or .parquet file;
    a .jsonl or .json file may be gzipped (``he.jsonl.gz``), as packages ship them.

    Shared by the benchmark and conversation loaders: ``kind`` names the file in messages and ``error`` is the
    ``DataFileError`` subclass raised for an unreadable file (missing, other suffix, not UTF-8, bad JSON, not objects).
    Inside ``bad_lines(True)`` a line that is not UTF-8 or not JSON is left out and counted instead.
    """
    return read_numbered(path, kind=kind, error=error)[0]


def read_numbered(
    path: str | Path, *, kind: str = "benchmark", error: type[DataFileError] = DataFileError
) -> tuple[list[dict[str, Any]], list[int | None]]:
    """``read_records``' rows and, per row, the 1-based line of the file it came from (JSON Lines; None for a JSON
    list or parquet), so that a message about a row names the line a user opens."""
    path = Path(path)
    if not path.is_file():
        raise error(f"no {kind} file at {path}; check the path (a relative one is taken from the current folder)")
    gzipped = path.suffix.lower() == ".gz"
    suffix = Path(path.stem).suffix.lower() if gzipped else path.suffix.lower()
    if suffix == ".parquet" and not gzipped:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
            return rows, [None] * len(rows)
        except (pa.ArrowException, OSError) as e:
            raise error(f"{path} is not a readable parquet file ({e}); copy or export it again") from e
    if suffix not in (".jsonl", ".json"):
        raise error(f"cannot read {path}: expected one of {', '.join(FILE_SUFFIXES)}, or .jsonl.gz / .json.gz")
    raw = path.read_bytes()
    if gzipped:
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:  # not gzip, truncated, or a damaged stream
            raise error(f"{path} is not a readable gzip file ({e}); copy it again or unpack it to {suffix}") from e
    if raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark (Windows editors write one) is not content
        raw = raw[3:]
    not_utf8: list[tuple[int, str]] = []
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        tally = current_tally()
        line = raw.count(b"\n", 0, e.start) + 1
        if tally is None or not tally.skip:
            cat = f"zcat {path} | iconv -f latin1 -t utf-8" if gzipped else f"iconv -f latin1 -t utf-8 {path}"
            raise error(
                f"{path}:{line} is not UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start}); re-encode the file as "
                f"UTF-8, e.g. {cat} > fixed{suffix}, or set data.skip_bad_lines=true to leave such lines out"
            ) from e
        # data.skip_bad_lines=true: such a line is one more bad line, left out and counted like malformed JSON
        kept = []
        for n, chunk in enumerate(raw.split(b"\n"), 1):
            try:
                kept.append(chunk.decode("utf-8"))
            except UnicodeDecodeError:
                not_utf8.append((n, "not UTF-8"))
                kept.append("")
        text = "\n".join(kept)
    if suffix == ".json" and not not_utf8:
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            data = None  # datasets' to_json writes JSON Lines even under a .json name; try that below
        if isinstance(data, dict) and isinstance(data.get("data"), list):
            data = data["data"]
        if isinstance(data, list):
            return _only_objects(data, path, error), [None] * len(data)
        if data is not None:
            raise error(f"{path} holds a JSON {type(data).__name__}; expected a list of objects")
    rows, lines, bad = [], [], list(not_utf8)
    for lineno, line in enumerate(text.split("\n"), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
                lines.append(lineno)
            except json.JSONDecodeError as e:
                bad.append((lineno, e.msg))
    if bad:
        bad.sort()
        tally = current_tally()
        if tally is None or not tally.skip:
            raise error(_bad_lines_message(path, bad))
        tally.skipped += len(bad)
        print(f"{kind} file {path}: left out {len(bad)} bad line(s) (data.skip_bad_lines=true)")
    return _only_objects(rows, path, error, lines), lines


SHOWN_BAD_LINES = 20  # a message names this many malformed lines, then counts the rest


def _bad_lines_message(path: Path, bad: list[tuple[int, str]]) -> str:
    (first, why), rest = bad[0], [n for n, _ in bad[1:SHOWN_BAD_LINES]]
    message = f"{path}:{first} is not valid JSON ({why})"
    if rest:
        more = len(bad) - SHOWN_BAD_LINES
        message += f"; nor are lines {', '.join(map(str, rest))}" + (f" and {more} more" if more > 0 else "")
        message += f" ({len(bad)} malformed lines)"
    them = "them" if rest else "it"
    return message + f"; fix {them}, or set data.skip_bad_lines=true to leave such lines out (the manifest counts them)"


@dataclass
class BadLineTally:
    """What ``read_records`` does with malformed JSON Lines inside ``bad_lines``: ``skip`` them (counted in
    ``skipped``) or refuse the file, naming them."""

    skip: bool
    skipped: int = 0


_BAD_LINES: contextvars.ContextVar[BadLineTally | None] = contextvars.ContextVar("bad_lines", default=None)


def current_tally() -> BadLineTally | None:
    """The ``bad_lines`` in force (None outside one: malformed lines are refused)."""
    return _BAD_LINES.get()


@contextlib.contextmanager
def bad_lines(skip: bool):
    """``with bad_lines(cfg.data.skip_bad_lines) as tally: load_source(...)``: inside, every file read leaves out
    its malformed lines when ``skip`` (``tally.skipped`` counts them, for the manifest), else refuses them."""
    outer = _BAD_LINES.get()
    if outer is not None and outer.skip == skip:  # a caller further out counts for the whole read
        yield outer
        return
    tally = BadLineTally(skip)
    token = _BAD_LINES.set(tally)
    try:
        yield tally
    finally:
        _BAD_LINES.reset(token)


def _only_objects(
    rows: list[Any], path: Path, error: type[DataFileError] = DataFileError, lines: list[int] | None = None
) -> list[dict[str, Any]]:
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            where = f"{path}:{lines[i]}" if lines else f"{path}: record {i + 1}"
            raise error(f"{where} is not an object with named fields (it is {json.dumps(row)[:40]})")
    return rows


@contextlib.contextmanager
def hub_offline() -> Iterator[None]:
    """Force datasets and huggingface_hub offline for the duration, whatever the environment says."""
    import datasets.config
    import huggingface_hub.constants

    saved = datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE = saved
