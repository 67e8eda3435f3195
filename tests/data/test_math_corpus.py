"""Tests for the math corpus: every answer recomputed independently, seeds pure and split, the text format."""

from __future__ import annotations

import random
import re
from fractions import Fraction
from math import ceil

import pytest

from streakline.data.corpora.math import (
    SEED_SPACE,
    TEMPLATES,
    fmt,
    math_dataset,
    math_texts,
    money,
    problem,
    problem_seeds,
)

N_CHECK = 900  # enough seeds that every template and every sub-kind shows up many times


def _recompute(p: dict) -> Fraction:
    """The answer from the template's drawn numbers, by formulas written independently of the generator."""
    n, t = p["numbers"], p["template"]
    if t == "shopping":
        spent = sum(q * c for q, c in zip(n["quantities"], n["price_cents"], strict=True))
        assert spent < n["paid"] * 100
        return Fraction(n["paid"] * 100 - spent, 100)
    if t == "travel":
        assert n["distance"] % n["hours"] == 0
        return Fraction(n["distance"] // n["hours"] * n["new_hours"] + n["extra"])
    if t == "work_rate":
        return Fraction(n["total"], sum(n["rates"]))
    if t == "discount":
        sale = Fraction(n["price"]) * (100 - n["discount_percent"]) / 100
        return sale * (100 + n["tax_percent"]) / 100
    if t == "percent_of":
        return Fraction(n["total"]) * (100 - n["percent"]) / 100 - n["biked"]
    if t == "units":
        kind = n["kind"]
        if kind == "cm":
            return Fraction(n["meters"] * 100, n["piece_cm"])
        if kind == "m":
            return Fraction((n["km"] * 1000 + n["m"]) * n["days"])
        if kind == "min":
            return Fraction((n["hours"] * 60 + n["minutes"]) * n["days"])
        return Fraction(n["kg"] * 1000, n["portion_g"])
    if t == "comparison":
        other = n["k"] * n["x"] - n["m"] if n["kind"] == "times_minus" else Fraction(n["x"], 2) + n["m"]
        return abs(other - n["x"])
    if t == "sharing":
        return Fraction(n["count"] % n["groups"] if n["kind"] == "leftover" else ceil(n["count"] / n["groups"]))
    if t == "ages":
        return Fraction(2 * n["age"] + n["gap"] + 2 * n["years"])
    raise AssertionError(f"no checker for template {t}")


def _ints(numbers: dict) -> list[int]:
    out = []
    for key, v in numbers.items():
        if key in ("price_cents", "kind") or (key == "k" and numbers.get("kind") == "half_plus"):
            continue  # prices appear as dollars; "half" is written as a word
        out.extend(v if isinstance(v, list) else [v])
    return out


@pytest.fixture(scope="module")
def problems() -> list[dict]:
    return [problem(s) for s in range(N_CHECK)]


def test_every_answer_matches_an_independent_recomputation(problems):
    for p in problems:
        want = _recompute(p)
        assert want > 0 and (want * 100).denominator == 1, p
        assert Fraction(p["answer"]) == want, p


def test_every_template_and_kind_is_exercised(problems):
    assert {p["template"] for p in problems} == set(TEMPLATES)
    assert len(TEMPLATES) >= 6
    kinds = {(p["template"], p["numbers"]["kind"]) for p in problems if "kind" in p["numbers"]}
    assert kinds >= {("units", k) for k in ("cm", "m", "min", "g")}
    assert kinds >= {("comparison", "times_minus"), ("comparison", "half_plus")}
    assert kinds >= {("sharing", "leftover"), ("sharing", "boxes")}


def test_answers_are_short_numbers_and_close_the_solution(problems):
    for p in problems:
        assert re.fullmatch(r"\d+(\.\d{1,2})?", p["answer"]), p["answer"]
        assert p["solution"].splitlines()[-1] == f"#### {p['answer']}"
        assert p["solution"].count("####") == 1 and len(p["solution"].splitlines()) >= 2


def test_stored_numbers_are_the_ones_in_the_question(problems):
    for p in problems:
        words = set(re.findall(r"\d+", p["question"]))
        for v in _ints(p["numbers"]):
            assert str(v) in words, (v, p["question"])
        if p["template"] == "shopping":
            for c in p["numbers"]["price_cents"]:
                assert money(Fraction(c, 100)) in p["question"]


def test_a_seed_is_a_pure_function():
    state = random.getstate()
    assert problem(12345) == problem(12345)
    assert random.getstate() == state  # the generator never touches the global random module
    questions = [problem(s)["question"] for s in range(300)]
    assert len(set(questions)) >= 295


def test_split_seed_spaces_are_disjoint():
    train = list(problem_seeds("train", 2000))
    heldout = list(problem_seeds("heldout", 2000))
    assert all(0 <= s < SEED_SPACE for s in train)
    assert all(SEED_SPACE <= s < 2 * SEED_SPACE for s in heldout)
    assert len(set(train)) == len(train) and len(set(heldout)) == len(heldout)
    assert train == list(problem_seeds("train", 2000))
    assert list(problem_seeds("train", 10, seed=1)) != train[:10]
    assert list(problem_seeds("train", 10)) == train[:10]  # a shorter stream is a prefix of a longer one


def test_heldout_questions_do_not_appear_in_training():
    train = {r["question"] for r in math_texts("train", 3000)}
    assert not train & {r["question"] for r in math_texts("heldout", 200)}


def test_texts_join_question_and_solution_and_repeat():
    recs = list(math_texts("train", 5, seed=3))
    assert recs == list(math_texts("train", 5, seed=3))
    for r in recs:
        assert r["text"] == r["question"] + "\n" + r["solution"]
        assert set(r) == {"question", "solution", "answer", "text"}


def test_dataset_streams_the_same_records():
    assert list(math_dataset("heldout", 4, seed=0)) == list(math_texts("heldout", 4, seed=0))


def test_unknown_split_is_refused():
    with pytest.raises(ValueError, match="train, heldout"):
        next(math_texts("test", 1))


def test_number_formatting():
    assert fmt(Fraction(7, 2)) == "3.5" and fmt(Fraction(1234, 100)) == "12.34" and fmt(12) == "12"
    assert money(Fraction(7, 2)) == "$3.50" and money(4) == "$4"
    with pytest.raises(ValueError):
        fmt(Fraction(1, 3))
