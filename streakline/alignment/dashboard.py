"""The distill dashboard as code: a W&B workspace laying out what a run logs (alignment/trainer.py, telemetry.py).

    python -m streakline.alignment.dashboard --entity ENTITY --project streakline-EXPERIMENT   # creates it (online)
    python -m streakline.alignment.dashboard --entity E --project P --dry-run                  # prints the panels

``SECTIONS`` is the definition, plain data: each panel names the metrics it plots exactly as W&B holds them (the
tracker flattens a per-slot list ``q_mean_j`` into ``q_mean_j/1``, ``q_mean_j/2``, ...), or a regular expression
for series that depend on the run (per held-out source, per slot), and its x-axis. ``workspace`` turns it into a
``wandb_workspaces`` Workspace (``pip install 'streakline[dashboard]'``); only ``save`` goes to the network. The
W&B project of an experiment is ``<trainer.wandb_project>-<experiment>`` (``tracking.experiment_project``).

    python -m pytest tests/alignment/test_dashboard.py -q   # every panel is fed by a metric a real run logs
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Panel:
    """One plot. ``kind="line"``: ``y`` (and the series ``regex`` matches) against the history metric ``x``
    (``"Step"``: the optimizer step); ``stacked`` stacks them (the phase split). ``kind="scatter"``: one point per
    run, ``x`` a config key and ``y[0]`` a summary metric (the scaling view across runs)."""

    title: str
    y: tuple[str, ...] = ()
    regex: str | None = None
    x: str = "Step"
    log_x: bool = False
    stacked: bool = False
    kind: str = "line"

    def metrics(self) -> tuple[str, ...]:
        """The exact metric names plotted, the x-axis included (not ``"Step"``, which W&B keeps itself)."""
        return self.y + ((self.x,) if self.x != "Step" and self.kind == "line" else ())


PHASE_KEYS = tuple(f"time/{p}" for p in ("data", "teacher", "drafter", "optimizer", "checkpoint", "other"))

SECTIONS: tuple[tuple[str, tuple[Panel, ...]], ...] = (
    (
        "Training",
        (
            Panel("loss", ("loss",)),
            Panel("gradient norm (before clipping)", ("grad_norm",)),
            Panel("learning rate", ("lr",)),
            Panel("drafter's own expected streak", ("streak_q",)),
        ),
    ),
    (
        "Throughput",
        (
            Panel("label tokens/s (all ranks)", ("label_tokens_per_s",)),
            Panel("label tokens/s per rank", ("label_tokens_per_s_per_rank",)),
            Panel("samples/s", ("samples_per_s",)),
            Panel("seconds per step", ("step_time",)),
            Panel("model FLOPs utilisation", ("mfu",)),
            Panel("model TFLOP/s (all ranks)", ("tflops_per_s",)),
            Panel(
                "throughput per rank against world size",
                ("label_tokens_per_s_per_rank",),
                x="run.world_size",
                kind="scatter",
            ),  # fmt: skip
        ),
    ),
    (
        "Memory",
        (
            Panel("peak memory, fullest rank (GiB)", ("memory/peak_allocated_gb", "memory/peak_reserved_gb")),
            Panel("peak resident set, CPU runs (GiB)", ("memory/peak_rss_gb",)),
        ),
    ),
    ("Where a step's time goes", (Panel("seconds per step by phase", PHASE_KEYS, stacked=True),)),
    (
        "Streak and acceptance",
        (
            Panel("q_j(x_j) per slot", regex=r"^q_mean_j/\d+$"),
            Panel("simulated streak per source", regex=r"^eval/.+/sim_streak$"),
            Panel("verifier-soft streak per source", regex=r"^eval/.+/soft_streak$"),
            Panel("decoder accepted streak per source", regex=r"^eval/.+/decoder_streak$"),
            Panel("alpha_j per source and slot", regex=r"^eval/.+/alpha/\d+$"),
            Panel(
                "accepted streak against training tokens",
                regex=r"^eval/.+/decoder_streak$",
                x="label_tokens_seen",
                log_x=True,
            ),  # fmt: skip
        ),
    ),
)


def panels() -> list[Panel]:
    return [p for _, ps in SECTIONS for p in ps]


def matches(panel: Panel, keys: set[str]) -> set[str]:
    """The logged ``keys`` the panel's ``regex`` selects (empty without one)."""
    return {k for k in keys if re.search(panel.regex, k)} if panel.regex else set()


def workspace(entity: str, project: str, name: str = "streakline distill"):
    """The ``wandb_workspaces`` Workspace of ``SECTIONS`` for ``entity/project``; built offline, ``.save()``
    creates it. ImportError with the install command when ``wandb-workspaces`` is missing."""
    try:
        import wandb_workspaces.reports.v2 as wr
        import wandb_workspaces.workspaces as ws
    except ImportError as e:
        raise ImportError("the dashboard needs wandb-workspaces: pip install 'streakline[dashboard]'") from e

    def build(p: Panel):
        if p.kind == "scatter":
            return wr.ScatterPlot(title=p.title, x=wr.Config(p.x), y=wr.SummaryMetric(p.y[0]))
        return wr.LinePlot(
            title=p.title, x=p.x, y=list(p.y), metric_regex=p.regex, log_x=p.log_x or None,
            plot_type="stacked-area" if p.stacked else "line",
        )  # fmt: skip

    sections = [ws.Section(name=title, panels=[build(p) for p in ps], is_open=True) for title, ps in SECTIONS]
    return ws.Workspace(name=name, entity=entity, project=project, sections=sections)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entity", required=True, help="W&B entity (user or team)")
    parser.add_argument("--project", required=True, help="W&B project, e.g. streakline-<experiment>")
    parser.add_argument("--name", default="streakline distill", help="the workspace's name")
    parser.add_argument("--dry-run", action="store_true", help="print the panels; create nothing")
    args = parser.parse_args(argv)
    if args.dry_run:
        for title, ps in SECTIONS:
            print(f"{title}: " + "; ".join(f"{p.title} [{', '.join(p.metrics() + (p.regex,) * bool(p.regex))}]"
                                           for p in ps))  # fmt: skip
        return
    try:
        built = workspace(args.entity, args.project, args.name)
    except ImportError as e:  # without the extra: the install command, not a traceback
        _fail(f"{e}; --dry-run prints the panels without it")
    try:
        built.save()  # the one call that goes to the network: it creates the whole workspace or nothing
    except Exception as e:  # wandb's UsageError (no API key), AuthenticationError (a wrong one), a network error
        why = (str(e).strip().splitlines() or [""])[0][:200]
        _fail(
            f"W&B did not create the workspace ({type(e).__name__}: {why}); set WANDB_API_KEY or run `wandb login`, "
            "check the network, or use --dry-run to print the panels offline"
        )
    print(f"dashboard: created {built.url}")


def _fail(message: str) -> None:
    """One line on stderr and status 2, as every streakline command ends on bad input."""
    print(f"dashboard: {message}", file=sys.stderr)
    raise SystemExit(2)


if __name__ == "__main__":
    main()
