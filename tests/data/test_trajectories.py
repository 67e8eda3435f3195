"""Tests for trajectory shards: round trip, resume checks, corrupt files, tokenizer mismatches, refused rows, sizing.

Run: ``pytest -q tests/data/test_trajectories.py`` (a few seconds on CPU; real files in ``tmp_path``, nothing mocked).
"""

from __future__ import annotations

import copy
import dataclasses
import os

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from streakline.data.trajectories import (
    ShardMeta,
    TrajectoryError,
    check_shard,
    estimate,
    format_bytes,
    load_trajectories,
    read_meta,
    shard_name,
    trajectory_meta,
    write_shard,
)

TOK_A = "aaaaaaaaaaaa"
TOK_B = "bbbbbbbbbbbb"


def make_rows(rng, n, topk, tag, *, prompt_len=None, completion_len=None, vocab=1000):
    """``n`` random rows; lengths vary (including empty completions) unless fixed."""
    rows = []
    for i in range(n):
        p = prompt_len if prompt_len is not None else int(rng.integers(1, 12))
        c = completion_len if completion_len is not None else int(rng.integers(0, 9))
        row = {
            "prompt_id": f"{tag}/{i}",
            "sample_index": i % 3,
            "seed": int(rng.integers(0, 2**40)),
            "finish_reason": ["eos", "length", "stop"][i % 3],
            "prompt_ids": rng.integers(0, vocab, p).tolist(),
            "completion_ids": rng.integers(0, vocab, c).tolist(),
        }
        if topk:
            row["topk_ids"] = rng.integers(0, vocab, (c, topk)).tolist()
            row["topk_logprobs"] = (-rng.exponential(3.0, (c, topk))).tolist()
        rows.append(row)
    return rows


def meta(shard=0, num_shards=1, rows=4, topk=0, tok=TOK_A, config="cfg1", verifier="ckpt/verifier"):
    return ShardMeta(shard, num_shards, rows, tok, verifier, topk, config)


def test_shard_name_and_meta_validation():
    assert shard_name(3, 16) == "shard-00003-of-00016.parquet"
    with pytest.raises(TrajectoryError, match="tokenizer_hash"):
        meta(tok="abc")
    with pytest.raises(TrajectoryError, match="0 <= shard < num_shards"):
        meta(shard=2, num_shards=2)


@pytest.mark.parametrize("topk", [0, 4])
def test_round_trip_resume_and_load(tmp_path, topk):
    rng = np.random.default_rng(topk)
    folder = tmp_path / "traj"
    sizes = [5, 3, 6]
    shards = [make_rows(rng, n, topk, f"s{i}") for i, n in enumerate(sizes)]
    metas = [meta(i, 3, n, topk) for i, n in enumerate(sizes)]

    for i in (0, 2):
        assert write_shard(folder, shards[i], metas[i]) == folder / shard_name(i, 3)
    assert check_shard(folder / shard_name(0, 3), metas[0]) is None
    assert check_shard(folder / shard_name(2, 3), metas[2]) is None
    assert check_shard(folder / shard_name(1, 3), metas[1]) == "missing"
    # A rerun with other generation settings must not take the finished shards for its own.
    assert check_shard(folder / shard_name(0, 3), dataclasses.replace(metas[0], config_hash="cfg2")).startswith(
        "other settings"
    )
    with pytest.raises(TrajectoryError, match=r"incomplete: shards \[1\] of 3 are missing"):
        load_trajectories(folder, cache_dir=tmp_path / "cache")

    write_shard(folder, shards[1], metas[1])
    ds = load_trajectories(folder, cache_dir=tmp_path / "cache")
    expected = [row for rows in shards for row in rows]  # shard order, then row order
    assert len(ds) == len(expected)
    for got, want in zip(ds, expected, strict=True):
        for key in ("prompt_id", "sample_index", "seed", "finish_reason", "prompt_ids", "completion_ids"):
            assert got[key] == want[key], key
        if topk:
            assert got["topk_ids"] == want["topk_ids"]
            want_lp = np.asarray(want["topk_logprobs"], dtype=np.float16).reshape(-1, topk)
            np.testing.assert_array_equal(np.asarray(got["topk_logprobs"]).reshape(-1, topk), want_lp)
        else:
            assert "topk_ids" not in got and "topk_logprobs" not in got

    schema = ds.data.table.schema
    assert schema.field("prompt_ids").type == pa.list_(pa.int32())
    assert schema.field("completion_ids").type == pa.list_(pa.int32())
    assert schema.field("sample_index").type == pa.int32() and schema.field("seed").type == pa.int64()
    if topk:
        assert schema.field("topk_ids").type == pa.list_(pa.list_(pa.int32()))
        assert schema.field("topk_logprobs").type == pa.list_(pa.list_(pa.float16()))
        assert ds.features["topk_logprobs"] == datasets.List(datasets.List(datasets.Value("float16")))

    common = trajectory_meta(folder)
    assert (common.shard, common.num_shards, common.rows, common.topk) == (0, 3, sum(sizes), topk)
    # A list of paths in any order loads in shard order too.
    paths = [folder / shard_name(i, 3) for i in (2, 0, 1)]
    assert load_trajectories(paths, cache_dir=tmp_path / "cache")["prompt_id"] == [r["prompt_id"] for r in expected]


def _flip_data_byte(path):
    """Flip one byte in the middle of the column data, leaving the footer intact."""
    data = bytearray(path.read_bytes())
    footer_len = int.from_bytes(data[-8:-4], "little")
    mid = (4 + len(data) - 8 - footer_len) // 2
    data[mid] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["truncate", "garbage", "foreign", "flip"])
def test_corrupt_files_are_reported_and_refused(tmp_path, damage):
    rng = np.random.default_rng(1)
    folder = tmp_path / "traj"
    metas = [meta(i, 2, 40, topk=2) for i in range(2)]
    for m in metas:
        write_shard(folder, make_rows(rng, 40, 2, f"s{m.shard}", completion_len=16), m)
    bad = folder / shard_name(1, 2)
    if damage == "truncate":
        bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    elif damage == "garbage":
        bad.write_bytes(b"this is not a parquet file\n" * 50)
    elif damage == "foreign":  # valid parquet, but not ours
        pq.write_table(pa.table({"x": [1, 2, 3]}), bad)
    else:
        _flip_data_byte(bad)

    assert check_shard(folder / shard_name(0, 2), metas[0]) is None
    assert check_shard(bad, metas[1]).startswith("corrupt")
    if damage == "flip":
        # The footer survives, so only a full read (check_shard, load_trajectories) can notice.
        assert read_meta(bad) == metas[1]
    else:
        with pytest.raises(TrajectoryError, match=bad.name):
            read_meta(bad)
    with pytest.raises(TrajectoryError):
        load_trajectories(folder, cache_dir=tmp_path / "cache")


def test_read_meta_missing_file_names_it(tmp_path):
    with pytest.raises(TrajectoryError, match=r"shard-00000-of-00001\.parquet: missing; run stage=trajectories"):
        read_meta(tmp_path / shard_name(0, 1))


def test_other_tokenizer_is_refused(tmp_path):
    rng = np.random.default_rng(2)
    one = tmp_path / "one"
    path = write_shard(one, make_rows(rng, 4, 0, "a"), meta(tok=TOK_A))

    reason = check_shard(path, meta(tok=TOK_B))
    assert reason.startswith("from another tokenizer") and TOK_A in reason and TOK_B in reason
    assert len(load_trajectories(one, tokenizer_hash=TOK_A, cache_dir=tmp_path / "cache")) == 4
    with pytest.raises(TrajectoryError) as err:
        load_trajectories(one, tokenizer_hash=TOK_B, cache_dir=tmp_path / "cache")
    assert TOK_A in str(err.value) and TOK_B in str(err.value) and "ckpt/verifier" in str(err.value)

    mixed = tmp_path / "mixed"
    write_shard(mixed, make_rows(rng, 4, 0, "a"), meta(0, 2, tok=TOK_A))
    write_shard(mixed, make_rows(rng, 4, 0, "b"), meta(1, 2, tok=TOK_B))
    with pytest.raises(TrajectoryError, match="disagree on tokenizer_hash"):
        load_trajectories(mixed, cache_dir=tmp_path / "cache")
    with pytest.raises(TrajectoryError, match="disagree on tokenizer_hash"):
        trajectory_meta(mixed)


def test_duplicate_and_absent_shards_are_refused(tmp_path):
    rng = np.random.default_rng(3)
    folder = tmp_path / "traj"
    path = write_shard(folder, make_rows(rng, 4, 0, "a"), meta())
    (folder / "shard-copy.parquet").write_bytes(path.read_bytes())
    with pytest.raises(TrajectoryError, match="both hold shard 0 of 1"):
        load_trajectories(folder, cache_dir=tmp_path / "cache")
    with pytest.raises(TrajectoryError, match="no trajectory shards in .*run stage=trajectories first"):
        load_trajectories(tmp_path / "empty", cache_dir=tmp_path / "cache")


def _bad_cases(good):
    def edit(fn):
        rows = copy.deepcopy(good)
        fn(rows)
        return rows

    def short_topk(rows):
        rows[1]["topk_ids"] = [ids[:-1] for ids in rows[1]["topk_ids"]]

    def one_token_short(rows):
        rows[2]["topk_logprobs"] = rows[2]["topk_logprobs"][:-1]

    return {
        "topk length": (edit(short_topk), "topk_ids has shape"),
        "topk count": (edit(one_token_short), "topk_logprobs has shape"),
        "missing key": (edit(lambda rows: rows[0].pop("seed")), r"missing keys \['seed'\]"),
        "extra key": (edit(lambda rows: rows[0].update(logits=[0.0])), r"unexpected keys \['logits'\]"),
        "rows count": (good[:-1], "meta.rows"),
        "finish reason": (edit(lambda rows: rows[3].update(finish_reason="done")), "finish_reason"),
        "string ids": (edit(lambda rows: rows[0].update(prompt_ids=["1", "2"])), "prompt_ids"),
        "id overflow": (edit(lambda rows: rows[0].update(prompt_ids=[2**31])), "int32"),
        "nan logprob": (edit(lambda rows: rows[1]["topk_logprobs"][0].__setitem__(0, float("nan"))), "NaN"),
    }


def test_bad_rows_are_refused_before_writing(tmp_path):
    rng = np.random.default_rng(4)
    m = meta(rows=4, topk=3)
    good = make_rows(rng, 4, 3, "g", completion_len=5)
    folder = tmp_path / "traj"
    path = write_shard(folder, good, m)
    before = path.read_bytes()
    replacement = make_rows(rng, 4, 3, "r", completion_len=5)

    for name, (rows, message) in _bad_cases(replacement).items():
        with pytest.raises(TrajectoryError, match=message):
            write_shard(folder, rows, m)
        assert path.read_bytes() == before, name
        assert os.listdir(folder) == [path.name], name
        # A refused shard does not even create its folder.
        with pytest.raises(TrajectoryError):
            write_shard(tmp_path / f"new-{name}", rows, m)
        assert not (tmp_path / f"new-{name}").exists(), name

    # topk=0 shards take no topk columns.
    with pytest.raises(TrajectoryError, match="unexpected keys"):
        write_shard(folder, replacement, dataclasses.replace(m, topk=0))
    assert path.read_bytes() == before

    # The good replacement does go through, and atomically replaces the old shard.
    write_shard(folder, replacement, m)
    assert path.read_bytes() != before and check_shard(path, m) is None
    assert os.listdir(folder) == [path.name]


def test_failed_write_leaves_no_temp_file(tmp_path):
    # A directory in the shard's place makes the final os.replace fail after the temp file is complete.
    folder = tmp_path / "traj"
    (folder / shard_name(0, 1)).mkdir(parents=True)
    with pytest.raises(OSError):
        write_shard(folder, make_rows(np.random.default_rng(5), 4, 0, "a"), meta())
    assert os.listdir(folder) == [shard_name(0, 1)]
    assert (folder / shard_name(0, 1)).is_dir()


def test_estimate_is_monotone_and_bounds_a_real_shard(tmp_path):
    base = {"rows": 100, "mean_prompt_tokens": 50.0, "max_new_tokens": 64, "topk": 4}
    ref = estimate(**base)
    assert ref["rows"] == 100 and ref["tokens"] == 100 * (50 + 64)
    for key in base:
        bigger = estimate(**{**base, key: base[key] * 2})
        assert bigger["bytes"] > ref["bytes"], key
        assert bigger["tokens"] >= ref["tokens"], key

    rng = np.random.default_rng(6)
    for topk in (0, 8):
        rows = make_rows(rng, 64, topk, "e", prompt_len=40, completion_len=96, vocab=150_000)
        path = write_shard(tmp_path / f"k{topk}", rows, meta(rows=64, topk=topk))
        est = estimate(64, 40, 96, topk)
        assert path.stat().st_size < est["bytes"], (topk, path.stat().st_size, est)
        # The bound is not vacuous: within a small factor of the real file.
        assert est["bytes"] < 3 * path.stat().st_size, (topk, path.stat().st_size, est)


def test_format_bytes():
    assert format_bytes(0) == "0 B"
    assert format_bytes(999) == "999 B"
    assert format_bytes(12_345_678) == "12.3 MB"
    assert format_bytes(999_960) == "1.0 MB"
    assert format_bytes(3 * 10**12) == "3.0 TB"
