"""The math domain of the tiny world: seeded grade-school word problems with worked solutions (GSM8K style).

``problem(seed)`` is a pure function of an integer seed: it picks a template and fills in names, items and numbers
with ``random.Random(seed)``, computes the answer exactly (``fractions.Fraction``, never floats), and writes a
step-by-step solution that ends with the line ``#### <answer>``. Answers are integers or decimals with at most two
places.

Seed rule. Problem seeds ``[0, 10**9)`` are training seeds and ``[10**9, 2 * 10**9)`` are held-out seeds, so a
held-out problem is never generated from a training seed. A split is streamed by drawing distinct offsets in
``[0, 10**9)`` from ``random.Random(f"streakline-math:{split}:{seed}")`` and adding the split's base; benchmarks use
only the held-out stream (``tiny-math`` is the first 200 problems of ``math_texts("heldout", 200, seed=0)``).

    p = problem(7)                     # {"question", "solution", "answer", "template", "numbers", "seed"}
    for rec in math_texts("train", 1000, seed=0):
        rec["text"]                    # question + "\\n" + solution
    ds = math_dataset("heldout", 200, seed=0)

Each record's ``numbers`` holds the quantities the template drew, so a checker can recompute the answer on its own.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from fractions import Fraction
from typing import Any

SPLITS = ("train", "heldout")
SEED_SPACE = 10**9
SPLIT_BASE = {"train": 0, "heldout": SEED_SPACE}

NAMES = tuple(
    "Ava Ben Carlos Dana Elif Farah Gus Hana Ivan Jade Kofi Lena Mateo Nia Omar Priya Quinn Rosa Sami Tara Umar Vera "
    "Wes Ximena Yusuf Zoe Aiko Bruno Chloe Diego Emma Finn Grace Hugo Isla Jonas Kira Liam Maya Noah".split()
)
ITEMS = (
    "notebooks", "pencils", "apples", "sandwiches", "comic books", "bottles of juice", "muffins", "packs of stickers",
    "toy cars", "candles", "mugs", "pairs of socks", "bags of rice", "flower pots",
)  # fmt: skip
BIG_ITEMS = ("bicycle", "jacket", "lamp", "backpack", "pair of shoes", "tent", "guitar", "desk chair", "camera")
COLLECTIBLES = ("stickers", "marbles", "stamps", "seashells", "trading cards", "coins", "beads", "postcards")
TASKS = (
    ("pack", "boxes"), ("fold", "shirts"), ("plant", "trees"), ("paint", "fence boards"), ("bake", "cookies"),
    ("wash", "cars"), ("sort", "letters"), ("label", "jars"),
)  # fmt: skip
VEHICLES = ("train", "bus", "car", "truck", "cyclist", "boat")
ACTIVITIES = ("practices piano", "reads", "jogs", "studies Spanish", "plays chess", "draws", "swims")
GROUPS = (
    "students in a school club", "people at a concert", "players in a league", "visitors at a museum",
    "guests at a wedding", "workers at a factory",
)  # fmt: skip
TREATS = ("cookies", "crayons", "strawberries", "balloons", "cupcakes", "marbles", "stickers", "pretzels")


def fmt(x: Fraction | int) -> str:
    """An exact number as text: ``"12"`` or ``"12.5"``; refuses anything needing more than two decimals."""
    x = Fraction(x)
    if x.denominator == 1:
        return str(x.numerator)
    cents = x * 100
    if cents.denominator != 1:
        raise ValueError(f"{x} is not a short decimal")
    sign = "-" if cents < 0 else ""
    whole, frac = divmod(abs(cents.numerator), 100)
    return f"{sign}{whole}.{frac:02d}".rstrip("0")


def money(x: Fraction | int) -> str:
    """Dollars as written in a problem: ``"$12"`` or ``"$12.50"`` (cents always two digits)."""
    x = Fraction(x)
    if x.denominator == 1:
        return f"${x.numerator}"
    cents = x * 100
    if cents.denominator != 1:
        raise ValueError(f"{x} is not a whole number of cents")
    whole, frac = divmod(cents.numerator, 100)
    return f"${whole}.{frac:02d}"


def _two_names(rng: random.Random) -> tuple[str, str]:
    a, b = rng.sample(NAMES, 2)
    return a, b


# Each template returns (question, solution lines without the answer line, answer, numbers).
_Result = tuple[str, list[str], Fraction, dict[str, Any]]


def _shopping(rng: random.Random) -> _Result:
    name = rng.choice(NAMES)
    p1, p2 = rng.sample(ITEMS, 2)
    q1, q2 = rng.randint(2, 6), rng.randint(2, 6)
    c1, c2 = rng.randrange(50, 900, 25), rng.randrange(50, 900, 25)  # cents, so prices are exact
    a, b = Fraction(q1 * c1, 100), Fraction(q2 * c2, 100)
    total = a + b
    paid = next(bill for bill in (20, 50, 100, 200) if bill > total)
    change = paid - total
    q = (
        f"{name} buys {q1} {p1} for {money(Fraction(c1, 100))} each and {q2} {p2} for {money(Fraction(c2, 100))} "
        f"each. {name} pays with a {money(paid)} bill. How much change does {name} get, in dollars?"
    )
    sol = [
        f"The {p1} cost {q1} * {money(Fraction(c1, 100))} = {money(a)}.",
        f"The {p2} cost {q2} * {money(Fraction(c2, 100))} = {money(b)}.",
        f"Altogether {name} spends {money(a)} + {money(b)} = {money(total)}.",
        f"The change is {money(paid)} - {money(total)} = {money(change)}.",
    ]
    return q, sol, change, {"quantities": [q1, q2], "price_cents": [c1, c2], "paid": paid}


def _travel(rng: random.Random) -> _Result:
    vehicle = rng.choice(VEHICLES)
    speed = rng.randrange(12, 121, 2) if vehicle != "cyclist" else rng.randint(10, 30)
    hours, new_hours = rng.randint(2, 6), rng.randint(2, 9)
    dist = speed * hours
    extra = rng.randint(5, 60)
    q = (
        f"A {vehicle} travels {dist} kilometers in {hours} hours. The next day it travels for {new_hours} hours at "
        f"the same speed and then {extra} kilometers more. How many kilometers does it travel the next day?"
    )
    answer = Fraction(speed * new_hours + extra)
    sol = [
        f"The speed is {dist} / {hours} = {speed} kilometers per hour.",
        f"In {new_hours} hours it travels {speed} * {new_hours} = {speed * new_hours} kilometers.",
        f"Adding the extra distance gives {speed * new_hours} + {extra} = {fmt(answer)} kilometers.",
    ]
    return q, sol, answer, {"distance": dist, "hours": hours, "new_hours": new_hours, "extra": extra}


def _work_rate(rng: random.Random) -> _Result:
    a, b = _two_names(rng)
    verb, things = rng.choice(TASKS)
    x, y = rng.randint(3, 40), rng.randint(3, 40)
    k = rng.randint(2, 12)
    total = (x + y) * k
    q = (
        f"{a} can {verb} {x} {things} per hour and {b} can {verb} {y} {things} per hour. Working together, how many "
        f"hours will it take them to {verb} {total} {things}?"
    )
    sol = [
        f"Together they {verb} {x} + {y} = {x + y} {things} per hour.",
        f"To {verb} {total} {things} they need {total} / {x + y} = {k} hours.",
    ]
    return q, sol, Fraction(k), {"rates": [x, y], "total": total}


def _discount(rng: random.Random) -> _Result:
    name, item = rng.choice(NAMES), rng.choice(BIG_ITEMS)
    price = rng.randrange(20, 401, 20)  # a multiple of 20 keeps a multiple-of-5 discount a whole dollar amount
    off, tax = rng.randrange(10, 55, 5), rng.choice((4, 5, 6, 8, 10))
    discount = Fraction(price * off, 100)
    sale = price - discount
    tax_amount = sale * Fraction(tax, 100)
    total = sale + tax_amount
    q = (
        f"A {item} costs {money(price)}. The store takes {off}% off, and then adds {tax}% sales tax to the reduced "
        f"price. How many dollars does {name} pay for the {item}?"
    )
    sol = [
        f"The discount is {off}% of {money(price)} = {money(discount)}.",
        f"The reduced price is {money(price)} - {money(discount)} = {money(sale)}.",
        f"The tax is {tax}% of {money(sale)} = {money(tax_amount)}.",
        f"{name} pays {money(sale)} + {money(tax_amount)} = {money(total)}.",
    ]
    return q, sol, total, {"price": price, "discount_percent": off, "tax_percent": tax}


def _percent_of(rng: random.Random) -> _Result:
    group = rng.choice(GROUPS)
    total = rng.randrange(40, 1001, 20)
    pct = rng.randrange(5, 96, 5)
    part = total * pct // 100  # exact: total is a multiple of 20 and pct a multiple of 5
    rest = total - part
    removed = rng.randint(1, max(1, rest - 1))
    plural = group.split(" ")[0]
    q = (
        f"There are {total} {group}. {pct}% of them arrived by bus. Of the others, {removed} arrived by bike and the "
        f"rest walked. How many {plural} walked?"
    )
    sol = [
        f"{pct}% of {total} is {total} * {pct} / 100 = {part} {plural} by bus.",
        f"That leaves {total} - {part} = {rest} {plural}.",
        f"Without the {removed} who biked, {rest} - {removed} = {rest - removed} {plural} walked.",
    ]
    return q, sol, Fraction(rest - removed), {"total": total, "percent": pct, "biked": removed}


def _units(rng: random.Random) -> _Result:
    name = rng.choice(NAMES)
    kind = rng.choice(("cm", "m", "min", "g"))
    if kind == "cm":
        meters, piece = rng.randint(2, 40), rng.choice((4, 5, 10, 20, 25, 50))
        pieces = meters * 100 // piece
        q = (
            f"A rope is {meters} meters long. {name} cuts it into pieces that are each {piece} centimeters long. "
            f"How many pieces does {name} get?"
        )
        sol = [
            f"{meters} meters is {meters} * 100 = {meters * 100} centimeters.",
            f"{meters * 100} / {piece} = {pieces} pieces.",
        ]
        return q, sol, Fraction(pieces), {"kind": kind, "meters": meters, "piece_cm": piece}
    if kind == "m":
        km, m, days = rng.randint(1, 9), rng.randrange(50, 1000, 50), rng.randint(2, 7)
        daily = km * 1000 + m
        q = f"{name} runs {km} kilometers and {m} meters every day. How many meters does {name} run in {days} days?"
        sol = [
            f"{km} kilometers is {km} * 1000 = {km * 1000} meters, so each day is {km * 1000} + {m} = {daily} meters.",
            f"In {days} days that is {daily} * {days} = {daily * days} meters.",
        ]
        return q, sol, Fraction(daily * days), {"kind": kind, "km": km, "m": m, "days": days}
    if kind == "min":
        activity = rng.choice(ACTIVITIES)
        h, mins, days = rng.randint(1, 3), rng.randrange(5, 60, 5), rng.randint(2, 7)
        daily = h * 60 + mins
        hour_word = "hour" if h == 1 else "hours"
        q = (
            f"{name} {activity} for {h} {hour_word} and {mins} minutes each day. "
            f"How many minutes is that in {days} days?"
        )
        sol = [
            f"{h} {hour_word} is {h} * 60 = {h * 60} minutes, so each day is {h * 60} + {mins} = {daily} minutes.",
            f"In {days} days that is {daily} * {days} = {daily * days} minutes.",
        ]
        return q, sol, Fraction(daily * days), {"kind": kind, "hours": h, "minutes": mins, "days": days}
    kg, portion = rng.randint(1, 12), rng.choice((100, 125, 200, 250, 500))
    count = kg * 1000 // portion
    q = (
        f"A bag holds {kg} kilograms of flour. Each loaf of bread uses {portion} grams. "
        f"How many loaves can {name} bake with the whole bag?"
    )
    sol = [f"{kg} kilograms is {kg} * 1000 = {kg * 1000} grams.", f"{kg * 1000} / {portion} = {count} loaves."]
    return q, sol, Fraction(count), {"kind": kind, "kg": kg, "portion_g": portion}


def _comparison(rng: random.Random) -> _Result:
    a, b = _two_names(rng)
    things = rng.choice(COLLECTIBLES)
    while True:
        x = rng.randint(4, 120)
        if rng.random() < 0.5:
            kind, k, m = "times_minus", rng.randint(2, 5), rng.randint(1, 60)
            y = k * x - m
            rule = f"{m} fewer than {k} times as many as {a}"
            step = f"{b} has {k} * {x} - {m} = {y} {things}."
        else:
            x += x % 2  # half of x must be whole
            kind, k, m = "half_plus", 2, rng.randint(1, 90)
            y = x // 2 + m
            rule = f"{m} more than half as many as {a}"
            step = f"Half of {x} is {x // 2}, so {b} has {x // 2} + {m} = {y} {things}."
        if y != x and y > 0:
            break
    more, less = (b, a) if y > x else (a, b)
    diff = abs(y - x)
    q = f"{a} has {x} {things}. {b} has {rule}. Who has more {things}, and how many more?"
    sol = [step, f"{more} has more: {max(x, y)} - {min(x, y)} = {diff} more {things} than {less}."]
    return q, sol, Fraction(diff), {"kind": kind, "x": x, "k": k, "m": m}


def _sharing(rng: random.Random) -> _Result:
    name = rng.choice(NAMES)
    treats = rng.choice(TREATS)
    kind = rng.choice(("leftover", "boxes"))
    k = rng.randint(3, 12)
    # Drawing quotient and remainder (not the total) lets "leftover" problems always leave something over.
    each, left = rng.randint(1, 25), rng.randint(1 if kind == "leftover" else 0, k - 1)
    n = each * k + left
    if kind == "leftover":
        q = (
            f"{name} has {n} {treats} and shares them equally among {k} friends, giving each friend as many as "
            f"possible. How many {treats} are left over?"
        )
        sol = [
            f"{n} / {k} = {each} with remainder {left}, since {k} * {each} = {k * each}.",
            f"So each friend gets {each} and {n} - {k * each} = {left} {treats} are left over.",
        ]
        return q, sol, Fraction(left), {"kind": kind, "count": n, "groups": k}
    boxes = each + (1 if left else 0)
    q = f"{name} packs {n} {treats} into boxes that hold {k} each. How many boxes does {name} need to pack all of them?"
    if left:
        sol = [
            f"{n} / {k} = {each} full boxes with {left} {treats} left over.",
            f"The leftovers need one more box, so {each} + 1 = {boxes} boxes.",
        ]
    else:
        sol = [f"{n} / {k} = {each} full boxes with nothing left over, so {boxes} boxes."]
    return q, sol, Fraction(boxes), {"kind": kind, "count": n, "groups": k}


def _ages(rng: random.Random) -> _Result:
    a, b = _two_names(rng)
    x, gap, years = rng.randint(5, 60), rng.randint(1, 30), rng.randint(2, 20)
    y = x + gap
    total = x + y + 2 * years
    q = (
        f"{a} is {x} years old and {b} is {gap} years older than {a}. "
        f"What will the sum of their ages be in {years} years?"
    )
    sol = [
        f"{b} is {x} + {gap} = {y} years old.",
        f"In {years} years {a} will be {x} + {years} = {x + years} and {b} will be {y} + {years} = {y + years}.",
        f"The sum is {x + years} + {y + years} = {total}.",
    ]
    return q, sol, Fraction(total), {"age": x, "gap": gap, "years": years}


TEMPLATES: dict[str, Callable[[random.Random], _Result]] = {
    "shopping": _shopping,
    "travel": _travel,
    "work_rate": _work_rate,
    "discount": _discount,
    "percent_of": _percent_of,
    "units": _units,
    "comparison": _comparison,
    "sharing": _sharing,
    "ages": _ages,
}


def problem(seed: int) -> dict[str, Any]:
    """The problem for one integer seed: ``{"question", "solution", "answer", "template", "numbers", "seed"}``.

    ``solution`` ends with ``"#### <answer>"`` and ``answer`` is that same string; ``numbers`` holds what the
    template drew, so the answer can be recomputed independently.
    """
    rng = random.Random(seed)
    template = rng.choice(sorted(TEMPLATES))
    question, lines, answer, numbers = TEMPLATES[template](rng)
    text_answer = fmt(answer)
    solution = "\n".join([*lines, f"#### {text_answer}"])
    return {
        "question": question,
        "solution": solution,
        "answer": text_answer,
        "template": template,
        "numbers": numbers,
        "seed": seed,
    }


def problem_seeds(split: str, n: int, seed: int = 0) -> Iterator[int]:
    """``n`` distinct problem seeds of ``split``: train seeds lie in [0, 1e9), held-out seeds in [1e9, 2e9)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    if not 0 <= n <= SEED_SPACE // 2:
        raise ValueError(f"n must lie in [0, {SEED_SPACE // 2}], got {n}")
    # A string seed is hashed with SHA-512 by random.Random, so the stream is the same on every machine and run.
    rng = random.Random(f"streakline-math:{split}:{seed}")
    seen: set[int] = set()
    while len(seen) < n:
        offset = rng.randrange(SEED_SPACE)
        if offset in seen:
            continue
        seen.add(offset)
        yield SPLIT_BASE[split] + offset


def math_texts(split: str, n: int, seed: int = 0) -> Iterator[dict[str, str]]:
    """Yield ``n`` problems of ``split`` as ``{"question", "solution", "answer", "text"}``.

    ``text`` is ``question + "\\n" + solution``: the form the tiny models train on.
    """
    for s in problem_seeds(split, n, seed):
        p = problem(s)
        yield {
            "question": p["question"],
            "solution": p["solution"],
            "answer": p["answer"],
            "text": p["question"] + "\n" + p["solution"],
        }


def math_dataset(split: str, n: int, seed: int = 0):
    """``datasets.IterableDataset`` streaming ``math_texts(split, n, seed)``."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    import datasets  # heavy import, only paid by callers that want a dataset

    return datasets.IterableDataset.from_generator(_generate, gen_kwargs={"split": split, "n": n, "seed": seed})


def _generate(split: str, n: int, seed: int) -> Iterator[dict[str, str]]:
    yield from math_texts(split, n, seed)
