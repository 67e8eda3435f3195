"""The papers' figures, drawn from evaluation records (``results.json``) with matplotlib (PNG, no display needed).

- ``fig2_acceptance``: per-position acceptance alpha_j vs draft position j, one line per drafter (Fig. 2).
  DFlash drafters' lines are dashed with square markers here and in Fig. 7.
- ``fig5_speedup_vs_k``: speedup vs K at several drafter temperatures (Fig. 5), from the K x tau grid rows; the
  title notes whether the drafts were i.i.d. or argmax-first (``settings.argmax_chain``).
- ``fig7_speedup_vs_steps``: speedup and tokens per verifier call vs distillation steps, one line per
  distillation loss starting at step 0 from the base drafter's row, the AR-drafter baseline as a horizontal line
  (Fig. 7); reads the sweep history as well as one run's records.
- ``dllm_bars``: target forwards per generated token and forward reduction vs static for the block-diffusion
  decoders (the SPOT paper's table as a chart).

Every function takes records and an output path, writes one PNG and returns the path, or returns None when the
records hold nothing to draw (e.g. no grid rows). ``draw_all(records, out_dir)`` draws whatever applies.

    paths = draw_all(json.load(open("results.json"))["records"], "figures/")
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import matplotlib

from streakline.artifacts import atomic_file

from .results import headline, steps_curves

matplotlib.use("Agg")  # before pyplot: no display on a cluster node or CI machine
import matplotlib.pyplot as plt  # noqa: E402


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path, "wb") as f:  # a reader never sees half a PNG
        fig.savefig(f, format="png", dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def _style(decoder: str) -> dict:
    """Line style by drafter kind: DFlash drafters (``dflash_draft``) dashed with squares, the rest solid with dots,
    so the two kinds read apart in one figure whatever their colours."""
    return {"marker": "s", "linestyle": "--"} if decoder == "dflash_draft" else {"marker": "o", "linestyle": "-"}


def _benchmarks(records: list[dict]) -> list[str]:
    return sorted({r["benchmark"] for r in records})


def fig2_acceptance(records: list[dict], path: str | Path, temperature: float = 0.0) -> Path | None:
    """alpha_j vs j for every speculative method with a drafter at ``temperature`` (grid rows left out)."""
    rows = [
        r
        for r in records
        if r["family"] == "speculative"
        and r["temperature"] == temperature
        and r.get("alpha")
        and not r["settings"].get("grid")
        and not r["settings"].get("curve")  # intermediate checkpoints are Fig. 7's
    ]
    if not rows:
        return None
    benches = _benchmarks(rows)
    fig, axes = plt.subplots(1, len(benches), figsize=(5.5 * len(benches), 4), squeeze=False)
    for ax, bench in zip(axes[0], benches, strict=True):
        for r in (r for r in rows if r["benchmark"] == bench):
            alpha = [a for a in r["alpha"] if a is not None]
            if alpha:
                ax.plot(range(1, len(alpha) + 1), alpha, label=r["method"], **_style(r["decoder"]))
        ax.set(title=f"{bench}, T={temperature:g}", xlabel="draft position j", ylabel="acceptance rate alpha_j")
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Per-position acceptance (Fig. 2)")
    return _save(fig, path)


def fig5_drafting(rows: list[dict]) -> str | None:
    """How the grid rows drew their K drafts, read from ``settings.argmax_chain`` (None when no row records it)."""
    modes = {r["settings"].get("argmax_chain") for r in rows}
    if modes == {False}:
        return "drafts: K i.i.d. samples from q at tau_d"
    if modes == {True}:
        return "drafts: argmax-first (chain 0 the argmax, K-1 sampled)"
    if modes == {None}:
        return None  # records from before the setting existed
    return "drafts: mixed (see settings.argmax_chain)"


def fig5_speedup_vs_k(records: list[dict], path: str | Path) -> Path | None:
    """Speedup vs K, one line per drafter temperature, from rows with ``settings.grid``; the title says whether the
    drafts were i.i.d. or argmax-first."""
    rows = [r for r in records if r["settings"].get("grid") and r["speedup"] is not None]
    if not rows:
        return None
    benches = _benchmarks(rows)
    fig, axes = plt.subplots(1, len(benches), figsize=(5.5 * len(benches), 4), squeeze=False)
    for ax, bench in zip(axes[0], benches, strict=True):
        lines: dict[float, list[tuple[int, float]]] = defaultdict(list)
        for r in rows:
            if r["benchmark"] == bench:
                lines[r["settings"]["drafter_temperature"]].append((r["settings"]["K"], r["speedup"]))
        for tau in sorted(lines):
            pts = sorted(lines[tau])
            ax.plot([k for k, _ in pts], [s for _, s in pts], marker="o", label=f"tau_d = {tau:g}")
        ax.axhline(1.0, color="grey", lw=0.8, ls=":")
        ax.set(title=bench, xlabel="drafts per cycle K", ylabel="speedup over vanilla (x)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    title = "Speedup vs K at several drafter temperatures (Fig. 5)"
    note = fig5_drafting(rows)
    fig.suptitle(f"{title}\n{note}" if note else title)
    return _save(fig, path)


def fig7_speedup_vs_steps(records: list[dict], path: str | Path, temperature: float | None = None) -> Path | None:
    """Speedup and tokens per verifier call vs distillation steps, one line per distillation loss; the AR drafter as
    a horizontal line.

    The points are the rows with ``steps`` (``results.steps_curves``): rows of one loss (``settings.distill_loss``,
    or ``settings.method`` in histories written before the rename) form a line, and the base drafter's row (step 0,
    no loss) starts every line. ``temperature``: the verifier temperature drawn; None: the lowest the points have
    (where stage=evaluate puts its intermediate checkpoints)."""
    temperature, curves = steps_curves(records, temperature)
    if not curves:
        return None
    benches = sorted(curves)
    ar_rows = [
        r for r in records
        if r["family"] == "speculative" and r["temperature"] == temperature and r["decoder"] == "ar_draft"
        and r.get("steps") is None and r.get("speedup")
    ]  # fmt: skip
    fig, axes = plt.subplots(2, len(benches), figsize=(5.5 * len(benches), 7), squeeze=False)
    for col, bench in enumerate(benches):
        ar = [r for r in ar_rows if r["benchmark"] == bench]
        for row, (key, label) in enumerate(
            (("speedup", "speedup over vanilla (x)"), ("tokens_per_verifier_call", "tokens per verifier call"))
        ):
            ax = axes[row][col]
            for name, pts in curves[bench].items():
                ax.plot([s for s, _ in pts], [r[key] for _, r in pts], label=name, **_style(pts[-1][1]["decoder"]))
            if ar:
                ax.axhline(ar[-1][key], color="black", ls="--", lw=1, label="AR drafter")
            ax.set(xlabel="distillation steps (0: the base drafter)", ylabel=label)
            if row == 0:
                ax.set_title(f"{bench}, T={temperature:g}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle("Speedup vs distillation steps (Fig. 7)")
    return _save(fig, path)


def dllm_bars(records: list[dict], path: str | Path) -> Path | None:
    """Bars of NFE per token and forward reduction vs static per block decoder, per benchmark and temperature."""
    rows = [r for r in records if r["family"] == "block"]
    if not rows:
        return None
    groups = sorted({(r["benchmark"], r["temperature"]) for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    by = {(r["method"], r["benchmark"], r["temperature"]): r for r in rows}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / max(1, len(methods))
    for i, m in enumerate(methods):
        xs = [g + i * width for g in range(len(groups))]
        for ax, key in zip(axes, ("nfe_per_token", "forward_reduction"), strict=True):
            vals = [(by.get((m, b, t)) or {}).get(key) or 0.0 for b, t in groups]
            ax.bar(xs, vals, width=width, label=m)
    for ax, label in zip(
        axes, ("target forwards per token (lower is better)", "fewer forwards than static (x)"), strict=True
    ):
        ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))])
        ax.set_xticklabels([f"{b}\nT={t:g}" for b, t in groups], fontsize=8)
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    axes[1].axhline(1.0, color="grey", lw=0.8, ls=":")
    axes[0].legend(fontsize=8)
    fig.suptitle("Block-diffusion decoders: forwards per token (SPOT / Spiffy vs draft-free)")
    return _save(fig, path)


FIGURES = {
    "fig2_acceptance.png": fig2_acceptance,
    "fig5_speedup_vs_k.png": fig5_speedup_vs_k,
    "fig7_speedup_vs_steps.png": fig7_speedup_vs_steps,
    "dllm_nfe.png": dllm_bars,
}


def draw_all(records: list[dict], out_dir: str | Path) -> dict[str, Path]:
    """Every figure the records support, under ``out_dir``; returns {file name: path}. Degenerate benchmarks
    (``results.headline``) are left out, as in the headline tables."""
    records = headline(records)
    out = {}
    for name, draw in FIGURES.items():
        path = draw(records, Path(out_dir) / name)
        if path is not None:
            out[name] = path
    return out
