"""The scaling report's arithmetic and drawing (stage=scaling, docs/scaling.md): pure functions of distill runs'
``metrics.jsonl`` records, with no model, rank or run folder in sight.

    rows = [{"world_size": n, **throughput(read_metrics(folder / "metrics.jsonl"))} for n, folder in runs]
    add_efficiency(rows)                                        # efficiency against the smallest world size
    points = acceptance_points(records, "decoder_streak")       # [{"step", "label_tokens", "value"}, ...]
    fit = fit_power_law([p["label_tokens"] for p in points], [p["value"] for p in points])   # value = a * x ** b
    throughput_figure(rows, "throughput.png"); acceptance_figure(points_by_loss, fits, "acceptance.png")

scaling.md's text is written from these by ``evaluation/scaling_md.py`` (``write_report``).

Throughput is distill's telemetry (``label_tokens_per_s``, docs/telemetry.md): the median over the logged
intervals after the first, whose time holds the engine's first steps (allocation, the first gather). Scaling
efficiency at world size N is tokens/s per rank over the smallest world size's tokens/s per rank, so ideal scaling
is 1 and the ideal per-rank line is flat. The power law is a least-squares line through (log tokens, log value);
points at or below zero have no logarithm and are left out of the fit (the report counts them).

    python -m pytest tests/evaluation/test_scaling.py -q
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .figures import _save, plt

TOKENS_KEY = "label_tokens_seen"  # the x axis: label tokens of all ranks since step 0 (telemetry)
RATE_KEY = "label_tokens_per_s"
EVAL_PREFIX = "eval/"


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` (one JSON object per line, blank lines skipped)."""
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def throughput(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``label_tokens_per_s``, ``step_time`` and ``samples_per_s`` of a run: medians over its logged training
    intervals after the first (all of them when there is only one); ``intervals`` says how many were used."""
    lines = [r for r in records if r.get(RATE_KEY) is not None]
    if not lines:
        raise ValueError("no training line with label_tokens_per_s in these records")
    used = lines[1:] if len(lines) > 1 else lines
    out: dict[str, Any] = {"intervals": len(used)}
    for key in (RATE_KEY, "step_time", "samples_per_s"):
        values = [float(r[key]) for r in used if r.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    return out


def efficiency(world_sizes: Sequence[int], tokens_per_s: Sequence[float]) -> list[float]:
    """Scaling efficiency of each world size: its tokens/s per rank over the smallest world size's (1 is ideal,
    0.5 means each rank does half the work it did at the smallest size)."""
    if len(world_sizes) != len(tokens_per_s) or not world_sizes:
        raise ValueError("give one tokens/s value per world size")
    base = min(range(len(world_sizes)), key=lambda i: world_sizes[i])
    per_rank_base = tokens_per_s[base] / world_sizes[base]
    return [t / n / per_rank_base for n, t in zip(world_sizes, tokens_per_s, strict=True)]


def add_efficiency(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Sort throughput rows (``world_size``, ``label_tokens_per_s``) by world size and add ``per_rank`` and
    ``efficiency`` to each, in place; returns the rows."""
    rows.sort(key=lambda r: r["world_size"])
    if not rows:  # no throughput part (stage.world_sizes=[])
        return rows
    effs = efficiency([r["world_size"] for r in rows], [r[RATE_KEY] for r in rows])
    for r, e in zip(rows, effs, strict=True):
        r["per_rank"] = r[RATE_KEY] / r["world_size"]
        r["efficiency"] = e
    return rows


def acceptance_points(records: Sequence[dict[str, Any]], metric: str) -> list[dict[str, Any]]:
    """One point per held-out check in a run's records: ``step``, ``label_tokens`` (the label tokens seen at that
    step) and ``value``, the mean over the checked sources of ``eval/<source>/<metric>``.

    The tokens come from the training line of the same step; a check at a step with no training line (when
    ``log_every`` does not divide ``eval_every``) gets them interpolated linearly in steps between the lines around
    it (tokens grow by one global batch's labels a step). A check before any line, or with no tokens, is left out."""
    seen = sorted((int(r["step"]), float(r[TOKENS_KEY])) for r in records if r.get(TOKENS_KEY) is not None)
    by_step: dict[int, list[float]] = {}
    for r in records:
        values = [v for v in per_source(r, metric).values() if finite_number(v)]
        if values:
            by_step.setdefault(int(r["step"]), []).extend(float(v) for v in values)
    points = []
    for step in sorted(by_step):
        tokens = _tokens_at(seen, step)
        if tokens is not None:
            values = by_step[step]
            points.append({"step": step, "label_tokens": tokens, "value": sum(values) / len(values)})
    return points


def check_at(records: Sequence[dict[str, Any]], step: int | None) -> dict[str, Any]:
    """The record of the held-out check a run logged at ``step`` (one with ``eval/`` keys), or {} where none."""
    return next((r for r in records if r.get("step") == step and any(k.startswith(EVAL_PREFIX) for k in r)), {})


def per_source(check: dict[str, Any], name: str) -> dict[str, Any]:
    """``{source: value}`` of a check record's ``eval/<source>/<name>`` keys: each held-out benchmark's value."""
    suffix = f"/{name}"
    keys = [k for k in check if k.startswith(EVAL_PREFIX) and k.endswith(suffix)]
    return {k[len(EVAL_PREFIX) : -len(suffix)]: check[k] for k in keys}


def finite_number(v: Any) -> bool:
    """A real, finite number (not a bool, None or NaN): what a table cell or a plotted point can show."""
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _tokens_at(seen: list[tuple[int, float]], step: int) -> float | None:
    """Label tokens seen at ``step`` from (step, tokens) pairs sorted by step: exact, interpolated or (past the last
    pair) extrapolated at the last pair's tokens per step; None before the first pair."""
    exact = dict(seen)
    if step in exact:
        return exact[step]
    before = [(s, t) for s, t in seen if s < step]
    after = [(s, t) for s, t in seen if s > step]
    if not before:
        return None
    s0, t0 = before[-1]
    if after:
        s1, t1 = after[0]
        return t0 + (t1 - t0) * (step - s0) / (s1 - s0)
    return t0 * step / s0 if s0 > 0 else None


@dataclass(frozen=True)
class PowerLaw:
    """``value = a * tokens ** exponent``, fitted by least squares in log-log over ``points`` points (``dropped``
    were at or below zero); ``r2`` is the fit's coefficient of determination in log space."""

    a: float
    exponent: float
    r2: float | None
    points: int
    dropped: int

    def __call__(self, x: float) -> float:
        return self.a * x**self.exponent

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def fit_power_law(x: Sequence[float], y: Sequence[float]) -> PowerLaw | None:
    """The least-squares line log y = log a + b log x through the points with x > 0 and y > 0, as a
    :class:`PowerLaw`; None when fewer than two distinct x remain (no slope to fit)."""
    if len(x) != len(y):
        raise ValueError(f"{len(x)} x values but {len(y)} y values")
    kept = [(math.log(a), math.log(b)) for a, b in zip(x, y, strict=True) if a > 0 and b > 0]
    dropped = len(x) - len(kept)
    if len({lx for lx, _ in kept}) < 2:
        return None
    n = len(kept)
    mx = sum(lx for lx, _ in kept) / n
    my = sum(ly for _, ly in kept) / n
    sxx = sum((lx - mx) ** 2 for lx, _ in kept)
    sxy = sum((lx - mx) * (ly - my) for lx, ly in kept)
    b = sxy / sxx
    intercept = my - b * mx
    ss_tot = sum((ly - my) ** 2 for _, ly in kept)
    ss_res = sum((ly - intercept - b * lx) ** 2 for lx, ly in kept)
    r2 = 1 - ss_res / ss_tot if ss_tot > 0 else None  # every y equal: a flat line fits exactly, R^2 undefined
    return PowerLaw(a=math.exp(intercept), exponent=b, r2=r2, points=n, dropped=dropped)


# ------------------------------------------------------------------------------------------------ figures
def throughput_figure(rows: Sequence[dict[str, Any]], path: str | Path) -> Path | None:
    """Two panels against world size: label tokens/s per rank with the ideal (flat at the smallest world size's)
    line, and scaling efficiency with the ideal line at 1. ``rows`` as :func:`add_efficiency` leaves them."""
    if not rows:
        return None
    sizes = [r["world_size"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(sizes, [r["per_rank"] for r in rows], marker="o", label="measured")
    left.axhline(rows[0]["per_rank"], color="grey", ls="--", lw=1, label="ideal (linear scaling)")
    left.set(xlabel="world size (ranks)", ylabel="label tokens/s per rank", title="Throughput per rank")
    left.set_ylim(bottom=0)
    right.plot(sizes, [r["efficiency"] for r in rows], marker="o", label="measured")
    right.axhline(1.0, color="grey", ls="--", lw=1, label="ideal")
    right.set(xlabel="world size (ranks)", ylabel="scaling efficiency", title="Scaling efficiency")
    right.set_ylim(0, max(1.1, max(r["efficiency"] for r in rows) * 1.1))
    for ax in (left, right):
        ax.set_xticks(sizes)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)


def acceptance_figure(
    points: dict[str, list[dict[str, Any]]],
    fits: dict[str, PowerLaw | None],
    path: str | Path,
    metric: str,
    *,
    by_tokens: bool = False,
) -> Path | None:
    """The held-out ``metric`` against label tokens seen (log x), one colour per loss, one marker per data size
    (``points[loss]`` entries carry ``data_size``), and each loss's fitted power law with its exponent.
    ``by_tokens``: each point is one run on a subset of that many training tokens (``stage.token_sizes``), so x is
    the subset's size and the markers say nothing more."""
    if not any(points.values()):
        return None
    markers = "o" if by_tokens else "osD^vP*X"
    sizes = sorted({p["data_size"] for pts in points.values() for p in pts})
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (loss, pts) in enumerate(points.items()):
        color = f"C{i}"
        for j, size in enumerate(sizes):
            for prior in (False, True):  # an earlier sitting's point (stage.ledger or stage.prior) is drawn hollow
                mine = [p for p in pts if p["data_size"] == size and bool(p.get("prior")) == prior]
                if mine:
                    face = "none" if prior else color
                    ax.scatter([p["label_tokens"] for p in mine], [p["value"] for p in mine], s=28, alpha=0.8,
                               marker=markers[j % len(markers)], edgecolors=color, facecolors=face)  # fmt: skip
        fit = fits.get(loss)
        label = loss if fit is None else f"{loss}: {fit.a:.3g} x^{fit.exponent:.3f}"
        xs = sorted(p["label_tokens"] for p in pts if p["label_tokens"] > 0)
        if fit is not None and xs:
            grid = [xs[0] * (xs[-1] / xs[0]) ** (k / 49) for k in range(50)]
            ax.plot(grid, [fit(x) for x in grid], color=color, lw=1.5, label=label)
        else:
            ax.plot([], [], color=color, label=f"{label} (no fit)")
    if any(p.get("prior") for pts in points.values() for p in pts):
        label = "earlier sitting (stage.ledger / stage.prior)"
        ax.scatter([], [], marker="o", s=28, edgecolors="black", facecolors="none", label=label)
    for j, size in enumerate([] if by_tokens else sizes):  # the marker legend: data sizes, in black
        ax.scatter([], [], color="black", marker=markers[j % len(markers)], s=28, label=f"{size} prompts")
    ax.set_xscale("log")
    xlabel = "training tokens (the subset's completion tokens, log)" if by_tokens else "label tokens seen (log)"
    ax.set(xlabel=xlabel, ylabel=f"held-out {metric}", title="Mean accepted streak against training tokens")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return _save(fig, path)


# ------------------------------------------------------------------------------------------------ wall clock
LOOKUP_SUFFIX = "+lookup"  # a point's drafter behind prompt lookup (decoder=dflash_lookup): a line of its own


def point_name(point: dict[str, Any], lookup: bool = False) -> str:
    """The evaluate row of a point's drafter: ``<label>@<tokens>``; behind prompt lookup ``<label>+lookup@<tokens>``."""
    return f"{point['method']}{LOOKUP_SUFFIX if lookup else ''}@{point['data_size']}"


def panel_key(benchmark: str, temperature: float) -> str:
    """The key of one speedup panel, ``<benchmark>/T<temperature>`` (``humaneval/T0``): of ngram's bars in a report,
    of the manifest's headline metrics, and of a prior file's bars, however the temperature was written."""
    return f"{benchmark}/T{float(temperature):g}"


def wall_clock_rows(records: Sequence[dict[str, Any]], points: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The data-scaling study's decode results (``stage.evaluate``: evaluate records whose ``method`` is
    ``<label>@<tokens>``, beside ``vanilla`` and ``ngram``) as ``{"rows": [...], "ngram": {...}}``: one row per
    point, benchmark and temperature (label, tokens, speedup over vanilla, accepted tokens a cycle, the lossless
    verdict, the prompts decoded, ngram's speedup in the same run and the run's folder where the record names it),
    and ngram's speedup per (benchmark, temperature), the training-free bar. A point's drafter decoded behind prompt
    lookup (``<label>+lookup@<tokens>``, dflash_lookup) is a line of its own, ``<label>+lookup``."""
    where = {
        point_name(p, lookup): (p, p["method"] + (LOOKUP_SUFFIX if lookup else ""))
        for pts in points.values()
        for p in pts
        for lookup in (False, True)
    }
    ngram = {panel_key(r["benchmark"], r["temperature"]): r.get("speedup") for r in records if r["method"] == "ngram"}
    rows = []
    for r in records:
        if r["method"] not in where:
            continue
        p, line = where[r["method"]]
        rows.append({
            "method": line, "data_size": p["data_size"], "benchmark": r["benchmark"],
            "temperature": r["temperature"], "speedup": r.get("speedup"),
            "accepted_per_cycle": r.get("accepted_per_cycle"), "lossless": r.get("lossless"),
            "check": (r.get("lossless_check") or {}).get("check"), "prompts": r.get("prompts"),
            "ngram": ngram.get(panel_key(r["benchmark"], r["temperature"])),
            **({"evaluate": r["evaluate"]} if r.get("evaluate") else {}),
        })  # fmt: skip
    rows.sort(key=lambda x: (x["benchmark"], x["temperature"], x["method"], x["data_size"]))
    return {"rows": rows, "ngram": ngram}


def row_at(row: dict[str, Any]) -> tuple[str, int, str, float]:
    """What a decoded row is of: (line, training tokens, benchmark, temperature); one row each in a report."""
    return row["method"], int(row["data_size"]), row["benchmark"], float(row["temperature"])


def with_prior_rows(wall: dict[str, Any], prior: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``wall`` (:func:`wall_clock_rows`) and every row of ``prior`` (earlier sittings' decodes, each marked
    ``prior``) of a line, size, benchmark and temperature ``wall`` has none of: what decodes now wins, then the first
    prior. A (benchmark, temperature) this sitting did not decode takes its ngram bar from the run that decoded its
    largest training size there, the side-by-side comparison that decides whether the best drafter beats ngram."""
    have, rows, ngram = {row_at(r) for r in wall["rows"]}, list(wall["rows"]), dict(wall["ngram"])
    largest: dict[str, int] = {}  # a panel without this report's bar: the run that decoded its largest size gives it
    for r in prior:
        if row_at(r) in have:
            continue
        have.add(row_at(r))
        rows.append(r)
        key = panel_key(r["benchmark"], r["temperature"])
        if r.get("ngram") is not None and key not in wall["ngram"] and r["data_size"] > largest.get(key, -1):
            ngram[key], largest[key] = r["ngram"], r["data_size"]
    rows.sort(key=lambda x: (x["benchmark"], x["temperature"], x["method"], x["data_size"]))
    return {"rows": rows, "ngram": ngram}


def ngram_span(wall: dict[str, Any], bench: str, temperature: float) -> tuple[float, float] | None:
    """The lowest and highest ngram speedup of the decode runs behind a panel's rows (each row carries its run's),
    with the report's bar: rows of several sittings were each timed against their own vanilla and ngram."""
    bars = [r.get("ngram") for r in wall["rows"] if (r["benchmark"], r["temperature"]) == (bench, temperature)]
    bars = [b for b in [*bars, wall["ngram"].get(panel_key(bench, temperature))] if finite_number(b)]
    return (min(bars), max(bars)) if bars else None


def speedup_figure(wall: dict[str, Any], path: str | Path) -> Path | None:
    """Wall-clock speedup over vanilla against training tokens (log x), one panel per benchmark at each verifier
    temperature, one line per loss, with the break-even line at 1.0 and ngram's speedup (the training-free bar)."""
    rows = wall["rows"]
    if not rows:
        return None
    panels = sorted({(r["benchmark"], r["temperature"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    labels = sorted({r["method"] for r in rows})
    for ax, (bench, temperature) in zip(axes[0], panels, strict=True):
        for i, label in enumerate(labels):
            mine = sorted((r["data_size"], r["speedup"]) for r in rows
                          if (r["benchmark"], r["temperature"], r["method"]) == (bench, temperature, label)
                          and r["speedup"] is not None)  # fmt: skip
            if mine:
                ax.plot([x for x, _ in mine], [y for _, y in mine], marker="o", color=f"C{i}", label=label)
        ax.axhline(1.0, color="grey", lw=1, label="break-even (vanilla)")
        bar, span = wall["ngram"].get(panel_key(bench, temperature)), ngram_span(wall, bench, temperature)
        if bar is not None:
            ax.axhline(bar, color="black", ls="--", lw=1, label=f"ngram (no training): {bar:.2f}x")
        if span is not None and span[1] > span[0]:  # decodes of several sittings: each run's own ngram
            ax.axhspan(*span, color="black", alpha=0.08, label=f"ngram, the decode runs: {span[0]:.2f}-{span[1]:.2f}x")
        for r in rows:  # an earlier sitting's decode: hollow, so the reader sees which runs the line joins
            if (r["benchmark"], r["temperature"]) == (bench, temperature) and r.get("prior") and r["speedup"]:
                ax.plot(r["data_size"], r["speedup"], marker="o", mfc="white", color=f"C{labels.index(r['method'])}")
        ax.set_xscale("log")
        sizes = sorted({r["data_size"] for r in rows if (r["benchmark"], r["temperature"]) == (bench, temperature)})
        ax.set_xticks(sizes, [f"{n:,}" for n in sizes], minor=False)  # the sizes decoded, not a log grid's
        ax.set_xticks([], minor=True)
        ax.set(xlabel="training tokens (log)", ylabel="speedup over vanilla (wall clock)",
               title=f"{bench}, T={temperature:g}")  # fmt: skip
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    return _save(fig, path)


def slot_points(acceptance: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The points whose per-slot acceptance the report compares: of the largest training size at which two or more
    lines have a point with ``slots`` (each line's lowest seed there), else of the largest size with any; [] where
    no point has them (an earlier sitting's transcribed points, say)."""
    have = [p for p in acceptance if p.get("slots")]
    lines_at: dict[int, set[str]] = {}
    for p in have:
        lines_at.setdefault(p["data_size"], set()).add(p["method"])
    if not lines_at:
        return []
    shared = [n for n, lines in lines_at.items() if len(lines) > 1]
    size = max(shared or lines_at)
    first: dict[str, dict[str, Any]] = {}
    for p in sorted((p for p in have if p["data_size"] == size), key=lambda p: p["seed"]):
        first.setdefault(p["method"], p)
    return list(first.values())


def slot_figure(points: Sequence[dict[str, Any]], path: str | Path) -> Path | None:
    """Per-slot acceptance (``alpha_j``: accepted at slot j over the cycles that reached j) at each point's best
    held-out check, one panel per benchmark, one line per point (:func:`slot_points`)."""
    sources = sorted({src for p in points for src in p["slots"]})
    if not sources:
        return None
    fig, axes = plt.subplots(1, len(sources), figsize=(5.5 * len(sources), 4), squeeze=False)
    for ax, src in zip(axes[0], sources, strict=True):
        for i, p in enumerate(points):
            reached = [(j + 1, a) for j, a in enumerate(p["slots"].get(src) or []) if finite_number(a)]
            if reached:
                ax.plot(*zip(*reached, strict=True), marker="o", color=f"C{i}", label=p["method"])
        ax.set(xlabel="draft slot j", ylabel="alpha_j (accepted / reached)", ylim=(0, 1.02),
               title=f"{src}, {points[0]['data_size']:,} training tokens")  # fmt: skip
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, path)
