"""The evaluation's outputs: ``results.json`` (one record per method x benchmark x temperature) and
``results.md`` (a Table-2-style speedup table and the block-diffusion NFE table).

Record fields (``RECORD_FIELDS`` is the schema; tests check every record has them):

- ``method``, ``decoder``, ``family`` (``speculative`` for verifier + drafter, ``block`` for block-diffusion
  targets), ``drafter`` (checkpoint folder or None), ``steps`` (distillation steps of that drafter, or None),
  ``benchmark``, ``temperature``, ``settings`` (K, gamma, drafter temperature, rule, budget, prune, ...);
- ``prompts``, ``new_tokens``, ``tokens_per_s``, ``speedup`` (tokens/s over the reference's on the same benchmark
  and temperature, measured in the same process: vanilla for ``speculative``, static for ``block``; the
  ``REFERENCE`` map, which ``streakline.decoding.registry`` defines and this module re-exports),
  ``tokens_per_verifier_call``, ``accepted_per_cycle`` (mean accepted streak), ``alpha`` (per-position acceptance),
  ``nfe``, ``nfe_per_token``, ``forward_reduction`` (the reference's NFE per token over this one's);
- ``lossless`` and ``lossless_check`` (see ``lossless.py``), ``wall_s``.

    records = finalize(records)   # fills speedup / forward_reduction from the references
    write_results(out_dir, records, meta)
"""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

import torch

from streakline.artifacts import package_versions, write_json_atomic, write_text_atomic
from streakline.decoding.registry import REFERENCE

SCHEMA_VERSION = 1
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
    "lossless",
    "lossless_check",
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


def _fmt(x: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "n/a" if x is None else f"{x:{spec}}{suffix}"


def markdown(records: list[dict], meta: dict) -> str:
    """``results.md``: the speedup table (Table 2 style) and the block-diffusion table."""
    lines = [f"# Evaluation: {meta.get('experiment', '')}", ""]
    hw = meta.get("hardware", {})
    lines += [
        f"Hardware: {hw.get('device', '?')}, {hw.get('cpu_threads', '?')} torch threads; "
        f"{meta.get('prompts', '?')} prompts per benchmark, {meta.get('max_new_tokens', '?')} new tokens. "
        "Speedup is tokens/s over vanilla (or static) measured in the same run; streak is the mean number of "
        "accepted draft tokens per verification. Lossless: identical tokens at T=0 (and for every block decoder), "
        "a paired test of verifier log-probs when sampling.",
        "",
    ]
    for family, title, cell in (
        (
            "speculative",
            "## Speedup and mean accepted streak (Table 2)",
            lambda r: (
                f"{_fmt(r['speedup'], '.2f', 'x')} / {_fmt(r['accepted_per_cycle'])}"
                + ("" if r["lossless"] else " (LOSSY)")
            ),
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
        rows = [r for r in records if r["family"] == family]
        if not rows:
            continue
        columns = sorted({(r["benchmark"], r["temperature"]) for r in rows})
        methods = list(dict.fromkeys(r["method"] for r in rows))
        by_key = {(r["method"], r["benchmark"], r["temperature"]): r for r in rows}
        head = " | ".join(f"{b} T={t:g}" for b, t in columns)
        lines += [title, "", f"| method | {head} |", "|---" * (len(columns) + 1) + "|"]
        for m in methods:
            cells = [cell(by_key[(m, b, t)]) if (m, b, t) in by_key else "" for b, t in columns]
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
        lines.append("")
        if family == "speculative":
            lines += ["Cells: speedup / mean accepted streak.", ""]
        else:
            lines += ["Cells: target forwards per generated token / forward reduction vs static.", ""]
        tps = [r for r in rows if r["tokens_per_s"]]
        if tps:
            lines += ["| method | benchmark | T | tokens/s | tokens per verifier call | lossless |", "|---" * 6 + "|"]
            for r in tps:
                lines.append(
                    f"| {r['method']} | {r['benchmark']} | {r['temperature']:g} | {r['tokens_per_s']:.1f} | "
                    f"{_fmt(r['tokens_per_verifier_call'])} | {'yes' if r['lossless'] else 'NO'} |"
                )
            lines.append("")
    return "\n".join(lines)


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
