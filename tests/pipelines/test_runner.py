"""The stage runner: every stage is a ``Stage`` that goes through it, no stage imports another, and the runner's
cache / damage / failure handling on a small stage of the test's own.

Run: python -m pytest tests/pipelines/test_runner.py
"""

import ast
import sys
import textwrap
from pathlib import Path

import pytest

from streakline import pipelines
from streakline.artifacts import read_manifest
from streakline.config import compose_config
from streakline.pipelines.runner import Stage, StageResult, run_stage_object

PIPELINES = Path(pipelines.__file__).parent


@pytest.mark.parametrize("name", list(pipelines.STAGES))
def test_every_stage_is_a_stage_object_with_no_way_around_the_runner(name):
    stage = pipelines.load_stage(name)
    assert isinstance(stage, Stage) and stage.name == name
    module = sys.modules[pipelines.STAGES[name]]
    # A module-level run(cfg) would be a second entry that skips world, validation and the cache.
    assert not callable(getattr(module, "run", None)), f"{name} exposes run(); go through pipelines.run_stage"
    assert type(stage).run is not Stage.run, f"{name} does not implement Stage.run"


@pytest.mark.parametrize("name", list(pipelines.STAGES))
def test_no_stage_module_imports_another(name):
    tree = ast.parse((PIPELINES / f"{name}.py").read_text())
    stages = set(pipelines.STAGES)
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level == 1:  # from .x import ... / from . import x
                names = [module.split(".")[0]] if module else [a.name for a in node.names]
            elif module.startswith("streakline.pipelines."):
                names = [module.split(".")[2]]
            else:
                names = []
            imported |= set(names) & stages
        elif isinstance(node, ast.Import):
            imported |= {a.name.split(".")[2] for a in node.names if a.name.startswith("streakline.pipelines.")}
    assert not imported - {name}, f"stage {name} imports stage modules {sorted(imported)}; use pipelines/common/"


def test_a_module_without_a_stage_object_is_refused(tmp_path, monkeypatch):
    (tmp_path / "bypass_stage.py").write_text("def run(cfg):\n    return {'folder': '/tmp'}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(pipelines.STAGES, "doctor", "bypass_stage")
    with pytest.raises(TypeError, match="must define STAGE"):
        pipelines.run_stage(compose_config(["stage=doctor"]))


class Counting(Stage):
    """A stage with an artifact: writes ``out.txt``; counts how often its recipe really ran."""

    name = "doctor"  # any schema name: the runner keys folders by it
    needs_world = False

    def __init__(self, value="x", fail=False):
        self.value, self.fail, self.runs, self.reports = value, fail, 0, []

    def key(self, cfg):
        return {"value": self.value}

    def damage(self, cfg, folder):
        return None if (folder / "out.txt").read_text() == self.value else "out.txt was edited"

    def run(self, cfg, stage_run):
        self.runs += 1
        path = stage_run.add_output("out.txt")
        path.write_text(self.value)
        if self.fail:
            raise RuntimeError("the recipe failed")
        stage_run.metrics["value"] = self.value
        return StageResult(self.name, stage_run.dir, path, {"value": self.value})

    def reuse(self, cfg, folder):
        return StageResult(self.name, folder, folder / "out.txt", read_manifest(folder).metrics)

    def report(self, result):
        self.reports.append(result.cached)


def test_runner_caches_by_key_redoes_damaged_runs_and_records_failures(tmp_path):
    cfg = compose_config(["stage=doctor", f"run_root={tmp_path}"])
    stage = Counting()
    first = run_stage_object(stage, cfg)
    assert not first.cached and stage.runs == 1 and read_manifest(first.folder).status == "complete"
    again = run_stage_object(stage, cfg)
    assert again.cached and again.folder == first.folder and again.metrics == {"value": "x"} and stage.runs == 1
    assert stage.reports == [False, True]  # the report is printed for fresh and reused results alike

    (first.folder / "out.txt").write_text("edited")  # damaged: redone in the same folder
    redone = run_stage_object(stage, cfg)
    assert not redone.cached and stage.runs == 2 and (first.folder / "out.txt").read_text() == "x"

    other = Counting("y")  # another key: another folder
    assert run_stage_object(other, cfg).folder != first.folder

    broken = Counting("z", fail=True)
    with pytest.raises(RuntimeError, match="the recipe failed"):
        run_stage_object(broken, cfg)
    failed = next(p for p in Path(tmp_path).rglob("manifest.json") if read_manifest(p.parent).status == "failed")
    assert "the recipe failed" in read_manifest(failed.parent).error
    with pytest.raises(RuntimeError):  # a failed run is never reused
        run_stage_object(broken, cfg)
    assert broken.runs == 2


def test_a_stage_must_return_a_stage_result(tmp_path):
    class Loose(Stage):
        name = "doctor"
        needs_world = False

        def run(self, cfg, stage_run):
            return {"folder": "/somewhere"}

    with pytest.raises(TypeError, match="not a StageResult"):
        run_stage_object(Loose(), compose_config(["stage=doctor", f"run_root={tmp_path}"]))


def test_stage_docstrings_say_how_to_run_them():
    for name in pipelines.STAGES:
        doc = ast.get_docstring(ast.parse((PIPELINES / f"{name}.py").read_text())) or ""
        assert f"stage={name}" in textwrap.dedent(doc), f"pipelines/{name}.py's docstring shows no stage={name} line"


def test_a_hub_preset_without_its_files_names_the_download_for_every_stage():
    """A stage that needs a role's tokenizer says the model is not in the local Hugging Face cache and how to fetch
    it, as stage=decode does for the weights (it used to say "set model.verifier.tokenizer=<folder>")."""
    from streakline.models import CheckpointError
    from streakline.pipelines.common.roles import required_tokenizer

    cfg = compose_config(["stage=distill", "model=diffucoder", "model.verifier.hub_id=streakline-tests/absent"])
    with pytest.raises(CheckpointError, match="huggingface-cli download streakline-tests/absent"):
        required_tokenizer(cfg, "verifier", "distill")
