"""Stage dispatch: every stage name maps to a module, and an unbuilt stage stops with a clear message.

Run: python -m pytest tests/pipelines/test_dispatch.py
"""

import subprocess
import sys

import pytest

from streakline import pipelines
from streakline.config import CONF_DIR, compose_config
from streakline.config.schema import STAGES


def test_every_stage_name_has_a_module_path():
    assert tuple(pipelines.STAGES) == STAGES
    assert all(module == f"streakline.pipelines.{name}" for name, module in pipelines.STAGES.items())
    assert "doctor" in pipelines.built_stages()


def test_missing_stage_module_names_the_built_stages(monkeypatch):
    cfg = compose_config(["stage=distill"])
    monkeypatch.setitem(pipelines.STAGES, "distill", "streakline.pipelines._not_a_module")
    with pytest.raises(pipelines.StageNotBuiltError) as info:
        pipelines.run_stage(cfg)
    assert "stage 'distill' is not built yet in this version; built stages: doctor" in str(info.value)


def test_cli_exits_2_on_an_unbuilt_stage(tmp_path):
    unbuilt = [name for name in STAGES if name not in pipelines.built_stages() and name != "pipeline"]
    if not unbuilt:
        pytest.skip("every stage is built")
    launch = CONF_DIR.parent / "launch.py"
    result = subprocess.run(
        [sys.executable, str(launch), f"stage={unbuilt[0]}"], cwd=tmp_path, capture_output=True, text=True
    )
    assert result.returncode == 2
    assert f"stage '{unbuilt[0]}' is not built yet" in result.stderr
