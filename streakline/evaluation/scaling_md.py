"""scaling.md, the scaling study's report: its text from the summary that stage=scaling builds (docs/scaling.md).
The numbers and figures come from ``evaluation/scaling.py``; this module only writes them out, section by section:
throughput per world size, the accepted streak against training tokens (fits, every point, the trajectory sets the
points read), the per-slot comparison, and the wall-clock speedups of the decoded drafters.

    write_report("scaling.md", summary)     # summary: setup, metric, throughput, acceptance, fits, wall_clock, figures

    python -m pytest tests/evaluation/test_scaling.py -q
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from streakline.artifacts import atomic_file

from .scaling import RATE_KEY, finite_number, ngram_span, panel_key, slot_points


def _f(v: Any, spec: str = ".3g") -> str:
    return "-" if v is None else format(v, spec)


def write_report(path: str | Path, summary: dict[str, Any]) -> Path:
    """``scaling.md`` from the summary the stage builds: ``setup`` (what ran), ``throughput`` rows (as
    :func:`add_efficiency` leaves them), ``acceptance`` points (each with ``method`` and ``data_size``), ``fits``
    (loss -> :meth:`PowerLaw.as_dict` or None), ``metric`` and ``figures`` (name -> file beside the report)."""
    s = summary["setup"]
    lines = [f"# Scaling: experiment {s['experiment']}, model={s['model']}", ""]
    if summary["throughput"]:
        lines += _throughput_lines(summary)
    by_tokens = bool(s.get("token_sizes"))
    lines += _acceptance_lines(summary, by_tokens)
    lines += slot_lines(summary) if by_tokens else []
    lines += wall_clock_lines(summary)
    path = Path(path)
    with atomic_file(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def tokens_to_reach(fit: dict[str, Any] | None, value: float) -> float | None:
    """The training tokens at which a fitted power law (``PowerLaw.as_dict``) reaches ``value``: ``(value / a) **
    (1 / b)``; None without a fit or with a flat or falling one (it never gets there)."""
    if fit is None or fit["exponent"] <= 0 or fit["a"] <= 0:
        return None
    return (value / fit["a"]) ** (1 / fit["exponent"])


def _throughput_lines(summary: dict[str, Any]) -> list[str]:
    s = summary["setup"]
    lines = [
        "## Throughput against world size",
        "",
        f"`{s['throughput_method']}` distill runs of {s['throughput_steps']} steps under ZeRO-{s['zero_stage']}, "
        f"{s['global_batch']} examples per optimizer step split over the ranks ({s['device']}, "
        f"{s['launch']}). Label tokens/s is the median of the telemetry's `label_tokens_per_s` over the logged "
        "intervals after the first; efficiency is tokens/s per rank over the smallest world size's (ideal: 1).",
        "",
        "| world size | micro batch | label tokens/s | per rank | efficiency | s per step | run |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in summary["throughput"]:
        lines.append(
            f"| {r['world_size']} | {r['micro_batch']} | {_f(r[RATE_KEY], '.0f')} | {_f(r['per_rank'], '.0f')} | "
            f"{_f(r['efficiency'], '.2f')} | {_f(r['step_time'], '.4f')} | `{Path(r['folder']).name}` |"
        )
    figures = summary.get("figures", {})
    if "throughput" in figures:
        lines += ["", f"![throughput per rank and scaling efficiency]({Path(figures['throughput']).name})"]
    return lines + [""]


def _recipe(arm: dict[str, Any]) -> str:
    """One recipe of the study as the report names it: its lines' prefix, sizes, adaptation and overrides."""
    name = f"`{arm['name']}`" if arm["name"] else "the losses"
    adapt = f", each adapted with `{arm['adapt']}` on its subset first" if arm.get("adapt") else ""
    extra = " ".join(arm["overrides"]) or "none"
    return f"{name} at {arm['sizes']} tokens{adapt}, overrides `{extra}`"


def _seeds(seeds: list[int]) -> str:
    return f"Seed {seeds[0]}." if len(seeds) == 1 else f"Seeds {seeds} at the smallest and the largest size."


def _acceptance_lines(summary: dict[str, Any], by_tokens: bool) -> list[str]:
    s, metric, figures = summary["setup"], summary["metric"], summary.get("figures", {})
    if by_tokens:
        text = (
            f"Held-out `{metric}` of one distill run per loss and training-data size: a nested subset of one "
            "trajectory set holding that many completion tokens (`trainer.train_tokens`; a larger subset holds "
            f"every row of a smaller one), at most {s['steps']} steps, each run's best held-out check (with "
            "`trainer.patience`, where it stopped improving; else its last). "
            f"{_seeds(s['seeds'])} Fit: `{metric} = a * tokens^b`, least squares in log-log over every point of "
            "the loss; the last columns read the fit at 2 and 3. Recipes: "
            + "; ".join(_recipe(a) for a in s.get("arms") or [])
            + "."
        )
    else:
        text = (
            f"Held-out `{metric}` of distill runs of {s['steps']} steps (a check every {s['eval_every']} steps) per "
            "loss and data size (prompts of the trajectories), against the label tokens seen at the check. Fit: "
            f"`{metric} = a * tokens^b`, least squares in log-log over every point of the loss."
        )
    reach = " tokens for 2 | tokens for 3 |" if by_tokens else ""
    lines = ["## Accepted streak against training tokens", "", text, "",
             f"| loss | a | exponent b | R^2 (log) | points | left out (<= 0) |{reach}",
             "|---|---|---|---|---|---|" + ("---|---|" if by_tokens else "")]  # fmt: skip
    for loss, fit in summary["fits"].items():
        if fit is None:
            lines.append(f"| {loss} | - | - | - | - | (fewer than two distinct token counts: no fit) |"
                         + (" - | - |" if by_tokens else ""))  # fmt: skip
            continue
        r2 = "- (every point equal)" if fit["r2"] is None else _f(fit["r2"], ".2f")  # flat: saturated or stuck
        row = f"| {loss} | {_f(fit['a'])} | {_f(fit['exponent'], '.3f')} | {r2} | {fit['points']} | {fit['dropped']} |"
        if by_tokens:
            row += "".join(f" {_f(tokens_to_reach(fit, v), '.3g')} |" for v in (2.0, 3.0))
        lines.append(row)
    if "acceptance" in figures:
        lines += ["", f"![accepted streak against training tokens]({Path(figures['acceptance']).name})"]
    if by_tokens:
        lines += ["", f"| loss | training tokens | seed | steps | {metric} | set | run |", "|---" * 7 + "|"]
        lines += [f"| {p['method']} | {p['data_size']} | {p['seed']} | {p['step']} | {_f(p['value'], '.3f')} | "
                  f"{_set(p) or '-'} | {_run(p)} |" for p in summary["acceptance"]]  # fmt: skip
        lines += _set_lines(summary["acceptance"])
        prior = sorted({p["prior"] for p in summary["acceptance"] if p.get("prior")})
        if prior:
            lines += ["", "Points marked *prior* were measured by an earlier sitting (the files of `stage.ledger` and "
                      f"`stage.prior`: {', '.join(prior)}), where this study has no run of the same line, size and "
                      "seed."]  # fmt: skip
        return lines
    lines += ["", "| loss | prompts | step | label tokens | " + metric + " |", "|---|---|---|---|---|"]
    for p in summary["acceptance"]:
        lines.append(
            f"| {p['method']} | {p['data_size']} | {p['step']} | {_f(p['label_tokens'], '.0f')} | "
            f"{_f(p['value'], '.3f')} |"
        )
    return lines


def _set(point: dict[str, Any]) -> str | None:
    """The key of the trajectory set a point's run read (``set``): the 12 hex digits, also where a hand-written
    ledger entry says it in words ("trajectories 1287dbe58e18: 1,200 prompts ..."); None where nothing says."""
    found = re.search(r"\b[0-9a-f]{12}\b", str(point.get("set") or ""))
    return found.group(0) if found else None


def _set_lines(points: Sequence[dict[str, Any]]) -> list[str]:
    """Where the points read more than one trajectory set, how many read each, and what that means: a larger subset
    holds every row of a smaller one only within one set."""
    # a point that names no set (an old ledger entry) neither makes nor breaks the count
    counts = Counter(key for key in map(_set, points) if key is not None)
    if len(counts) < 2:
        return []
    each = ", ".join(f"`{k}` ({n})" for k, n in counts.items())
    return ["", f"The points read {len(counts)} trajectory sets: {each}. A larger subset holds every row of a smaller "
            "one only within a set. A set's key is its settings and what it read, so another machine, another "
            "precision or another package listing (`pkg-code` follows what is installed) samples another set, "
            "and a line that spans sets changes its data as well as its size from point to point."]  # fmt: skip


def _run(point: dict[str, Any]) -> str:
    """A point's run folder (its key), and where an earlier sitting measured it, that sitting's report."""
    name = f"`{Path(point['folder']).name}`" if point.get("folder") else "-"
    return f"{name} *prior: {point['prior']}*" if point.get("prior") else name


def slot_lines(summary: dict[str, Any]) -> list[str]:
    """scaling.md's per-slot comparison of the lines at the largest size they share (none without ``slots``)."""
    points = slot_points(summary["acceptance"])
    if not points:
        return []
    size, width = points[0]["data_size"], max(len(a) for p in points for a in p["slots"].values())
    lines = ["", f"## Per-slot acceptance at {size:,} training tokens", "",
             "Where along the block each line's drafter loses the streak: `alpha_j`, the drafts accepted at slot j "
             "over the cycles that reached it, at each run's best held-out check (its greedy decode of the held-out "
             "prompts), with the benchmark's simulated streak. A loss that weights the deep slots more shows "
             "there."]  # fmt: skip
    for src in sorted({src for p in points for src in p["slots"]}):
        lines += ["", f"**{src}**", "", "| line | seed | " + " | ".join(f"slot {j + 1}" for j in range(width))
                  + " | streak |", "|---" * (width + 3) + "|"]  # fmt: skip
        for p in points:
            alpha = list(p["slots"].get(src) or [])
            cells = [_f(a, ".2f") if finite_number(a) else "-" for a in alpha + [None] * (width - len(alpha))]
            streak = (p.get("benchmarks") or {}).get(src)
            lines.append(f"| {p['method']} | {p['seed']} | " + " | ".join(cells) + f" | {_f(streak, '.3f')} |")
    if "slots" in summary.get("figures", {}):
        lines += ["", f"![per-slot acceptance]({Path(summary['figures']['slots']).name})"]
    return lines


def wall_clock_lines(summary: dict[str, Any]) -> list[str]:
    """scaling.md's section on the decoded drafters (none without ``stage.evaluate``)."""
    wall = summary.get("wall_clock") or {}
    if not wall.get("rows"):
        return []
    lines = ["", "## Wall-clock speedup against training tokens", "",
             "Each point's drafter (seed 0) decoding held-out prompts with the real decoder (`stage=evaluate`, "
             "`settings.evaluate`), against vanilla on the same prompts, every row checked lossless (in bf16: every "
             "parting from vanilla a near-tie). A cell is the speedup in wall time / the tokens accepted a cycle; "
             "LOSSY marks a row that parted from vanilla beyond the bound. ngram is prompt lookup: no training at "
             "all, the bar a trained drafter must clear."]  # fmt: skip
    rows = wall["rows"]
    if any(r.get("prior") for r in rows):
        lines += ["", "A cell marked * was decoded by an earlier sitting (`stage.ledger`, `stage.prior`), timed "
                  "against vanilla and ngram in its own run; where a panel's rows come from several runs, the range "
                  "of their ngram speedups follows the bar."]  # fmt: skip
    for bench, temperature in sorted({(r["benchmark"], r["temperature"]) for r in rows}):
        mine = [r for r in rows if (r["benchmark"], r["temperature"]) == (bench, temperature)]
        sizes = sorted({r["data_size"] for r in mine})
        cells = {(r["method"], r["data_size"]): r for r in mine}
        bar, span = wall["ngram"].get(panel_key(bench, temperature)), ngram_span(wall, bench, temperature)
        spread = f"; {span[0]:.2f}-{span[1]:.2f}x over the runs" if span and span[1] > span[0] else ""
        lines += [
            "",
            f"**{bench}, T={temperature:g}** (ngram: {_f(bar, '.2f')}x{spread})",
            "",
            "| line | " + " | ".join(f"{n:,}" for n in sizes) + " |",
            "|---" * (len(sizes) + 1) + "|",
        ]
        for label in sorted({r["method"] for r in mine}):
            out = []
            for n in sizes:
                r = cells.get((label, n))
                out.append("-" if r is None else f"{_f(r['speedup'], '.2f')}x / {_f(r['accepted_per_cycle'], '.2f')}"
                           + ("" if r["lossless"] else " LOSSY") + (" *" if r.get("prior") else ""))  # fmt: skip
            lines.append(f"| {label} | " + " | ".join(out) + " |")
    if "speedup" in summary.get("figures", {}):
        lines += ["", f"![wall-clock speedup against training tokens]({Path(summary['figures']['speedup']).name})"]
    return lines
