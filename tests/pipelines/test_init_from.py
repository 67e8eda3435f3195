"""stage=distill's ``method=mdm`` and ``trainer.init_from`` on the micro world: a drafter adapted with the
masked-diffusion loss by one run, then distilled from those weights by another, found by its overrides.

    python -m pytest tests/pipelines/test_init_from.py -q
"""

from pathlib import Path

import pytest
import torch

from streakline.artifacts import read_manifest
from streakline.config import ConfigError, compose_config
from streakline.models import load_pretrained
from streakline.pipelines import run_stage
from tests.pipelines.test_distill import _overrides

EXPERIMENT = "distill-init"
SHORT = ["trainer.max_steps=4", "trainer.save_every=4", "trainer.eval_every=4"]
ADAPT = "method=mdm"


def _cfg(root, *extra):
    return compose_config(["stage=distill", *_overrides(root, EXPERIMENT, *SHORT, *extra)])


@pytest.fixture(scope="module")
def world(micro_world):
    root = micro_world[0]
    run_stage(compose_config(["stage=trajectories", *_overrides(root, EXPERIMENT)]))
    return root


def _folders(root) -> set[Path]:
    return set((Path(root) / EXPERIMENT).glob("distill/*"))


def test_a_run_that_is_not_there_is_refused_with_the_command_that_makes_it(world):
    before = _folders(world)
    with pytest.raises(ConfigError, match=r"has not finished; make it first with python launch.py .*method=mdm"):
        run_stage(_cfg(world, "method=ce_streak", "trainer.init_from='distill:method=mdm method.mdm_full_share=0.25'"))
    with pytest.raises(ConfigError, match="not a drafter checkpoint folder"):
        run_stage(_cfg(world, "method=ce_streak", f"trainer.init_from={world}"))
    assert _folders(world) == before


def test_distill_starts_from_the_adapted_drafter_its_overrides_name(world):
    adapted = run_stage(_cfg(world, ADAPT))
    assert read_manifest(adapted.folder).config["method"]["loss"] == "mdm"
    start = load_pretrained(adapted.artifact).state_dict()
    run = run_stage(_cfg(world, "method=ce_streak", f"trainer.init_from='distill:{ADAPT}'"))
    key = read_manifest(run.folder).config
    assert key["drafter"] == str(Path(adapted.artifact).resolve())  # the key holds the folder it started from
    assert "init_from" not in key["trainer"]
    assert run.details["resumed_from"] == 0
    trained = load_pretrained(run.artifact).state_dict()
    assert any(not torch.equal(trained[k], start[k]) for k in start)  # it trained from there
    # the same start named by its path is the same run; so is a run folder for its final drafter
    for named in (adapted.artifact, adapted.folder):
        again = run_stage(_cfg(world, "method=ce_streak", f"trainer.init_from={named}"))
        assert again.cached and again.folder == run.folder
    with pytest.raises(ConfigError, match="set one of them"):
        run_stage(_cfg(world, "method=ce_streak", f"trainer.init_from={named}", f"trainer.resume_from={run.folder}"))
