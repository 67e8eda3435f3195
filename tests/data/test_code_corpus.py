"""Tests for the code corpus: which stdlib files it holds, the train/heldout split, decoding and the fingerprint."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from streakline.data.corpora import code
from streakline.data.corpora.code import code_dataset, code_texts, corpus_fingerprint, list_files, split_of


def _fake_stdlib(root: Path) -> Path:
    files = {
        "a.py": "x = 1\n",
        "pkg/__init__.py": "",
        "pkg/b.py": "def f():\n    return 2\n",
        "pkg/tests/test_b.py": "assert True\n",
        "test/test_a.py": "assert True\n",
        "site-packages/thirdparty.py": "y = 3\n",
        "idlelib/editor.py": "z = 4\n",
        "lib2to3/fixer.py": "z = 5\n",
        "turtledemo/demo.py": "z = 6\n",
        "ensurepip/__init__.py": "z = 7\n",
        "notes.txt": "not python\n",
        "big.py": "#" * (code.MAX_FILE_BYTES + 1) + "\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_listing_keeps_library_files_and_drops_the_excluded_ones(tmp_path):
    root = _fake_stdlib(tmp_path)
    assert [f.path for f in list_files(str(root))] == ["a.py", "pkg/__init__.py", "pkg/b.py"]


def test_real_stdlib_listing_is_sorted_and_has_no_excluded_parts():
    files = list_files()
    paths = [f.path for f in files]
    assert paths == sorted(paths) and len(paths) > 200
    for f in files:
        assert not set(f.path.split("/")[:-1]) & code.EXCLUDED_DIRS, f.path
        assert f.path.endswith(".py") and f.size <= code.MAX_FILE_BYTES


def test_texts_are_deterministic():
    first = [(r["path"], r["text"]) for r in code_texts("heldout")]
    assert first == [(r["path"], r["text"]) for r in code_texts("heldout")]
    assert all(isinstance(t, str) and "\r" not in t for _, t in first)


def test_splits_are_disjoint_cover_every_file_and_hold_out_about_a_tenth():
    train = [r["path"] for r in code_texts("train")]
    heldout = [r["path"] for r in code_texts("heldout")]
    assert not set(train) & set(heldout)
    assert sorted(train + heldout) == [f.path for f in list_files()]
    assert 0.05 < len(heldout) / (len(train) + len(heldout)) < 0.2


def test_split_rule_is_pinned():
    # Moving a file between splits silently invalidates every cache keyed on the corpus, so the rule is frozen here.
    assert split_of("json/__init__.py") == "heldout"
    assert split_of("tokenize.py") == "heldout"
    assert split_of("json/decoder.py") == "train"
    assert split_of("os.py") == "train"
    assert split_of("os.py") == split_of("os.py")


def test_split_does_not_depend_on_the_root(tmp_path):
    root = _fake_stdlib(tmp_path)
    expected = {p: split_of(p) for p in ("a.py", "pkg/__init__.py", "pkg/b.py")}
    assert {f.path: f.split for f in list_files(str(root))} == expected


def test_source_encoding_cookie_and_newlines_are_honoured(tmp_path):
    (tmp_path / "latin.py").write_bytes(b"# -*- coding: latin-1 -*-\r\nname = '\xe9t\xe9'\r\n")
    (rec,) = [r for s in ("train", "heldout") for r in code_texts(s, root=str(tmp_path))]
    assert rec == {"path": "latin.py", "text": "# -*- coding: latin-1 -*-\nname = 'été'\n"}


def test_dataset_streams_the_same_records():
    expected = list(code_texts("heldout"))[:3]
    got = [row for _, row in zip(range(3), code_dataset("heldout"), strict=False)]
    assert got == expected


def test_unknown_split_is_refused():
    with pytest.raises(ValueError, match="train, heldout"):
        next(code_texts("validation"))


def test_fingerprint_names_the_python_and_follows_file_sizes(tmp_path):
    v = sys.version_info
    assert corpus_fingerprint().startswith(f"py{v.major}.{v.minor}.{v.micro}-")
    assert corpus_fingerprint() == corpus_fingerprint()
    root = _fake_stdlib(tmp_path)
    before = corpus_fingerprint(str(root))
    (root / "a.py").write_text("x = 10\n")
    list_files.cache_clear()  # the listing is cached per process; a changed tree needs a fresh look
    assert corpus_fingerprint(str(root)) != before
