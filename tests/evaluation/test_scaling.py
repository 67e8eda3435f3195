"""The scaling report's arithmetic (streakline/evaluation/scaling.py) on hand-made records: the power-law fit recovers
a known exponent, ideal throughput has efficiency 1, rates skip the first interval, held-out checks get the tokens
seen at their step, and the figures and scaling.md are written. No training here (the stage's end-to-end run is
tests/pipelines/test_scaling.py).

    python -m pytest tests/evaluation/test_scaling.py -q
"""

from __future__ import annotations

import math

import pytest

from streakline.evaluation.scaling import (
    acceptance_figure,
    acceptance_points,
    add_efficiency,
    efficiency,
    fit_power_law,
    per_source,
    slot_figure,
    slot_points,
    speedup_figure,
    throughput,
    throughput_figure,
    wall_clock_rows,
    with_prior_rows,
)
from streakline.evaluation.scaling_md import slot_lines, wall_clock_lines, write_report


def test_the_fit_recovers_a_known_power_law():
    xs = [100.0, 300.0, 1e3, 4e3, 2e4]
    fit = fit_power_law(xs, [2.5 * x**0.37 for x in xs])
    assert fit.exponent == pytest.approx(0.37, abs=1e-12) and fit.a == pytest.approx(2.5, rel=1e-10)
    assert fit.r2 == pytest.approx(1.0) and (fit.points, fit.dropped) == (5, 0)
    assert fit(1e5) == pytest.approx(2.5 * 1e5**0.37)
    falling = fit_power_law(xs, [9.0 * x**-0.5 for x in xs])  # a decay is a negative exponent, not an error
    assert falling.exponent == pytest.approx(-0.5)


def test_the_fit_is_least_squares_in_log_log_and_leaves_out_what_has_no_logarithm():
    # log y = 1 + 0.5 log x, with noise +d, -d at two points: the slope stays 0.5 (symmetric residuals)
    d = 0.1
    xs = [1.0, math.e, math.e**2, math.e**3]
    ys = [math.exp(1 + 0.5 * i + e) for i, e in enumerate((d, -d, -d, d))]
    fit = fit_power_law([*xs, 50.0, 0.0], [*ys, 0.0, 3.0])  # y = 0 and x = 0: left out, counted
    assert fit.exponent == pytest.approx(0.5) and math.log(fit.a) == pytest.approx(1.0)
    assert 0 < fit.r2 < 1 and (fit.points, fit.dropped) == (4, 2)
    assert fit_power_law([10.0, 10.0], [1.0, 2.0]) is None  # one distinct x: no slope
    assert fit_power_law([10.0, 20.0], [0.0, 0.0]) is None
    flat = fit_power_law([10.0, 20.0, 40.0], [2.0, 2.0, 2.0])
    assert flat.exponent == pytest.approx(0.0) and flat.r2 is None
    with pytest.raises(ValueError, match="2 x values but 1 y"):
        fit_power_law([1.0, 2.0], [1.0])


def test_efficiency_is_one_for_ideal_scaling_and_relative_to_the_smallest_world():
    assert efficiency([1, 2, 4], [100.0, 200.0, 400.0]) == pytest.approx([1.0, 1.0, 1.0])
    assert efficiency([1, 2, 4], [100.0, 100.0, 100.0]) == pytest.approx([1.0, 0.5, 0.25])
    assert efficiency([4, 2], [300.0, 200.0]) == pytest.approx([0.75, 1.0])  # the base is world 2, wherever it sits
    rows = add_efficiency([{"world_size": 2, "label_tokens_per_s": 150.0}, {"world_size": 1,
                           "label_tokens_per_s": 100.0}])  # fmt: skip
    assert [(r["world_size"], r["per_rank"], r["efficiency"]) for r in rows] == [(1, 100.0, 1.0), (2, 75.0, 0.75)]
    with pytest.raises(ValueError):
        efficiency([1, 2], [1.0])


def test_throughput_is_the_median_after_the_first_interval():
    lines = [{"step": 5 * i, "label_tokens_per_s": v, "step_time": 1 / v, "samples_per_s": v / 10}
             for i, v in enumerate((10.0, 100.0, 90.0, 120.0), start=1)]  # fmt: skip
    evals = [{"step": 10, "eval/tiny-math/decoder_streak": 1.0}]  # other records are not intervals
    rate = throughput([*lines, *evals])
    assert rate["label_tokens_per_s"] == 100.0 and rate["intervals"] == 3
    assert rate["step_time"] == pytest.approx(1 / 100) and rate["samples_per_s"] == pytest.approx(10.0)
    assert throughput(lines[:1])["label_tokens_per_s"] == 10.0  # one interval: it is all there is
    with pytest.raises(ValueError, match="no training line"):
        throughput(evals)


def test_each_check_gets_the_tokens_seen_at_its_step_and_the_mean_over_sources():
    records = [
        {"step": 10, "loss": 1.0, "label_tokens_seen": 1000},
        {"step": 10, "eval/tiny-math/decoder_streak": 1.0, "eval/tiny-code/decoder_streak": 2.0,
         "eval/tiny-math/sim_streak": 9.0},
        {"step": 20, "loss": 0.9, "label_tokens_seen": 2000},
        {"step": 15, "eval/tiny-math/decoder_streak": 3.0},  # between two lines: interpolated
        {"step": 25, "eval/tiny-math/decoder_streak": 4.0},  # after the last one: at its tokens per step
        {"step": 5, "eval/tiny-math/decoder_streak": 0.5},  # before any line: no tokens, left out
        {"step": 30, "eval/tiny-math/decoder_streak": None},  # no value
    ]  # fmt: skip
    points = acceptance_points(records, "decoder_streak")
    assert points == [
        {"step": 10, "label_tokens": 1000.0, "value": 1.5},
        {"step": 15, "label_tokens": 1500.0, "value": 3.0},
        {"step": 25, "label_tokens": 2500.0, "value": 4.0},
    ]
    assert [p["value"] for p in acceptance_points(records, "sim_streak")] == [9.0]


def test_the_figures_and_the_report(tmp_path):
    measured = ((1, 1000.0), (2, 1600.0), (4, 2000.0))
    rows = add_efficiency([{"world_size": n, "micro_batch": 8 // n, "label_tokens_per_s": t, "step_time": 0.1,
                            "folder": f"/runs/x/distill/h{n}"} for n, t in measured])  # fmt: skip
    xs = [100.0, 200.0, 400.0, 800.0]
    points = {
        "ce_streak": [{"method": "ce_streak", "data_size": d, "step": i, "label_tokens": x, "value": 0.5 * x**0.2}
                      for d in (8, 16) for i, x in enumerate(xs)],
        "distillspec": [{"method": "distillspec", "data_size": 8, "step": 1, "label_tokens": 100.0, "value": 1.0}],
        "fkl": [{"method": "fkl", "data_size": 8, "step": i, "label_tokens": x, "value": 2.0}
                for i, x in enumerate(xs)],
    }  # fmt: skip
    fits = {m: fit_power_law([p["label_tokens"] for p in pts], [p["value"] for p in pts]) for m, pts in points.items()}
    assert fits["distillspec"] is None and fits["ce_streak"].exponent == pytest.approx(0.2)
    figures = {
        "throughput": throughput_figure(rows, tmp_path / "throughput.png"),
        "acceptance": acceptance_figure(points, fits, tmp_path / "acceptance.png", "decoder_streak"),
    }
    for path in figures.values():
        assert path.read_bytes()[:4] == b"\x89PNG"
    assert throughput_figure([], tmp_path / "none.png") is None and not (tmp_path / "none.png").exists()
    setup = {"experiment": "scaling", "model": "micro", "throughput_method": "ce_streak", "throughput_steps": 30,
             "zero_stage": 2, "global_batch": 8, "launch": "ranks by torchrun", "device": "CPU, 2 cores",
             "steps": 160, "eval_every": 20}  # fmt: skip
    summary = {"setup": setup, "metric": "decoder_streak", "throughput": rows,
               "acceptance": [p for pts in points.values() for p in pts],
               "fits": {m: None if f is None else f.as_dict() for m, f in fits.items()},
               "figures": {k: v.name for k, v in figures.items()}}  # fmt: skip
    text = write_report(tmp_path / "scaling.md", summary).read_text()
    assert "| 2 | 4 | 1600 | 800 | 0.80 | 0.1000 | `h2` |" in text
    assert "| 4 | 2 | 2000 | 500 | 0.50 |" in text
    assert "| ce_streak | 0.5 | 0.200 | 1.00 | 8 | 0 |" in text
    assert "| distillspec | - | - | - | - | (fewer than two distinct token counts: no fit) |" in text
    assert "| fkl | 2 | 0.000 | - (every point equal) | 4 | 0 |" in text  # saturated: a flat line, no R^2
    assert "![throughput per rank and scaling efficiency](throughput.png)" in text
    assert "(acceptance.png)" in text


def test_per_slot_acceptance_compares_the_lines_at_the_largest_size_they_share(tmp_path):
    """The per-slot section: the largest size with two lines that have slots (not a larger one with a single line),
    each line's lowest seed there, a column per slot (short lists padded), and the figure."""

    def point(method, size, seed, alpha, streak=None):
        return {"method": method, "data_size": size, "seed": seed, "value": 0.5,
                "benchmarks": {"humaneval": streak}, "slots": {"humaneval": alpha}}  # fmt: skip

    acceptance = [
        point("ce_streak", 100, 0, [0.5, 0.4], 0.7),
        point("dpace", 100, 1, [0.9, 0.8, None], 1.5),  # seed 1 before seed 0 in the list
        point("dpace", 100, 0, [0.6, 0.5, 0.1], 0.8),
        point("ce_streak", 300, 0, [0.7, 0.6, 0.5], 1.2),  # the largest size, but no other line there
        {"method": "dflash_ce", "data_size": 100, "seed": 0, "value": 0.4},  # transcribed: no slots
    ]
    chosen = slot_points(acceptance)
    assert [(p["method"], p["seed"]) for p in chosen] == [("ce_streak", 0), ("dpace", 0)]
    assert [p["method"] for p in slot_points(acceptance[3:])] == ["ce_streak"]  # one line: its largest size
    assert slot_points(acceptance[4:]) == []
    text = "\n".join(slot_lines({"acceptance": acceptance, "figures": {"slots": "slots.png"}}))
    assert "## Per-slot acceptance at 100 training tokens" in text
    assert "| line | seed | slot 1 | slot 2 | slot 3 | streak |" in text
    assert "| ce_streak | 0 | 0.50 | 0.40 | - | 0.700 |" in text
    assert "| dpace | 0 | 0.60 | 0.50 | 0.10 | 0.800 |" in text
    assert "![per-slot acceptance](slots.png)" in text and slot_lines({"acceptance": acceptance[4:]}) == []
    assert slot_figure(chosen, tmp_path / "slots.png").read_bytes()[:4] == b"\x89PNG"
    check = {"step": 6, "eval/humaneval/alpha": [0.5], "eval/tiny-chat/alpha": [0.2], "eval/humaneval/sim_streak": 1}
    assert per_source(check, "alpha") == {"humaneval": [0.5], "tiny-chat": [0.2]}


def test_the_wall_clock_table_has_a_line_per_recipe_and_a_column_per_size():
    """One table per benchmark and temperature; a point that was not decoded is '-', a lossy row says so, and the
    heading carries ngram's bar."""
    rows = [
        {"method": "ce", "data_size": 10, "benchmark": "code", "temperature": 0.0, "speedup": 1.25,
         "accepted_per_cycle": 0.7, "lossless": True},
        {"method": "ce", "data_size": 100, "benchmark": "code", "temperature": 0.0, "speedup": 1.5,
         "accepted_per_cycle": 1.1, "lossless": False},
        {"method": "dp", "data_size": 100, "benchmark": "code", "temperature": 0.0, "speedup": 0.9,
         "accepted_per_cycle": 0.3, "lossless": True},
    ]  # fmt: skip
    text = "\n".join(wall_clock_lines({"wall_clock": {"rows": rows, "ngram": {"code/T0": 1.66}}}))
    assert "**code, T=0** (ngram: 1.66x)" in text and "| line | 10 | 100 |" in text
    assert "| ce | 1.25x / 0.70 | 1.50x / 1.10 LOSSY |" in text and "| dp | - | 0.90x / 0.30 |" in text
    assert wall_clock_lines({"wall_clock": {"rows": [], "ngram": {}}}) == []


def test_wall_clock_rows_read_each_points_drafter_alone_and_behind_prompt_lookup():
    """Evaluate records named <label>@<tokens> and <label>+lookup@<tokens> become rows of the lines <label> and
    <label>+lookup; ngram gives the bar; vanilla and rows of no point are left out."""
    points = {"ce": [{"method": "dflash:ce", "data_size": 10}, {"method": "dflash:ce", "data_size": 100}]}

    def record(method, speedup):
        return {"method": method, "benchmark": "code", "temperature": 0.0, "speedup": speedup,
                "accepted_per_cycle": 0.5, "lossless": True}  # fmt: skip

    records = [
        record("vanilla", 1.0),
        record("ngram", 1.9),
        record("dflash:ce@10", 0.9),
        record("dflash:ce+lookup@10", 1.6),
        record("dflash:ce+lookup@100", 1.8),
        record("other@10", 3.0),
    ]
    wall = wall_clock_rows(records, points)
    assert wall["ngram"] == {"code/T0": 1.9}
    got = {(r["method"], r["data_size"]): r["speedup"] for r in wall["rows"]}
    assert got == {("dflash:ce", 10): 0.9, ("dflash:ce+lookup", 10): 1.6, ("dflash:ce+lookup", 100): 1.8}
    text = "\n".join(wall_clock_lines({"wall_clock": wall}))
    assert "| dflash:ce+lookup | 1.60x / 0.50 | 1.80x / 0.50 |" in text and "| dflash:ce | 0.90x / 0.50 | - |" in text


def test_earlier_sittings_decodes_join_where_this_one_has_none(tmp_path):
    """with_prior_rows: a row this report decoded wins over a prior one of the same line, size, benchmark and
    temperature; the others join, marked * in the table; a panel whose rows come from runs with different ngram
    speedups gives their range; a panel this report did not decode takes its bar from the run of its largest size."""

    def row(size, speedup, ngram, **extra):
        return {"method": "dflash:ce", "data_size": size, "benchmark": "code", "temperature": 0.0, "speedup": speedup,
                "accepted_per_cycle": 0.5, "lossless": True, "ngram": ngram, **extra}  # fmt: skip

    wall = {"rows": [row(300, 1.6, 2.0)], "ngram": {"code/T0": 2.0}}
    prior = [row(300, 9.9, 1.7, prior="ledger.json"), row(30, 1.04, 1.7, prior="ledger.json"),
             {**row(30, 0.8, 1.3, prior="ledger.json"), "benchmark": "chat"},
             {**row(100, 0.9, 1.1, prior="ledger.json"), "benchmark": "chat"}]  # fmt: skip
    merged = with_prior_rows(wall, prior)
    got = {(r["benchmark"], r["data_size"]): r["speedup"] for r in merged["rows"]}
    assert got == {("code", 300): 1.6, ("code", 30): 1.04, ("chat", 30): 0.8, ("chat", 100): 0.9}
    assert merged["ngram"] == {"code/T0": 2.0, "chat/T0": 1.1} and wall["rows"] == [row(300, 1.6, 2.0)]
    text = "\n".join(wall_clock_lines({"wall_clock": merged}))
    assert "**code, T=0** (ngram: 2.00x; 1.70-2.00x over the runs)" in text  # chat's bar: its 100's run
    assert "**chat, T=0** (ngram: 1.10x; 1.10-1.30x over the runs)" in text
    assert "| dflash:ce | 1.04x / 0.50 * | 1.60x / 0.50 |" in text and "A cell marked * was decoded by an" in text
    assert with_prior_rows(wall, []) == wall and "marked *" not in "\n".join(wall_clock_lines({"wall_clock": wall}))
    assert speedup_figure(merged, tmp_path / "speedup.png").read_bytes()[:4] == b"\x89PNG"
