"""The dashboard definition (streakline/alignment/dashboard.py): every panel plots metrics a real run logs to W&B
(read back from an offline run's transaction log), and the definition builds a wandb_workspaces Workspace without
the network.

    python -m pytest tests/alignment/test_dashboard.py -q
"""

import pytest

from streakline.alignment.dashboard import SECTIONS, matches, panels, workspace
from streakline.alignment.telemetry import GPU_ONLY_KEYS, PHASES


def test_every_panel_is_fed_by_a_logged_metric(offline_run):
    history, config = offline_run["history"], offline_run["config"]
    for panel in panels():
        for key in panel.metrics():
            # a CPU run logs no CUDA memory and no MFU (no device peak); the telemetry module names them
            assert key in history or key in GPU_ONLY_KEYS, (panel.title, key)
        if panel.regex:
            assert matches(panel, history), (panel.title, panel.regex)
        if panel.kind == "scatter":  # x is a config key of the run's shape, "run.<key>"
            section, key = panel.x.split(".", 1)
            assert key in config[section], panel.x
    # per-slot series: one per slot of the window (gamma 4), from the loss and from the evaluation
    by_title = {p.title: p for p in panels()}
    assert len(matches(by_title["q_j(x_j) per slot"], history)) == 4
    assert len(matches(by_title["alpha_j per source and slot"], history)) == 4
    # the phase split plots every phase the telemetry logs
    assert by_title["seconds per step by phase"].y == tuple(f"time/{p}" for p in PHASES)


def test_the_definition_builds_a_workspace_offline():
    pytest.importorskip("wandb_workspaces", reason="pip install 'streakline[dashboard]'")
    built = workspace("some-entity", "streakline-some-experiment")
    assert [s.name for s in built.sections] == [title for title, _ in SECTIONS]
    for section, (_, defined) in zip(built.sections, SECTIONS, strict=True):
        assert [p.title for p in section.panels] == [p.title for p in defined]
    stacked = [p for s in built.sections for p in s.panels if getattr(p, "plot_type", None) == "stacked-area"]
    assert [p.title for p in stacked] == ["seconds per step by phase"]


def test_creating_it_without_the_extra_or_a_key_ends_in_one_line(tmp_path):
    """Without ``wandb-workspaces`` (this environment) the command names the install; with it and no API key it
    names the key: one line on stderr, status 2, no traceback, nothing created."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(tmp_path), WANDB_CONFIG_DIR=str(tmp_path), WANDB_MODE="online")
    proc = subprocess.run(
        [sys.executable, "-m", "streakline.alignment.dashboard", "--entity", "e", "--project", "p"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dashboard: "), proc.stderr
    assert "pip install 'streakline[dashboard]'" in lines[0] or "WANDB_API_KEY" in lines[0]
    assert list(tmp_path.iterdir()) == [] or all(p.name.startswith(".") for p in tmp_path.iterdir())
