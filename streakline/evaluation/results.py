"""The evaluation's outputs: ``results.json`` (one record per method x benchmark x temperature) and
``results.md`` (a Table-2-style speedup table, the Fig. 7 points, and the block-diffusion NFE table).

Record fields (``RECORD_FIELDS`` is the schema; tests check every record has them):

- ``method``, ``decoder``, ``family`` (``speculative`` for verifier + drafter, ``block`` for block-diffusion
  targets), ``drafter`` (checkpoint folder or None), ``steps`` (distillation steps of that drafter; 0 for the
  undistilled base drafter; None off Fig. 7), ``benchmark``, ``temperature`` (the verifier's), ``settings`` (K,
  gamma, ``drafter_temperature`` (what the decoder drafts at), rule, budget, prune, ...; for rows with a drafter
  also ``distill_loss``, ``curve`` (an intermediate checkpoint, a Fig. 7 point only), and the temperatures the
  drafter was trained with: ``train_drafter_temperature``, ``data_temperature``, ``data_top_p``, None when
  unknown or not distilled);
- ``prompts``, ``new_tokens``, ``tokens_per_s``, ``speedup`` (tokens/s over the reference's on the same benchmark
  and temperature, measured in the same process: vanilla for ``speculative``, static for ``block``; the
  ``REFERENCE`` map, which ``streakline.decoding.registry`` defines and this module re-exports),
  ``tokens_per_verifier_call``, ``accepted_per_cycle`` (mean accepted streak), ``alpha`` (per-position acceptance),
  ``nfe``, ``nfe_per_token``, ``forward_reduction`` (the reference's NFE per token over this one's);
- ``precision``: what the verifier (for ``block``, the target) ran in, ``fp32``, ``bf16`` or ``fp16``;
- ``lossless`` and ``lossless_check`` (see ``lossless.py``), ``divergence_rate`` (the share of prompts whose
  temperature-0 output left the reference's: 0 when lossless in fp32, near-ties only when lossless in bf16; None
  for sampled rows, whose check is statistical), ``wall_s``;
- ``reference_top_share``, ``reference_top_token``: how much of the reference decoder's temperature-0 output on that
  benchmark is its single most frequent token (None in records from before the field); ``degenerate``: that share
  is above ``stage.degenerate_share`` (default ``DEGENERATE_SHARE``): the verifier repeats one token there, so every
  drafter that learns it looks perfect, and ``headline`` keeps the benchmark out of the headline tables and the
  figures; its rows get a table of their own.

    records = finalize(records)   # fills speedup / forward_reduction from the references
    write_results(out_dir, records, meta)
"""

from __future__ import annotations

import platform
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from streakline.artifacts import package_versions, write_json_atomic, write_text_atomic
from streakline.decoding.registry import REFERENCE

SCHEMA_VERSION = 1
# The default of stage.degenerate_share: a benchmark where one token id is more than this share of the reference's
# greedy output is degenerate. The tiny
# verifier's tiny-code output is 100% newlines; on tiny-math the most frequent token is 18% (a digit); real models'
# outputs on real benchmarks sit far below this too.
DEGENERATE_SHARE = 0.5
RECORD_FIELDS = (
    "method",
    "decoder",
    "family",
    "drafter",
    "steps",
    "benchmark",
    "temperature",
    "settings",
    "prompts",
    "new_tokens",
    "tokens_per_s",
    "speedup",
    "tokens_per_verifier_call",
    "accepted_per_cycle",
    "alpha",
    "nfe",
    "nfe_per_token",
    "forward_reduction",
    "precision",
    "lossless",
    "lossless_check",
    "divergence_rate",
    "wall_s",
)


def hardware() -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_threads": torch.get_num_threads(),
        "device": "cpu",
    }
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
        info["gpus"] = torch.cuda.device_count()
    return info


def versions() -> dict[str, str]:
    return package_versions()


def finalize(records: list[dict]) -> list[dict]:
    """Fill ``speedup`` and ``forward_reduction`` of every record from its family's reference decoder."""
    refs = {
        (r["family"], r["benchmark"], r["temperature"]): r
        for r in records
        if r["decoder"] == REFERENCE[r["family"]] and r.get("drafter") is None
    }
    for r in records:
        ref = refs.get((r["family"], r["benchmark"], r["temperature"]))
        r["speedup"] = r["tokens_per_s"] / ref["tokens_per_s"] if ref and ref["tokens_per_s"] else None
        r["forward_reduction"] = ref["nfe_per_token"] / r["nfe_per_token"] if ref and r["nfe_per_token"] else None
    return records


def degenerate(records: list[dict]) -> dict[tuple[str, str], tuple[float, int]]:
    """``{(family, benchmark): (share, token id)}`` of the degenerate benchmarks (module docstring)."""
    return {
        (r["family"], r["benchmark"]): (r["reference_top_share"], r.get("reference_top_token"))
        for r in records
        if r.get("degenerate")
    }


def headline(records: list[dict]) -> list[dict]:
    """The records of the benchmarks that are not degenerate: what the headline tables and the figures show."""
    return [r for r in records if not r.get("degenerate")]


def distill_loss(record: dict) -> str | None:
    """The loss a row's drafter was distilled with: ``settings.distill_loss``, or ``settings.method`` in records
    written before that key was renamed (sweep histories of earlier nights)."""
    settings = record.get("settings") or {}
    return settings.get("distill_loss") or settings.get("method")


def line_name(loss: str, decoder: str) -> str:
    """The name of a distilled drafter's row and Fig. 7 line: its loss, prefixed with the drafter's kind when that
    is not a standalone diffusion drafter (``dflash:ce_streak``), so both kinds trained with one loss can share a
    table and a figure."""
    return loss if decoder == "diffusion_draft" else f"{decoder.removesuffix('_draft')}:{loss}"


Curves = dict[str, dict[str, list[tuple[int, dict]]]]


def steps_curves(records: list[dict], temperature: float | None = None) -> tuple[float | None, Curves]:
    """Fig. 7's lines as ``(temperature, {benchmark: {loss: [(steps, record), ...]}})``, points sorted by steps.

    The points are the speculative rows with ``steps`` and a speedup at ``temperature`` (None: the lowest
    temperature such rows have, which is where stage=evaluate puts the intermediate checkpoints). A line is named by
    ``line_name`` (the loss, ``dflash:<loss>`` for DFlash drafters). A row at step 0 without a loss is a base
    drafter: it is the first point of every line of its benchmark drawn with the same decoder (the plain base
    drafter starts the plain lines, ``dflash:base`` the DFlash ones). Of several rows of one line and step count
    the last wins (a sweep history is in night order)."""
    rows = [r for r in records if r["family"] == "speculative" and r.get("steps") is not None and r.get("speedup")]
    if temperature is None:
        temperature = min((r["temperature"] for r in rows), default=None)
    curves: Curves = {}
    for bench in sorted({r["benchmark"] for r in rows}):
        lines: dict[str, dict[int, dict]] = defaultdict(dict)
        decoders: dict[str, str] = {}
        starts: dict[str, dict] = {}
        for r in rows:
            if r["benchmark"] != bench or r["temperature"] != temperature:
                continue
            loss = distill_loss(r)
            if loss is None and r["steps"] == 0:
                starts[r["decoder"]] = r
            else:
                name = line_name(loss, r["decoder"]) if loss else r["method"]
                lines[name][r["steps"]] = r
                decoders[name] = r["decoder"]
        if lines:
            for name, points in lines.items():
                if decoders[name] in starts:
                    points.setdefault(0, starts[decoders[name]])
            curves[bench] = {name: sorted(lines[name].items()) for name in sorted(lines)}
    return temperature, curves


def _fmt(x: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "n/a" if x is None else f"{x:{spec}}{suffix}"


def lossless_cell(r: dict) -> str:
    """What a row's lossless column says: ``yes`` (identical to the reference, or the sampled test passed), ``yes,
    k/n near-ties`` (bf16: k of n prompts left the reference at a near-tie of the verifier's top two logits, and
    nowhere else), or ``NO``."""
    if not r["lossless"]:
        return "NO"
    ties = (r.get("lossless_check") or {}).get("near_ties")
    return f"yes, {ties}/{r['prompts']} near-ties" if ties else "yes"


def _speedup_cell(r: dict) -> str:
    return f"{_fmt(r['speedup'], '.2f', 'x')} / {_fmt(r['accepted_per_cycle'])}" + ("" if r["lossless"] else " (LOSSY)")


def _training_note(rows: list[dict]) -> list[str]:
    """One footnote line: the temperatures each distilled drafter of the table was trained with (named by the first
    row that drafts with it)."""
    parts, seen = [], set()
    for r in rows:
        if r.get("drafter") in seen:
            continue
        seen.add(r.get("drafter"))
        s = r["settings"]
        tau, data_t, top_p = (s.get(k) for k in ("train_drafter_temperature", "data_temperature", "data_top_p"))
        if tau is None and data_t is None:
            continue
        data = "" if data_t is None else f" on trajectories sampled at T={data_t:g}"
        data += "" if data_t is None or top_p is None else f", top-p {top_p:g}"
        parts.append(f"{r['method']} tau_q={_fmt(tau, 'g')}{data}")
    if not parts:
        return []
    return ["Training temperatures of the distilled drafters (tau_q: the drafter's, in its loss): "
            + "; ".join(parts) + ".", ""]  # fmt: skip


def _curve_table(records: list[dict]) -> list[str]:
    """The Fig. 7 points as a table: one row per loss and benchmark, one column per step count."""
    temperature, curves = steps_curves(records)
    lines = [(bench, loss, dict(points)) for bench, by_loss in curves.items() for loss, points in by_loss.items()]
    if not lines:
        return []
    steps = sorted({s for _, _, points in lines for s in points})
    head = " | ".join(str(s) for s in steps)
    out = [f"## Speedup vs distillation steps (Fig. 7), T={temperature:g}", "", f"| loss | benchmark | {head} |",
           "|---" * (len(steps) + 2) + "|"]  # fmt: skip
    for bench, loss, points in lines:
        cells = [_speedup_cell(points[s]) if s in points else "" for s in steps]
        out.append(f"| {loss} | {bench} | " + " | ".join(cells) + " |")
    return [*out, "", "Cells: speedup / mean accepted streak; step 0 is the base drafter (dflash:base for the DFlash "
            "lines), before distillation.", ""]  # fmt: skip


def markdown(records: list[dict], meta: dict) -> str:
    """``results.md``: the speedup table (Table 2 style) with a footnote of the distilled drafters' training
    temperatures, the Fig. 7 points (speedup vs distillation steps) when the records hold some, tokens/s per row,
    and the block-diffusion table."""
    lines = [f"# Evaluation: {meta.get('experiment', '')}", ""]
    hw = meta.get("hardware", {})
    lines += [
        f"Hardware: {hw.get('device', '?')}, {hw.get('cpu_threads', '?')} torch threads; "
        f"{meta.get('prompts', '?')} prompts per benchmark, {meta.get('max_new_tokens', '?')} new tokens. "
        "Speedup is tokens/s over vanilla (or static) measured in the same run; streak is the mean number of "
        "accepted draft tokens per verification. Lossless: identical tokens at T=0 (and for every block decoder), "
        "a paired test of verifier log-probs when sampling; with the verifier in bf16, a T=0 output may leave "
        "vanilla's only where the verifier's top two logits tie within bf16 rounding (counted as near-ties).",
        "",
    ]
    for family, title, cell in (
        (
            "speculative",
            "## Speedup and mean accepted streak (Table 2)",
            _speedup_cell,
        ),
        (
            "block",
            "## Block-diffusion target: NFE per token and fewer forwards than static",
            lambda r: (
                f"{_fmt(r['nfe_per_token'], '.3f')} / {_fmt(r['forward_reduction'], '.2f', 'x')}"
                + ("" if r["lossless"] else " (LOSSY)")
            ),
        ),
    ):
        everything = [r for r in records if r["family"] == family]
        rows = headline(everything)
        left_out = [r for r in everything if r.get("degenerate")]
        if not everything:
            continue
        lines += [title, "", *_table(rows, cell)]
        if left_out:
            lines += [*_left_out_note(left_out), *_table(left_out, cell)]
        if family == "speculative":
            table = [r for r in everything if not r["settings"].get("curve")]
            lines += ["Cells: speedup / mean accepted streak.", "", *_training_note(table), *_curve_table(rows)]
        else:
            lines += ["Cells: target forwards per generated token / forward reduction vs static.", ""]
        tps = [r for r in everything if r["tokens_per_s"]]  # every row, the left-out benchmarks' too
        if tps:
            drafted = family == "speculative"  # a tau_d column: the temperature the drafter drafted at
            head = ["method", "benchmark", "T", *(["tau_d"] if drafted else []), "tokens/s",
                    "tokens per verifier call", "lossless"]  # fmt: skip
            lines += ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
            for r in tps:
                tau = r["settings"].get("drafter_temperature")
                cells = [r["method"], r["benchmark"], f"{r['temperature']:g}",
                         *([_fmt(tau, "g") if tau is not None else ""] if drafted else []), f"{r['tokens_per_s']:.1f}",
                         _fmt(r["tokens_per_verifier_call"]), lossless_cell(r)]  # fmt: skip
                lines.append("| " + " | ".join(cells) + " |")
            lines.append("")
            if drafted:
                lines += ["T: the verifier's temperature; tau_d: the drafter's, as it drafted (none for vanilla).", ""]
    return "\n".join(lines)


def _table(rows: list[dict], cell) -> list[str]:
    """Methods x (benchmark, temperature) cells; the checkpoints' points (Fig. 7) have their own table."""
    table = [r for r in rows if not r["settings"].get("curve")]
    columns = sorted({(r["benchmark"], r["temperature"]) for r in table})
    methods = list(dict.fromkeys(r["method"] for r in table))
    by_key = {(r["method"], r["benchmark"], r["temperature"]): r for r in rows}
    head = " | ".join(f"{b} T={t:g}" for b, t in columns)
    lines = [f"| method | {head} |", "|---" * (len(columns) + 1) + "|"]
    for m in methods:
        cells = [cell(by_key[(m, b, t)]) if (m, b, t) in by_key else "" for b, t in columns]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def _left_out_note(rows: list[dict]) -> list[str]:
    notes = []
    for (family, bench), (share, token) in sorted(degenerate(rows).items()):
        ref = REFERENCE[family]
        notes.append(
            f"Left out of the table above and of the figures: **{bench}**, where {share:.0%} of the {ref} decoder's "
            f"greedy output is one token (id {token}). A drafter that learns that token accepts nearly every draft, "
            "so the speedup there says nothing about how well it is aligned. Its rows:"
        )
    return [*notes, ""]


def write_results(out_dir: str | Path, records: list[dict], meta: dict) -> tuple[Path, Path]:
    """Write ``results.json`` and ``results.md`` atomically; returns their paths."""
    missing = [(r.get("method"), f) for r in records for f in RECORD_FIELDS if f not in r]
    if missing:
        raise ValueError(f"records miss fields: {missing[:5]}")
    out = Path(out_dir)
    doc = {"schema": SCHEMA_VERSION, **meta, "records": records}
    write_json_atomic(out / "results.json", doc)
    write_text_atomic(out / "results.md", markdown(records, meta))
    return out / "results.json", out / "results.md"
