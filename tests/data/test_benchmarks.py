"""Tests for benchmark loading: the built-in tiny sets, real benchmarks from local files, the hub-cache path, errors."""

from __future__ import annotations

import ast
import dataclasses
import json

import datasets
import huggingface_hub
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from streakline.data import benchmarks
from streakline.data.benchmarks import REAL, BenchmarkError, benchmark_names, load_benchmark
from streakline.data.corpora.code import list_files
from streakline.data.corpora.math import math_texts

# One record per real benchmark, with the field names its published files use, and what it must map to.
SAMPLES = {
    "math-500": (
        {"problem": "Find x if 2x = 4.", "solution": "x = 2.", "answer": "2", "unique_id": "test/algebra/1.json"},
        ("test/algebra/1.json", "Find x if 2x = 4.", "x = 2.", "math"),
    ),
    "humaneval": (
        {
            "task_id": "HumanEval/0",
            "prompt": "def f():\n",
            "canonical_solution": "    return 1\n",
            "test": "",
            "entry_point": "f",
        },
        ("HumanEval/0", "def f():\n", "    return 1\n", "code"),
    ),  # fmt: skip
    "gpqa": (
        {"Question": "What is H2O?", "Correct Answer": "Water", "Incorrect Answer 1": "Salt", "Record ID": "rec1"},
        ("rec1", "What is H2O?", "Water", "science"),
    ),
    "mt-bench": (
        {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Now shorter."]},
        ("81", "Write a poem.", "", "chat"),
    ),
    "gsm8k": (
        {"question": "Tom has 3 apples and eats 1. How many are left?", "answer": "3 - 1 = 2\n#### 2"},
        ("0", "Tom has 3 apples and eats 1. How many are left?", "3 - 1 = 2\n#### 2", "math"),
    ),
    "mbpp": (
        {
            "task_id": 11,
            "text": "Write a function to add.",
            "code": "def add(a, b):\n    return a + b",
            "test_list": ["assert add(1, 2) == 3"],
        },
        ("11", "Write a function to add.", "def add(a, b):\n    return a + b", "code"),
    ),  # fmt: skip
}


def _write(path, rows):
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# --- built-in ------------------------------------------------------------------------------------------------------


def test_tiny_math_is_the_heldout_stream():
    recs = load_benchmark("tiny-math")
    assert len(recs) == 200 and len({r["id"] for r in recs}) == 200
    heldout = list(math_texts("heldout", 200, seed=0))
    assert [r["prompt"] for r in recs] == [h["question"] for h in heldout]
    assert [r["reference"] for r in recs] == [h["solution"] for h in heldout]
    assert {r["domain"] for r in recs} == {"math"}
    assert load_benchmark("tiny-math", limit=5) == recs[:5]


@pytest.fixture(scope="module")
def tiny_code() -> list[dict]:
    return load_benchmark("tiny-code")


def test_tiny_code_prompts_are_headers_with_docstrings(tiny_code):
    assert len(tiny_code) == 200 and len({r["id"] for r in tiny_code}) == 200
    for r in tiny_code:
        assert r["domain"] == "code" and r["prompt"].startswith(("def ", "async def "))
        (fn,) = ast.parse(r["prompt"]).body  # header + docstring alone is already a valid function
        assert isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(fn) is not None
        assert len(fn.body) == 1
        full = ast.parse(r["prompt"] + r["reference"]).body[0]
        assert full.name == fn.name and len(full.body) >= 2
        assert 2 <= len(r["reference"].splitlines()) <= 30 and r["reference"].endswith("\n")


def test_tiny_code_comes_from_heldout_files_only_and_repeats(tiny_code):
    heldout = {f.path for f in list_files() if f.split == "heldout"}
    for r in tiny_code:
        path = r["id"].removeprefix("tiny-code/").split(":")[0]
        assert path in heldout, r["id"]
    assert load_benchmark("tiny-code", limit=10) == tiny_code[:10]


def test_built_in_benchmarks_take_no_path(tmp_path):
    with pytest.raises(BenchmarkError, match="built into the tiny world"):
        load_benchmark("tiny-math", path=tmp_path / "x.jsonl")


# --- real benchmarks from local files ------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet", ".json"])
@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_real_benchmark_field_mapping(tmp_path, name, suffix):
    row, (rid, prompt, reference, domain) = SAMPLES[name]
    path = _write(tmp_path / f"{name}{suffix}", [row, row])
    recs = load_benchmark(name, path=path)
    assert recs[0] == {"id": f"{name}/{rid}", "prompt": prompt, "reference": reference, "domain": domain}
    assert len(recs) == 2 and len(load_benchmark(name, path=str(path), limit=1)) == 1


def test_mt_bench_hub_layout_and_json_lines_under_a_json_name(tmp_path):
    row = {"prompt": ["Plan a trip.", "Make it cheaper."], "prompt_id": 7, "category": "writing", "reference": []}
    path = tmp_path / "mt.json"
    path.write_text(json.dumps(row) + "\n" + json.dumps({**row, "prompt_id": 8}) + "\n")  # as datasets.to_json writes
    recs = load_benchmark("mt-bench", path=path)
    assert [r["id"] for r in recs] == ["mt-bench/7", "mt-bench/8"] and recs[0]["prompt"] == "Plan a trip."


def test_every_real_benchmark_has_a_sample():
    assert set(SAMPLES) == set(REAL)


def test_missing_fields_name_what_the_file_has_and_what_is_needed(tmp_path):
    path = _write(tmp_path / "wrong.jsonl", [{"question": "q", "solution": "s"}])
    with pytest.raises(BenchmarkError) as err:
        load_benchmark("humaneval", path=path)
    msg = str(err.value)
    assert "['question', 'solution']" in msg and "'prompt'" in msg and "'canonical_solution'" in msg


def test_unknown_benchmark_lists_the_valid_names():
    with pytest.raises(BenchmarkError) as err:
        load_benchmark("humaneval-plus")
    assert isinstance(err.value, ValueError)
    for name in benchmark_names():
        assert name in str(err.value)


@pytest.mark.parametrize(
    ("filename", "content", "match"),
    [
        ("absent.jsonl", None, "no benchmark file"),
        ("data.csv", "a,b\n", "expected one of"),
        ("bad.jsonl", '{"question": 1}\nnot json\n', r"bad.jsonl:2 is not valid JSON"),
        ("scalar.json", "3", "expected a list of objects"),
        ("empty.jsonl", "", "has no records"),
    ],
)
def test_unreadable_files_are_explained(tmp_path, filename, content, match):
    path = tmp_path / filename
    if content is not None:
        path.write_text(content)
    with pytest.raises(BenchmarkError, match=match):
        load_benchmark("gsm8k", path=path)


# --- the hub path ----------------------------------------------------------------------------------------------------


def test_uncached_hub_benchmark_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    flags = datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE
    with pytest.raises(BenchmarkError) as err:
        load_benchmark("gsm8k")
    msg = str(err.value)
    assert (
        "openai/gsm8k" in msg and "load_dataset('openai/gsm8k', 'main'" in msg and "data.prompt_sources=[gsm8k@" in msg
    )
    assert (datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE) == flags  # restored


def test_hub_path_reads_offline_and_maps_fields(tmp_path, monkeypatch):
    # A local dataset folder stands in for a cached hub id: same load_dataset call, same split, no network.
    folder = tmp_path / "gsm8k"
    folder.mkdir()
    _write(folder / "test.jsonl", [SAMPLES["gsm8k"][0]] * 3)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(REAL, "gsm8k", dataclasses.replace(REAL["gsm8k"], hub_id=str(folder), config=None))
    recs = benchmarks.load_benchmark("gsm8k", limit=2)
    assert [r["id"] for r in recs] == ["gsm8k/0", "gsm8k/1"] and recs[0]["reference"].endswith("#### 2")


def test_parse_source_reads_name_and_optional_file():
    from streakline.data.benchmarks import BenchmarkError, parse_source

    assert parse_source("gsm8k") == ("gsm8k", None)
    assert parse_source("humaneval@/data/he.jsonl") == ("humaneval", "/data/he.jsonl")
    with pytest.raises(BenchmarkError, match="names no file"):
        parse_source("mbpp@")
