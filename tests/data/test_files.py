"""streakline/data/files.py: the local data files every prompt-set loader reads."""

from __future__ import annotations

import gzip
import json

import pytest

from streakline.data.benchmarks import BenchmarkError, load_benchmark
from streakline.data.files import DataFileError, bad_lines, hub_offline, read_numbered, read_records


def test_json_lines_plain_and_gzipped_with_their_line_numbers(tmp_path):
    text = '{"a": 1}\n\n{"a": 2}\n'
    (tmp_path / "x.jsonl").write_text(text)
    (tmp_path / "x.jsonl.gz").write_bytes(gzip.compress(text.encode()))
    for name in ("x.jsonl", "x.jsonl.gz"):
        assert read_numbered(tmp_path / name) == ([{"a": 1}, {"a": 2}], [1, 3])
    (tmp_path / "y.json").write_text(json.dumps({"data": [{"b": 1}]}))
    assert read_records(tmp_path / "y.json") == [{"b": 1}]


def test_malformed_lines_are_refused_by_number_or_left_out_and_counted(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"a": 1}\nnot json\n{"a": 2}\n')
    with pytest.raises(DataFileError, match=r"x.jsonl:2 is not valid JSON.*data.skip_bad_lines=true"):
        read_records(path)
    with bad_lines(True) as tally:
        assert read_records(path) == [{"a": 1}, {"a": 2}]
        with bad_lines(True) as inner:  # a caller further out counts for the whole read
            read_records(path)
    assert inner is tally and tally.skipped == 2


def test_each_loader_raises_its_own_error_class(tmp_path):
    with pytest.raises(DataFileError, match="no benchmark file"):
        read_records(tmp_path / "missing.jsonl")
    with pytest.raises(BenchmarkError, match="no benchmark file"):  # a DataFileError too
        load_benchmark("humaneval", path=tmp_path / "missing.jsonl")
    assert issubclass(BenchmarkError, DataFileError)


def test_hub_offline_restores_what_it_found():
    import datasets.config
    import huggingface_hub.constants

    before = datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE
    with hub_offline():
        assert datasets.config.HF_HUB_OFFLINE and huggingface_hub.constants.HF_HUB_OFFLINE
    assert (datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE) == before
