"""alignment/stopping.py: nested token subsets, the epoch cap, the plateau stop and the time budget, on hand-made
numbers (and a hand-driven clock)."""

import numpy as np
import pytest

from streakline.alignment.stopping import Deadline, Plateau, epoch_steps, heldout_value, nested_rows


def test_nested_rows_are_the_first_rows_that_hold_the_tokens():
    lengths = np.array([10, 30] * 50)  # a set's rows in its order (the sources interleaved: data/mix.py)
    small, held_small = nested_rows(lengths, 200)
    large, held_large = nested_rows(lengths, 1000)
    assert list(small) == list(range(len(small))) and list(large[: len(small)]) == list(small)  # a prefix
    assert held_small >= 200 and held_small - lengths[small[-1]] < 200  # the fewest rows that reach the size
    assert held_large == lengths[large].sum() and held_small == lengths[small].sum()
    # a shorter set that starts with the same rows gives the same subset: a set of fewer prompts serves the size
    assert np.array_equal(nested_rows(lengths[:20], 200)[0], small)
    rows, held = nested_rows(lengths, 10**9)  # more than the set holds: every row, and the caller refuses
    assert len(rows) == 100 and held == lengths.sum()
    with pytest.raises(ValueError, match="at least 1"):
        nested_rows(lengths, 0)


def test_epoch_steps_caps_at_max_steps():
    assert epoch_steps(max_steps=1000, max_epochs=None, examples=50, per_step=8) == 1000
    assert epoch_steps(max_steps=1000, max_epochs=2, examples=50, per_step=8) == 13  # ceil(100 / 8)
    assert epoch_steps(max_steps=10, max_epochs=2, examples=50, per_step=8) == 10
    assert epoch_steps(max_steps=10, max_epochs=0.01, examples=5, per_step=8) == 1


def test_plateau_stops_after_patience_checks_without_a_new_best():
    stop = Plateau(patience=2, metric="sim_streak")
    check = lambda a, b: {"eval/x/sim_streak": a, "eval/y/sim_streak": b, "eval/x/soft_streak": 9.0}  # noqa: E731
    assert heldout_value(check(1.0, 2.0), "sim_streak") == 1.5 and heldout_value({}, "sim_streak") is None
    assert [stop.update(s, check(*v)) for s, v in ((10, (1, 1)), (20, (1, 2)), (30, (1, 1)), (40, (2, 1)))] == [
        "best",
        "best",
        "wait",
        "stop",
    ]  # fmt: skip  (an equal value is no improvement)
    assert (stop.best, stop.best_step) == (1.5, 20)
    assert stop.update(50, {"loss": 1.0}) == "wait"  # a check without the metric does not count
    again = Plateau(patience=2, metric="sim_streak")
    again.load(stop.state())
    assert again.state() == stop.state()
    with pytest.raises(ValueError, match="at least 1"):
        Plateau(patience=0, metric="sim_streak")


def test_plateau_waits_for_the_warmup_and_a_whole_pass_without_a_new_best():
    """The trainer passes the end of warmup (min_steps) and one pass (min_gap): checks that stall while the learning
    rate still climbs, or for less than a pass, are a wait; the first stalled check a pass after the best stops."""
    stop = Plateau(patience=1, metric="m", min_steps=15, min_gap=20)
    checks = [(5, 2.0), (10, 1.0), (15, 1.0), (20, 1.0), (25, 1.0), (30, 3.0), (40, 1.0), (50, 1.0)]
    got = [stop.update(s, {"eval/x/m": v}) for s, v in checks]
    assert got == ["best", "wait", "wait", "wait", "stop", "best", "wait", "stop"]


def test_deadline_passes_once_its_minutes_have_gone_and_never_without_a_budget():
    now = [100.0]
    budget = Deadline(1.5, clock=lambda: now[0])  # the clock starts when the budget is made
    now[0] = 189.9
    assert not budget.passed()
    now[0] = 190.0  # 90 s = 1.5 minutes
    assert budget.passed() and budget.elapsed_minutes() == pytest.approx(1.5)
    now[0] = 10**9
    assert not Deadline(None, clock=lambda: now[0]).passed()
    for bad in (0, -1.0):
        with pytest.raises(ValueError, match="must be above 0"):
            Deadline(bad)
