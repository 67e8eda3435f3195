"""Verifier features stored beside trajectory shards: what a DFlash drafter reads instead of running the verifier.

Beside shard i, ``features-0000i-of-0000n.safetensors`` holds the verifier's layer states at ``layers`` for every
position of every row of that shard (prompt then completion): one tensor ``row-<r>`` [tokens, len(layers) * hidden]
per row, in the order of the shard's rows, half precision by default. What a DFlash drafter reads instead of running
the verifier (method.features=stored; docs/dflash.md, Offline features). The file's own FeatureMeta sits in the
safetensors header, so it is judged without trusting anything outside it, like a shard.

    write_features(folder, rows, FeatureMeta(shard=0, num_shards=4, rows=len(rows), layers=(2, 10), hidden=576,
                   config_hash=gen_hash))
    features = StoredFeatures(folder)   # row(i): [tokens, len(layers) * hidden], in load_trajectories order

Tests: ``python -m pytest tests/alignment/test_dflash_offline.py -q``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from streakline.artifacts import atomic_file

from .trajectories import _REGENERATE, SCHEMA_VERSION, TrajectoryError, trajectory_meta

FEATURE_GLOB = "features-*.safetensors"
FEATURE_DTYPES = ("float16", "float32")  # float32 only for tests that compare with online training exactly


@dataclasses.dataclass(frozen=True)
class FeatureMeta:
    """What one feature file holds; stored in its safetensors header under ``streakline``."""

    shard: int
    num_shards: int
    rows: int
    layers: tuple[int, ...]  # verifier layer ids, the DFlash convention (0: the embeddings), in stored order
    hidden: int  # the verifier's hidden size; each row is [tokens, len(layers) * hidden]
    config_hash: str  # the shard's: features of other settings are not this run's
    schema_version: int = SCHEMA_VERSION

    def to_json(self) -> str:
        return json.dumps({**dataclasses.asdict(self), "layers": list(self.layers)}, sort_keys=True)


def feature_name(shard: int, num_shards: int) -> str:
    """``feature_name(3, 16) == "features-00003-of-00016.safetensors"``: the feature file beside shard 3 of 16."""
    return f"features-{shard:05d}-of-{num_shards:05d}.safetensors"


def write_features(folder: str | os.PathLike, rows: Sequence[np.ndarray], meta: FeatureMeta) -> Path:
    """Write one shard's features ``rows`` (each ``[tokens, len(meta.layers) * meta.hidden]``, float16 or float32,
    finite) as ``folder/feature_name(...)``, atomically like ``write_shard``. Refuses (TrajectoryError) before
    writing anything on a wrong count, shape, dtype or a NaN/inf. Returns the path."""
    from safetensors.numpy import save

    if len(rows) != meta.rows:
        raise TrajectoryError(f"got features of {len(rows)} rows but meta.rows={meta.rows}")
    width = len(meta.layers) * meta.hidden
    tensors = {}
    for r, arr in enumerate(rows):
        arr = np.asarray(arr)
        if arr.ndim != 2 or arr.shape[1] != width:
            raise TrajectoryError(f"features of row {r} have shape {arr.shape}, expected (tokens, {width})")
        if arr.dtype.name not in FEATURE_DTYPES:
            raise TrajectoryError(f"features of row {r} are {arr.dtype}; store one of {FEATURE_DTYPES}")
        if not np.isfinite(arr).all():  # fp16 overflow of a large residual stream would train on inf silently
            raise TrajectoryError(f"features of row {r} are not finite (float16 overflow?); store them in float32")
        tensors[f"row-{r:06d}"] = np.ascontiguousarray(arr)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / feature_name(meta.shard, meta.num_shards)
    blob = save(tensors, metadata={"streakline": meta.to_json()})
    with atomic_file(path, "wb") as f:
        f.write(blob)
    return path


def _feature_probe(path: Path) -> FeatureMeta:
    """The file's FeatureMeta, checked against its tensors' names and widths, or TrajectoryError (one line)."""
    from safetensors import safe_open

    if not path.is_file():
        raise TrajectoryError("missing")
    try:
        with safe_open(str(path), framework="numpy") as f:
            raw = (f.metadata() or {}).get("streakline")
            keys = set(f.keys())
            widths = {f.get_slice(k).get_shape()[1] for k in keys}
    except Exception as e:  # truncated (the header promises more bytes than there are), not safetensors
        raise TrajectoryError(f"corrupt: {' '.join(str(e).split())}") from e
    if raw is None:
        raise TrajectoryError("corrupt: no streakline metadata")
    try:
        obj = json.loads(raw)
        obj["layers"] = tuple(obj["layers"])
        meta = FeatureMeta(**obj)
    except Exception as e:
        raise TrajectoryError(f"corrupt: its streakline metadata is unreadable ({e})") from e
    if meta.schema_version != SCHEMA_VERSION:
        raise TrajectoryError(f"other schema version ({meta.schema_version} != {SCHEMA_VERSION})")
    if keys != {f"row-{r:06d}" for r in range(meta.rows)} or widths - {len(meta.layers) * meta.hidden}:
        raise TrajectoryError(f"corrupt: its tensors are not {meta.rows} rows of {len(meta.layers)} layers")
    return meta


def check_features(path: str | os.PathLike, expected: FeatureMeta) -> str | None:
    """None when ``path`` is a complete feature file matching ``expected`` (every field), else a one-line reason
    ("missing", "corrupt: ...", "other settings (...)"). Never raises for a bad file."""
    try:
        meta = _feature_probe(Path(path))
    except TrajectoryError as e:
        return str(e)
    if meta != expected:
        diff = [f"{k} {getattr(meta, k)} != {getattr(expected, k)}" for k in expected.__dataclass_fields__
                if getattr(meta, k) != getattr(expected, k)]  # fmt: skip
        return f"other settings ({', '.join(diff)})"
    return None


class StoredFeatures:
    """The verifier features stored beside a complete set of shards, row by row in ``load_trajectories`` order.

    ``StoredFeatures(folder)`` refuses (TrajectoryError, naming the fix) a folder without feature files, files that
    disagree on layers / hidden / config, a missing shard's file, and files of other settings than the shards';
    ``row(i)`` is the numpy array ``[tokens of row i, len(layers) * hidden]`` (memory-mapped, read on demand).
    """

    def __init__(self, folder: str | os.PathLike) -> None:
        folder = Path(folder)
        shards = trajectory_meta(folder)
        fix = "rerun stage=trajectories with data.feature_layers=<the drafter's target_layer_ids>"
        paths = sorted(folder.glob(FEATURE_GLOB))
        if not paths:
            raise TrajectoryError(f"the trajectories in {folder} hold no verifier features; {fix}")
        metas = []
        for p in paths:
            try:
                metas.append(_feature_probe(p))
            except TrajectoryError as e:
                raise TrajectoryError(f"feature file {p}: {e}; {_REGENERATE}") from None
        first = metas[0]
        for m, p in zip(metas, paths, strict=True):
            same = (m.num_shards, m.layers, m.hidden, m.config_hash) == (
                shards.num_shards, first.layers, first.hidden, shards.config_hash)  # fmt: skip
            if not same:
                raise TrajectoryError(f"feature file {p} is from other settings than the shards of {folder}; {fix}")
        by_shard = {m.shard: (p, m) for p, m in zip(paths, metas, strict=True)}
        missing = sorted(set(range(shards.num_shards)) - set(by_shard))
        if missing:
            raise TrajectoryError(f"incomplete: the features of shards {missing} are missing in {folder}; {fix}")
        self.layers, self.hidden = first.layers, first.hidden
        self._paths = [by_shard[i][0] for i in range(shards.num_shards)]
        counts = np.array([by_shard[i][1].rows for i in range(shards.num_shards)], np.int64)
        self._starts = np.cumsum(counts) - counts
        self.rows = int(counts.sum())
        self._open: dict[int, Any] = {}

    def row(self, i: int) -> np.ndarray:
        from safetensors import safe_open

        if not 0 <= i < self.rows:
            raise IndexError(f"row {i} of {self.rows}")
        shard = int(np.searchsorted(self._starts, i, side="right")) - 1
        if shard not in self._open:  # one handle per file, kept: the header is parsed once
            self._open[shard] = safe_open(str(self._paths[shard]), framework="numpy")
        return self._open[shard].get_tensor(f"row-{i - int(self._starts[shard]):06d}")


class FeatureRows:
    """The stored features of some rows of a set (``trainer.train_tokens``' subset): row ``j`` here is row
    ``rows[j]`` of ``features``, as the selected trajectories' row j is."""

    def __init__(self, features: StoredFeatures, rows: Sequence[int]) -> None:
        self.layers, self.hidden = features.layers, features.hidden
        self._base, self._rows = features, [int(r) for r in rows]
        self.rows = len(self._rows)

    def row(self, i: int) -> np.ndarray:
        if not 0 <= i < self.rows:
            raise IndexError(f"row {i} of {self.rows}")
        return self._base.row(self._rows[i])


def feature_bytes(tokens: int, layers: int, hidden: int, itemsize: int = 2) -> int:
    """Bytes of stored features: ``tokens x layers x hidden x itemsize`` (2 for float16); the safetensors header
    (about 100 B per row) is left out."""
    return int(tokens) * int(layers) * int(hidden) * int(itemsize)
