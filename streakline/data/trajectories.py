"""Trajectory shards: the parquet files in which stage ``trajectories`` stores verifier completions for ``distill``.

One shard is one parquet file, ``shard-00003-of-00016.parquet``, written whole by one call of ``write_shard``. Shards
are independent, so different processes (Ray workers, Slurm jobs on a shared filesystem) may write them in any order,
and a rerun asks ``check_shard`` which ones are already complete for its settings and regenerates only the rest.
Each file carries its own ``ShardMeta`` (under the parquet schema-metadata key ``b"streakline"``) next to the
``b"huggingface"`` features that ``datasets`` reads back, so a reader can refuse shards that came from another
tokenizer, verifier or generation config without trusting anything outside the file.

Writer side (one call per shard, any process)::

    meta = ShardMeta(shard=i, num_shards=n, rows=len(rows), tokenizer_hash=tok_hash, verifier="qwen2.5-72b",
                     topk=8, config_hash=gen_hash)
    if check_shard(folder / shard_name(i, n), meta) is not None:  # None: already done, skip it
        write_shard(folder, rows, meta)  # validates every row first, then temp file + fsync + os.replace

Reader side::

    ds = load_trajectories(folder, tokenizer_hash=drafter_tok_hash)  # datasets.Dataset, rows in shard order
    meta = trajectory_meta(folder)                                  # the settings every shard shares

Before generating, ``format_bytes(estimate(rows, mean_prompt, max_new, topk)["bytes"])`` gives an upper bound of the
disk space. Beside a shard, an optional ``features-*.safetensors`` file holds the verifier's layer states of
its rows, what a DFlash drafter trains on offline (``data/features.py``).
Tests: ``pytest tests/data/test_trajectories.py tests/alignment/test_dflash_offline.py``.
Ground level: imports no other streakline layer and no torch; ``datasets`` and ``pyarrow`` do the storage.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Iterable, Sequence
from numbers import Integral
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow.parquet as pq

from streakline.artifacts import atomic_file
from streakline.errors import UserError

SCHEMA_VERSION = 1
META_KEY = b"streakline"
FINISH_REASONS = ("eos", "length", "stop")
BASE_KEYS = ("prompt_id", "sample_index", "seed", "finish_reason", "prompt_ids", "completion_ids")
TOPK_KEYS = ("topk_ids", "topk_logprobs")
SHARD_GLOB = "shard-*.parquet"

# Sizes that ``estimate`` adds on top of the payload (4 B per id, 2 B per float16 logprob); see its docstring.
ROW_OVERHEAD = 64  # bytes per row
TOPK_TOKEN_OVERHEAD = 8  # bytes per completion token when topk > 0
FILE_OVERHEAD = 16 * 1024  # bytes per shard file: the footer (schema, both metadata blobs, statistics) is ~4 kB

_INT32_MAX = 2**31 - 1
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_HEX12 = re.compile(r"[0-9a-f]{12}")
_REGENERATE = "delete it and rerun stage=trajectories to regenerate it"


class TrajectoryError(UserError, ValueError):
    """A trajectory shard or its rows are unusable; the message says what to do about it."""


class TokenizerMismatchError(TrajectoryError):
    """Good trajectories in another tokenizer than the drafter's: making them again cannot help (the verifier's
    tokenizer makes them), so the fix is a pair of models that share one."""


@dataclasses.dataclass(frozen=True)
class ShardMeta:
    """What one shard holds and how it was made; stored inside the shard's parquet file."""

    shard: int  # 0-based index
    num_shards: int
    rows: int
    tokenizer_hash: str  # 12 hex, streakline.models.tokenizer.tokenizer_hash of the verifier's tokenizer
    verifier: str  # human-readable identity of the verifier: checkpoint folder or hub id
    topk: int  # top-k logprobs stored per completion token (0 = none)
    config_hash: str  # hash of the generation settings; shards from other settings are not "complete" for a run
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        for name in ("shard", "num_shards", "rows", "topk", "schema_version"):
            value = getattr(self, name)
            # bool is an int subclass; True as a shard count is always a caller's slip.
            if not isinstance(value, int) or isinstance(value, bool):
                raise TrajectoryError(f"ShardMeta.{name} must be an int, got {type(value).__name__} {value!r}")
        if self.num_shards < 1 or not 0 <= self.shard < self.num_shards:
            raise TrajectoryError(
                f"ShardMeta has shard={self.shard}, num_shards={self.num_shards}; "
                "use num_shards >= 1 and 0 <= shard < num_shards"
            )
        if self.rows < 0 or self.topk < 0:
            raise TrajectoryError(f"ShardMeta.rows ({self.rows}) and .topk ({self.topk}) must be >= 0")
        if not isinstance(self.tokenizer_hash, str) or not _HEX12.fullmatch(self.tokenizer_hash):
            raise TrajectoryError(
                f"ShardMeta.tokenizer_hash must be 12 lowercase hex characters, got {self.tokenizer_hash!r}; "
                "pass streakline.models.tokenizer.tokenizer_hash(verifier_tokenizer)"
            )
        for name in ("verifier", "config_hash"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise TrajectoryError(f"ShardMeta.{name} must be a non-empty string, got {value!r}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


def shard_name(shard: int, num_shards: int) -> str:
    """``shard_name(3, 16) == "shard-00003-of-00016.parquet"``: the file name of 0-based shard 3 of 16."""
    return f"shard-{shard:05d}-of-{num_shards:05d}.parquet"


def _columns(topk: int) -> tuple[str, ...]:
    return BASE_KEYS + (TOPK_KEYS if topk > 0 else ())


def features(topk: int) -> datasets.Features:
    """The ``datasets`` features of a shard: ids int32, sample_index int32, seed int64, topk_logprobs float16."""
    i32 = datasets.Value("int32")
    feats = {
        "prompt_id": datasets.Value("string"),
        "sample_index": i32,
        "seed": datasets.Value("int64"),
        "finish_reason": datasets.Value("string"),
        "prompt_ids": datasets.List(i32),
        "completion_ids": datasets.List(i32),
    }
    if topk > 0:
        feats["topk_ids"] = datasets.List(datasets.List(i32))
        feats["topk_logprobs"] = datasets.List(datasets.List(datasets.Value("float16")))
    return datasets.Features(feats)


# ---------------------------------------------------------------- writing


def _int(i: int, key: str, value: Any, lo: int, hi: int) -> int:
    if not isinstance(value, Integral) or isinstance(value, bool) or not lo <= int(value) <= hi:
        raise TrajectoryError(f"row {i}: {key} must be an int in [{lo}, {hi}], got {value!r}")
    return int(value)


def _array(i: int, key: str, value: Any, shape: tuple[int, ...], kinds: str) -> np.ndarray:
    """``value`` as a numpy array of ``shape`` (-1: any length) whose dtype kind is in ``kinds``."""
    if isinstance(value, (str, bytes)):  # np.asarray would make a 0-d string array; name the real problem instead
        raise TrajectoryError(f"row {i}: {key} must be a list of numbers, got a string")
    try:
        arr = np.asarray(value)
    except ValueError as e:  # ragged nested lists
        raise TrajectoryError(f"row {i}: {key} is ragged ({e}); give every completion token the same topk") from e
    if arr.shape == (0,) and shape[0] in (0, -1):
        # [] comes back as float64 of shape (0,), whatever it stands for; give it the expected empty shape.
        arr = np.zeros((0, *shape[1:]), dtype=np.int64)
    if arr.size and arr.dtype.kind not in kinds:
        raise TrajectoryError(f"row {i}: {key} must hold numbers of kind {kinds!r}, got dtype {arr.dtype}")
    if arr.ndim != len(shape) or any(n not in (-1, got) for n, got in zip(shape, arr.shape, strict=True)):
        want = "x".join("any" if n == -1 else str(n) for n in shape)
        raise TrajectoryError(
            f"row {i}: {key} has shape {arr.shape}, expected ({want})"
            + (" (one list of meta.topk entries per completion token)" if key in TOPK_KEYS else "")
        )
    return arr


def _ids(i: int, key: str, value: Any, shape: tuple[int, ...]) -> np.ndarray:
    arr = _array(i, key, value, shape, "iu")
    if arr.size and (arr.min() < 0 or arr.max() > _INT32_MAX):
        raise TrajectoryError(f"row {i}: {key} has ids outside [0, {_INT32_MAX}]; token ids are stored as int32")
    return arr.astype(np.int32, copy=False)


def _check_row(i: int, row: Any, meta: ShardMeta) -> dict[str, Any]:
    """The row with ids as int32 arrays and logprobs as float16, or TrajectoryError saying what is wrong."""
    if not isinstance(row, dict):
        raise TrajectoryError(f"row {i} must be a dict, got {type(row).__name__}")
    expected = set(_columns(meta.topk))
    if set(row) != expected:
        missing, extra = sorted(expected - set(row)), sorted(set(row) - expected)
        hint = ""
        if set(TOPK_KEYS) & (set(missing) | set(extra)):
            hint = f"; meta.topk={meta.topk}: topk_ids/topk_logprobs are required when topk > 0 and absent when 0"
        raise TrajectoryError(f"row {i}: missing keys {missing}, unexpected keys {extra}{hint}")
    if not isinstance(row["prompt_id"], str) or not row["prompt_id"]:
        raise TrajectoryError(f"row {i}: prompt_id must be a non-empty string, got {row['prompt_id']!r}")
    if row["finish_reason"] not in FINISH_REASONS:
        raise TrajectoryError(f"row {i}: finish_reason must be one of {FINISH_REASONS}, got {row['finish_reason']!r}")
    out = {
        "prompt_id": row["prompt_id"],
        "finish_reason": row["finish_reason"],
        "sample_index": _int(i, "sample_index", row["sample_index"], 0, _INT32_MAX),
        "seed": _int(i, "seed", row["seed"], _INT64_MIN, _INT64_MAX),
        "prompt_ids": _ids(i, "prompt_ids", row["prompt_ids"], (-1,)),
        "completion_ids": _ids(i, "completion_ids", row["completion_ids"], (-1,)),
    }
    if meta.topk > 0:
        shape = (len(out["completion_ids"]), meta.topk)
        out["topk_ids"] = _ids(i, "topk_ids", row["topk_ids"], shape)
        lp = _array(i, "topk_logprobs", row["topk_logprobs"], shape, "fiu").astype(np.float64, copy=False)
        # NaN would poison a distillation loss silently; clearly positive values mean logits were stored by mistake
        # (log_softmax may round to a hair above 0, hence the tolerance).
        if np.isnan(lp).any() or (lp > 1e-3).any():
            raise TrajectoryError(f"row {i}: topk_logprobs must be log-probabilities (<= 0, no NaN); store log_softmax")
        out["topk_logprobs"] = lp.astype(np.float16)
    return out


def write_shard(folder: str | os.PathLike, rows: list[dict], meta: ShardMeta) -> Path:
    """Validate ``rows`` against ``meta`` and write them as ``folder/shard_name(meta.shard, meta.num_shards)``.

    Each row: ``prompt_id`` str, ``sample_index`` int, ``seed`` int, ``finish_reason`` in ``FINISH_REASONS``,
    ``prompt_ids`` [P] ints, ``completion_ids`` [C] ints and, exactly when ``meta.topk > 0``, ``topk_ids`` [C, topk]
    ints and ``topk_logprobs`` [C, topk] floats (lists or numpy arrays). Any problem raises TrajectoryError before a
    byte is written. The file appears atomically (temp file ``.shard-...tmp`` in ``folder``, fsync, ``os.replace``),
    so readers and concurrent writers of the same shard see an old whole file or a new whole file. Returns the path.
    """
    if not isinstance(meta, ShardMeta):
        raise TrajectoryError(f"meta must be a ShardMeta, got {type(meta).__name__}")
    if len(rows) != meta.rows:
        raise TrajectoryError(f"got {len(rows)} rows but meta.rows={meta.rows}; set ShardMeta.rows=len(rows)")
    checked = [_check_row(i, row, meta) for i, row in enumerate(rows)]
    columns = {key: [row[key] for row in checked] for key in _columns(meta.topk)}
    try:
        table = datasets.Dataset.from_dict(columns, features=features(meta.topk)).data.table
    except Exception as e:  # what validation let through is a bug here, but the caller still deserves a clean error
        raise TrajectoryError(f"could not build shard {meta.shard} as Arrow: {e}") from e
    # Keep datasets' own b"huggingface" entry: it is how from_parquet gets int32/float16 features back.
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), META_KEY: meta.to_json().encode()})

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / shard_name(meta.shard, meta.num_shards)
    with atomic_file(path, "wb") as f:  # a dot-named temp file: SHARD_GLOB never sees a half-written shard
        # zstd without dictionaries on the numeric columns: token ids and logprobs are near-unique, where
        # dictionary pages only add size; page checksums let check_shard notice bit rot on shared storage.
        pq.write_table(
            table, f, compression="zstd", use_dictionary=["prompt_id", "finish_reason"], write_page_checksum=True
        )
    return path


# ---------------------------------------------------------------- reading one shard


def _meta_from_json(raw: bytes) -> ShardMeta:
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise TrajectoryError(f"corrupt: its streakline metadata is not JSON ({e})") from e
    if not isinstance(obj, dict):
        raise TrajectoryError("corrupt: its streakline metadata is not a JSON object")
    version = obj.get("schema_version")
    if version != SCHEMA_VERSION:
        raise TrajectoryError(
            f"other schema version ({version} != {SCHEMA_VERSION}): written by another streakline version"
        )
    names = {f.name for f in dataclasses.fields(ShardMeta)}
    if set(obj) != names:
        raise TrajectoryError(f"corrupt: its streakline metadata has fields {sorted(obj)}, expected {sorted(names)}")
    try:
        return ShardMeta(**obj)
    except TrajectoryError as e:  # wrong types or values in a file that claims our schema
        raise TrajectoryError(f"corrupt: {e}") from None


def _probe(path: Path) -> ShardMeta:
    """The shard's meta from its footer, or TrajectoryError with a one-line reason (no path, no fix)."""
    if not path.is_file():
        raise TrajectoryError("missing")
    try:
        with pq.ParquetFile(path) as file:  # closed at once: many shards may be probed on a shared filesystem
            footer = file.metadata
            raw = (file.schema_arrow.metadata or {}).get(META_KEY)
    except Exception as e:  # not parquet, truncated (the footer lives at the end), unreadable
        raise TrajectoryError(f"corrupt: {' '.join(str(e).split())}") from e
    if raw is None:
        raise TrajectoryError("corrupt: no streakline metadata (not written by streakline.data.trajectories)")
    meta = _meta_from_json(raw)
    if footer.num_rows != meta.rows:
        raise TrajectoryError(f"corrupt: the file has {footer.num_rows} rows, its metadata says {meta.rows}")
    return meta


def read_meta(path: str | os.PathLike) -> ShardMeta:
    """The ShardMeta stored in shard ``path`` (reads only the footer).

    Raises TrajectoryError naming the file when it is missing, not parquet, truncated, lacks streakline metadata, or
    has another schema version.
    """
    path = Path(path)
    try:
        return _probe(path)
    except TrajectoryError as e:
        fix = "run stage=trajectories to make it" if str(e) == "missing" else _REGENERATE
        raise TrajectoryError(f"trajectory shard {path}: {e}; {fix}") from None


def _difference(got: ShardMeta, want: ShardMeta) -> str | None:
    if got.schema_version != want.schema_version:
        return f"other schema version ({got.schema_version} != {want.schema_version})"
    if got.tokenizer_hash != want.tokenizer_hash:
        return f"from another tokenizer ({got.tokenizer_hash} != {want.tokenizer_hash})"
    if (got.shard, got.num_shards) != (want.shard, want.num_shards):
        return f"holds shard {got.shard} of {got.num_shards}, expected {want.shard} of {want.num_shards}"
    if got.config_hash != want.config_hash:
        return f"other settings (config {got.config_hash} != {want.config_hash})"
    if got.topk != want.topk:
        return f"other settings (topk {got.topk} != {want.topk})"
    if got.rows != want.rows:
        return f"other settings (rows {got.rows} != {want.rows})"
    return None


def check_shard(path: str | os.PathLike, expected: ShardMeta) -> str | None:
    """None when ``path`` is a complete, readable shard matching ``expected``, else a one-line reason.

    Reasons start with "missing", "corrupt: ...", "from another tokenizer (...)", "other settings (...)",
    "other schema version (...)" or "holds shard ...". Matching compares shard, num_shards, rows, tokenizer_hash,
    topk, config_hash and schema_version, not ``verifier`` (a path may differ between machines; put the verifier's
    identity into config_hash). Reads every page, verifying checksums. Never raises for a bad file.
    """
    path = Path(path)
    try:
        meta = _probe(path)
    except TrajectoryError as e:
        return str(e)
    except Exception as e:  # a file can be bad in ways nobody listed; the caller only needs "regenerate it"
        return f"corrupt: {type(e).__name__}: {' '.join(str(e).split())}"
    reason = _difference(meta, expected)
    if reason is not None:
        return reason
    return _verify(path, meta)


def _verify(path: Path, meta: ShardMeta) -> str | None:
    """Read every page of ``path`` (checksums verified, one batch at a time); None or a "corrupt: ..." reason."""
    try:
        with pq.ParquetFile(path, page_checksum_verification=True) as file:
            if tuple(file.schema_arrow.names) != _columns(meta.topk):
                return f"corrupt: columns {file.schema_arrow.names}, expected {list(_columns(meta.topk))}"
            # Streaming keeps memory at one batch: a full shard with top-k logprobs can be gigabytes.
            rows = sum(batch.num_rows for batch in file.iter_batches(batch_size=4096))
    except Exception as e:  # zstd or checksum errors, short reads: all mean "regenerate this shard"
        return f"corrupt: {' '.join(str(e).split())}"
    if rows != meta.rows:
        return f"corrupt: read {rows} rows, its metadata says {meta.rows}"
    return None


# ---------------------------------------------------------------- reading a set of shards


def _shard_paths(source: str | os.PathLike | Iterable[str | os.PathLike]) -> tuple[list[Path], str]:
    if isinstance(source, (str, os.PathLike)):
        where = Path(source)
        if where.is_dir():
            return sorted(where.glob(SHARD_GLOB)), str(where)
        return ([where] if where.exists() else []), str(where)
    paths = [Path(p) for p in source]
    return paths, ", ".join(map(str, paths)) or "an empty list"


def _validated(source: Any, tokenizer_hash: str | None) -> tuple[list[Path], list[ShardMeta], ShardMeta]:
    """Shard paths and metas in shard order and their common meta (rows = total), or TrajectoryError."""
    paths, where = _shard_paths(source)
    if not paths:
        raise TrajectoryError(f"no trajectory shards in {where}; run stage=trajectories first")
    metas = [read_meta(p) for p in paths]
    first = metas[0]
    for field in ("num_shards", "tokenizer_hash", "verifier", "topk", "config_hash"):
        values = {getattr(m, field) for m in metas}
        if len(values) > 1:
            groups = "; ".join(
                f"{v!r}: {', '.join(p.name for p, m in zip(paths, metas, strict=True) if getattr(m, field) == v)}"
                for v in sorted(values, key=str)
            )
            raise TrajectoryError(
                f"the trajectory shards in {where} disagree on {field} ({groups}); they come from different runs: "
                "move the stale shards out, or rerun stage=trajectories into an empty folder"
            )
    by_index: dict[int, tuple[Path, ShardMeta]] = {}
    for p, m in zip(paths, metas, strict=True):
        if m.shard in by_index:
            raise TrajectoryError(
                f"{by_index[m.shard][0]} and {p} both hold shard {m.shard} of {m.num_shards}; keep one of them"
            )
        by_index[m.shard] = (p, m)
    missing = sorted(set(range(first.num_shards)) - set(by_index))
    if missing:
        raise TrajectoryError(
            f"incomplete: shards {missing} of {first.num_shards} are missing in {where}; "
            "rerun stage=trajectories to finish them"
        )
    if tokenizer_hash is not None and tokenizer_hash != first.tokenizer_hash:
        raise TokenizerMismatchError(
            f"these trajectories were made by verifier {first.verifier} with tokenizer {first.tokenizer_hash}; "
            f"the drafter's tokenizer is {tokenizer_hash}. Sampling them again would not help (the verifier's "
            "tokenizer makes them): train a drafter that shares the verifier's tokenizer (model.drafter=..., or "
            "model.drafter.tokenizer=<the verifier's tokenizer folder>)"
        )
    ordered = [by_index[i] for i in range(first.num_shards)]
    common = dataclasses.replace(first, shard=0, rows=sum(m.rows for m in metas))
    return [p for p, _ in ordered], [m for _, m in ordered], common


def trajectory_meta(
    source: str | os.PathLike | Sequence[str | os.PathLike], *, tokenizer_hash: str | None = None
) -> ShardMeta:
    """The meta every shard of ``source`` shares, validated exactly as ``load_trajectories`` does (footers only).

    ``shard`` is 0 and ``rows`` is the total over all shards; the other fields are common to every shard.
    """
    return _validated(source, tokenizer_hash)[2]


def load_trajectories(
    source: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    tokenizer_hash: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    verify: bool = True,
) -> datasets.Dataset:
    """All rows of a complete set of shards, in shard order, as a ``datasets.Dataset`` with ``features(topk)``.

    ``source``: a folder (every ``shard-*.parquet`` in it) or a list of shard paths. Refuses (TrajectoryError) no
    shards, shards that disagree on num_shards/tokenizer/verifier/topk/config_hash, missing or duplicate shard
    indices, unreadable files, and a ``tokenizer_hash`` (the drafter's) other than the shards'. Columns come back as
    lists: ids int32, ``topk_logprobs`` float16 values. ``verify`` reads every page with its checksum first, because
    ``datasets`` itself would load a damaged page as silently wrong numbers; pass False only for shards just checked.
    ``datasets`` converts the shards once into its Arrow cache (``cache_dir``, default
    ``~/.cache/huggingface/datasets``, keyed on paths and mtimes) and memory-maps them.
    """
    paths, metas, meta = _validated(source, tokenizer_hash)
    if verify:
        for path, shard_meta in zip(paths, metas, strict=True):
            reason = _verify(path, shard_meta)
            if reason is not None:
                raise TrajectoryError(f"trajectory shard {path}: {reason}; {_REGENERATE}")
    # the one-off conversion bar ("Generating train split") says nothing a caller can act on
    bars = datasets.utils.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        return datasets.Dataset.from_parquet(
            [str(p) for p in paths],
            features=features(meta.topk),
            cache_dir=None if cache_dir is None else str(cache_dir),
        )
    except Exception as e:  # e.g. a shard replaced or damaged since it was verified
        raise TrajectoryError(
            f"could not read the trajectory shards of {paths[0].parent} ({type(e).__name__}: {e}); "
            "check_shard() on each names the bad one; delete it and rerun stage=trajectories"
        ) from e
    finally:
        if bars:
            datasets.enable_progress_bars()


# ---------------------------------------------------------------- sizing


def estimate(rows: int, mean_prompt_tokens: float, max_new_tokens: int, topk: int, *, num_shards: int = 1) -> dict:
    """Upper bound of what ``rows`` trajectories take, printed before generating: ``{"rows", "tokens", "bytes"}``.

    ``tokens`` = rows * (mean_prompt_tokens + max_new_tokens), every completion at full length. ``bytes`` counts
    4 B per id (prompt, completion, topk ids) and 2 B per float16 logprob, plus ROW_OVERHEAD (64 B per row: the
    prompt_id and finish_reason strings, sample_index, seed, list offsets), TOPK_TOKEN_OVERHEAD (8 B per completion
    token when topk > 0: the offsets of its two inner lists) and FILE_OVERHEAD (16 KiB per shard: parquet footer and
    metadata). That is the Arrow size ``load_trajectories`` caches; zstd parquet shards come out smaller.
    """
    for name, value in (("rows", rows), ("mean_prompt_tokens", mean_prompt_tokens),
                        ("max_new_tokens", max_new_tokens), ("topk", topk), ("num_shards", num_shards)):  # fmt: skip
        if value < 0:
            raise TrajectoryError(f"estimate: {name} must be >= 0, got {value}")
    completion = rows * max_new_tokens
    ids = rows * mean_prompt_tokens + completion * (1 + topk)
    per_token = topk * 2 + (TOPK_TOKEN_OVERHEAD if topk > 0 else 0)
    size = 4 * ids + completion * per_token + rows * ROW_OVERHEAD + num_shards * FILE_OVERHEAD
    return {"rows": rows, "tokens": math.ceil(rows * mean_prompt_tokens + completion), "bytes": math.ceil(size)}


def format_bytes(n: float) -> str:
    """``12_300_000`` -> ``"12.3 MB"`` (decimal units); below 1000 bytes: ``"999 B"``."""
    if n < 1000:
        return f"{int(n)} B"
    value = float(n)
    for unit in ("kB", "MB", "GB", "TB", "PB"):
        value /= 1000
        if round(value, 1) < 1000 or unit == "PB":
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")
