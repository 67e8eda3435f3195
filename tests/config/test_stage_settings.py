"""A stage owns its settings: ``stage=spot`` types ``cfg.stage`` as ``SpotStage``; ``stage.<key>``,
``settings.<stage>.<key>`` (command line or experiment file) and the deprecated ``<stage>.<key>`` all land there, and
a chained stage gets its own. Run: ``python -m pytest tests/config/test_stage_settings.py``."""

import dataclasses

import pytest
from omegaconf import OmegaConf

from streakline.config import ConfigError, compose_config
from streakline.config.overrides import OverrideError
from streakline.config.schema import STAGE_SCHEMAS, EvaluateStage, SpotStage
from streakline.pipelines import load_stage
from streakline.pipelines.common.lookup import stage_overrides, stage_settings


def test_each_stage_with_settings_composes_its_schema_and_the_others_stay_plain():
    for name, schema in STAGE_SCHEMAS.items():
        cfg = compose_config([f"stage={name}"])
        assert OmegaConf.get_type(cfg.stage) is schema and cfg.stage.name == name
        # the schema's defaults, every one (conf/stage/<name>.yaml restates none)
        assert stage_settings(cfg) == {k: v for k, v in dataclasses.asdict(schema()).items() if k != "name"}
    assert set(compose_config(["stage=distill"]).stage) == {"name"}


@pytest.mark.parametrize("form", ["stage.steps=7", "settings.spot.steps=7", "spot.steps=7"])
def test_every_form_sets_the_running_stages_setting(form, capsys):
    cfg = compose_config(["stage=spot", form])
    assert cfg.stage.steps == 7 and cfg.stage.prompts == SpotStage().prompts
    assert ("deprecated" in capsys.readouterr().err) == (form == "spot.steps=7")


def test_the_command_line_wins_over_the_experiment_file_and_other_keys_survive():
    base = compose_config(["stage=evaluate", "experiment=tiny_e2e"])
    assert base.stage.prompts == 5 and list(base.stage.k_grid) == [1, 4]  # from the experiment's settings.evaluate
    cfg = compose_config(["stage=evaluate", "experiment=tiny_e2e", "stage.prompts=7"])
    assert cfg.stage.prompts == 7 and list(cfg.stage.k_grid) == [1, 4]
    assert list(cfg.stage.benchmarks) == EvaluateStage().benchmarks


def test_a_chained_stage_gets_its_own_settings_and_not_the_drivers():
    driver = compose_config(
        ["stage=sweep", "stage.temperature=1.0", "settings.spot.steps=9", "settings.evaluate.prompts=3"]
    )
    spot = compose_config(stage_overrides(driver, "spot stage.prompts=4")[1])
    assert (spot.stage.steps, spot.stage.prompts) == (9, 4)
    evaluation = compose_config(stage_overrides(driver, "evaluate")[1])
    assert evaluation.stage.prompts == 3 and "temperature" not in evaluation.stage
    assert driver.stage.temperature == 1.0


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        (
            ["stage=spot", "stage.stepz=5"],
            OverrideError,
            r"unknown setting 'stepz' of stage=spot.*did you mean 'steps'",
        ),
        (["stage=distill", "stage.steps=5"], OverrideError, "stage=distill has no settings"),
        (["stage.steps=5"], OverrideError, "no stage= was given"),
        (["stage=spot,spiffy", "stage.prompts=5"], OverrideError, "a sweep over stages.*settings.spot.steps"),
        (["stage=spot", "stage.name=evaluate"], OverrideError, "use stage=<name>"),
        (["settings.distill.steps=5"], OverrideError, "no stage 'distill' has settings"),
        (["stage=spot", "stage.steps=many"], OverrideError, "stage.steps=many is not valid: stage.steps takes an int"),
        # another stage's settings are checked now, not when the chained stage comes up
        (["stage=pipeline", "experiment=tiny_e2e", "settings.evaluate.prompts=few"], OverrideError, "prompts=few is"),
    ],
)
def test_bad_settings_are_refused_before_anything_runs(overrides, error, match):
    with pytest.raises(error, match=match):
        compose_config(overrides)


def test_evaluate_refuses_exact_greedy_at_a_sampling_temperature():
    """exact_greedy decodes greedily whatever the temperature: at T > 0 its rows would not be lossless."""
    stage = load_stage("evaluate")
    stage.check(compose_config(["stage=evaluate", "decoder.acceptance=exact_greedy", "stage.temperatures=[0.0]"]))
    with pytest.raises(ConfigError, match=r"exact_greedy is lossless only at temperature 0.*temperatures=\[0.0, 1.0\]"):
        stage.check(compose_config(["stage=evaluate", "decoder.acceptance=exact_greedy"]))


def test_a_renamed_key_still_works_for_one_release(capsys):
    cfg = compose_config(["decoder=spot", "decoder.gamma_floor=0.02"])
    assert cfg.decoder.prefix_mass_floor == 0.02
    assert "decoder.gamma_floor= is now decoder.prefix_mass_floor=" in capsys.readouterr().err


def test_an_evaluate_methods_entry_can_set_everything_a_discovered_row_has():
    """settings.evaluate.methods rows and discovered rows are the same EvalMethod: an explicit list can reproduce a
    Fig. 7 curve point or a Fig. 5 grid point (distill_loss, temperature, curve, grid), not only plain rows."""
    from streakline.config.schema import EvalMethodConfig
    from streakline.evaluation.methods import EvalMethod

    assert {f.name for f in dataclasses.fields(EvalMethodConfig)} == {f.name for f in dataclasses.fields(EvalMethod)}
    row = "{name: streak@60, decoder: diffusion_draft, drafter: /r/checkpoints/step-000060, steps: 60, " \
          "distill_loss: streak, temperature: 0.0, curve: true}"  # fmt: skip
    cfg = compose_config(["stage=evaluate", f"stage.methods=[{row}]"])
    got = EvalMethod.from_config(cfg.stage.methods[0])
    assert (got.distill_loss, got.temperature, got.curve, got.steps) == ("streak", 0.0, True, 60)
