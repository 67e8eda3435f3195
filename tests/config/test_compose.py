"""Every YAML under conf/ composes onto the schema and validates; presets, roles and checks behave.

Run: python -m pytest tests/config/test_compose.py
"""

import re
import shutil
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import MISSING, OmegaConf

from streakline.config import CONF_DIR, ConfigError, as_schema, compose_config, register_configs, rewrite_overrides
from streakline.config.overrides import OverrideError, check_key, config_groups, group_options
from streakline.config.schema import (
    DECODERS,
    GROUP_SCHEMAS,
    LAUNCHERS,
    LOSSES,
    ROLES,
    STAGE_SCHEMAS,
    STAGES,
    ArchConfig,
    CheckpointConfig,
    Config,
    ModelConfig,
    SourceConfig,
    WorldConfig,
)
from streakline.config.stages import ScalingStage

# Groups selected directly with group=option; checkpoint presets are only reached through the roles.
SELECTABLE = [g for g in config_groups(CONF_DIR) if g != "checkpoint"]
# Options that only make sense next to another choice.
COMPANIONS = {("stage", "pipeline"): ["experiment=tiny_e2e"]}


def _group_cases() -> list[tuple[str, str]]:
    return [(group, option) for group in SELECTABLE for option in group_options(CONF_DIR, group)]


@pytest.mark.parametrize(("group", "option"), _group_cases(), ids=lambda v: str(v))
def test_every_group_option_composes_and_validates(group, option):
    cfg = compose_config([f"{group}={option}", *COMPANIONS.get((group, option), [])])
    assert OmegaConf.get_type(cfg) is Config
    assert OmegaConf.is_struct(cfg)
    # Each preset names itself, so manifests and reports can say which one ran.
    assert cfg[group].name == option


# A DFlash drafter (kind: dflash) only drafts, and only for the verifier whose shapes it shares: it composes into the
# drafter role beside that verifier.
DFLASH_VERIFIER = {
    "micro-dflash": "micro-verifier",
    "tiny-dflash": "tiny-verifier",
    "tiny-dflash-1l": "tiny-verifier",
    "qwen3-8b-dflash": "qwen3-8b",
    "smol-dflash": "smollm2-135m",
}
# Each other checkpoint preset once, the roles taken in turn (a compose costs ~0.2 s; every pairing adds nothing).
_PLAIN = [p for p in group_options(CONF_DIR, "checkpoint") if p not in DFLASH_VERIFIER]


def _role(i: int, preset: str) -> str:
    """The roles in turn, but a preset cut from another role's model (``source.from_role``) in the drafter role."""
    source = OmegaConf.load(CONF_DIR / "checkpoint" / f"{preset}.yaml").get("source") or {}
    return "drafter" if source.get("from_role") else ROLES[i % len(ROLES)]


_CHECKPOINT_CASES = [(_role(i, p), p) for i, p in enumerate(_PLAIN)]


@pytest.mark.parametrize(("role", "preset"), _CHECKPOINT_CASES, ids=lambda v: str(v))
def test_every_checkpoint_preset_composes_into_a_role(role, preset):
    cfg = compose_config([f"model.{role}={preset}"])
    assert cfg.model[role].name == preset


@pytest.mark.parametrize("preset", sorted(DFLASH_VERIFIER))
def test_every_dflash_preset_composes_as_the_drafter_of_its_verifier(preset):
    assert {p for p in group_options(CONF_DIR, "checkpoint") if "dflash" in p} == set(DFLASH_VERIFIER)
    cfg = compose_config([f"model.verifier={DFLASH_VERIFIER[preset]}", f"model.drafter={preset}"])
    node = cfg.model.drafter
    assert node.kind == "dflash" and node.gamma == node.block_size - 1
    if cfg.model.verifier.arch is not None:  # a world's: the same hidden size and vocabulary, ids inside its depth
        assert node.arch.hidden_size == cfg.model.verifier.arch.hidden_size
        assert node.arch.vocab_size == cfg.model.verifier.arch.vocab_size
        assert max(node.target_layer_ids) <= cfg.model.verifier.arch.num_layers


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["model.verifier=micro-dflash"], "only drafts for a verifier"),
        (["model.drafter=micro-dflash"], "model.drafter.arch.hidden_size=64 but model.verifier.arch.hidden_size=256"),
        (["model=micro", "model.drafter=micro-dflash", "model.drafter.block_size=1"], "model.drafter.block_size=1"),
        (["model=micro", "model.drafter=micro-dflash", "model.drafter.target_layer_ids=[]"], "target_layer_ids"),
        (["model=micro", "model.drafter=micro-dflash", "model.drafter.target_layer_ids=[1,3]"], "reads past"),
        (["model=micro", "model.drafter=micro-dflash", "model.drafter.gamma=5"], "set model.drafter.gamma=4"),
        (["model=micro", "model.drafter.kind=draft"], "transformer, dflash"),
        (["stage=bootstrap", "model=micro", "model.drafter=micro-dflash"], "does not build"),
    ],
)
def test_bad_dflash_presets_name_the_fix(overrides, expected):
    with pytest.raises(ConfigError, match=re.escape(expected)):
        compose_config(overrides)


def test_every_yaml_file_is_reached():
    reached = {CONF_DIR / "config.yaml"}
    reached |= {CONF_DIR / g / f"{o}.yaml" for g, o in _group_cases()}
    reached |= {CONF_DIR / "checkpoint" / f"{o}.yaml" for o in group_options(CONF_DIR, "checkpoint")}
    # Hydra's own launcher configs, selected by launcher=<name> (tests/launch covers them).
    reached |= set((CONF_DIR / "hydra").rglob("*.yaml"))
    assert set(CONF_DIR.rglob("*.yaml")) == reached


def test_option_folders_match_the_schema_tuples():
    assert tuple(group_options(CONF_DIR, "stage")) == tuple(sorted(STAGES))
    assert tuple(group_options(CONF_DIR, "decoder")) == tuple(sorted(DECODERS))
    # a method preset per loss, of the loss's name; a preset of another name is a variant of one (its `loss`)
    methods = group_options(CONF_DIR, "method")
    assert set(LOSSES) <= set(methods)
    for name in set(methods) - set(LOSSES):
        assert OmegaConf.load(CONF_DIR / "method" / f"{name}.yaml").loss in LOSSES, name
    assert tuple(group_options(CONF_DIR, "launcher")) == tuple(sorted(LAUNCHERS))
    assert set(SELECTABLE) | {"checkpoint"} == set(GROUP_SCHEMAS)


def _leaves(node, prefix=""):
    for key, value in node.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _default(defaults, key):
    parent_key, _, leaf = key.rpartition(".")
    parent = OmegaConf.select(defaults, parent_key) if parent_key else defaults
    return MISSING if OmegaConf.is_missing(parent, leaf) else parent[leaf]


@pytest.mark.parametrize("group", sorted(GROUP_SCHEMAS))
def test_yaml_only_overrides_schema_defaults(group):
    """conf/ must not restate a dataclass default (docs/design.md, Configuration: the schema owns defaults)."""
    schema = GROUP_SCHEMAS[group]
    # arch, source (checkpoint) and world (model) default to None; their fields' defaults are their dataclasses'.
    if schema is CheckpointConfig:
        defaults = OmegaConf.structured(schema(arch=ArchConfig(), source=SourceConfig()))
    elif schema is ModelConfig:
        defaults = OmegaConf.structured(schema(world=WorldConfig()))
    else:
        defaults = OmegaConf.structured(schema)
    restated = []
    for path in sorted((CONF_DIR / group).glob("*.yaml")):
        data = OmegaConf.to_container(OmegaConf.load(path))
        data.pop("defaults", None)
        # An experiment file may set any key (``# @package _global_``): compare it with the root schema.
        base = OmegaConf.structured(Config) if path.read_text().startswith("# @package _global_") else defaults
        for k, v in _leaves(data):
            if k.startswith("settings."):  # a stage's settings: compare with that stage's schema
                _, name, rest = k.split(".", 2)
                found = _default(OmegaConf.structured(STAGE_SCHEMAS[name](name=name)), rest)
            else:
                found = _default(base, k)
            if found == v:
                restated.append(f"{path.name}: {k}={v!r}")
    assert not restated, f"YAML repeats schema defaults: {restated}"


def test_role_swap_changes_one_role_only():
    cfg = compose_config(["model.verifier=qwen2.5-72b"])
    assert cfg.model.name == "tiny"
    assert cfg.model.verifier.hub_id == "Qwen/Qwen2.5-72B-Instruct"
    # The swapped-in preset replaces the tiny one whole: no tiny arch left behind.
    assert cfg.model.verifier.arch is None
    assert cfg.model.drafter.name == "tiny-drafter"
    assert cfg.model.drafter.arch.hidden_size == 128
    assert cfg.model.target.name == "tiny-target"


def test_role_swap_after_a_model_preset():
    cfg = compose_config(["model.verifier=qwen2.5-72b", "model=diffullama"])
    assert cfg.model.name == "diffullama"
    assert cfg.model.verifier.name == "qwen2.5-72b"
    assert cfg.model.drafter.hub_id == "diffusionfamily/diffullama"


def test_role_path_is_a_plain_value_and_becomes_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = compose_config(["model.drafter.path=/tmp/x", "model.target.path=ckpt/target", "run_root=out"])
    assert cfg.model.drafter.path == "/tmp/x"
    assert cfg.model.drafter.name == "tiny-drafter"
    assert cfg.model.target.path == str(tmp_path / "ckpt" / "target")
    assert cfg.run_root == str(tmp_path / "out")


def test_model_presets_pair_the_expected_roles():
    cfg = compose_config(["model=diffucoder"])
    assert [cfg.model[r].name for r in ROLES] == ["qwen2.5-14b", "diffucoder-7b", "sdar-8b-b32"]
    cfg = compose_config(["model=llada"])
    assert cfg.model.target.hub_id == "GSAI-ML/LLaDA-8B-Instruct"
    assert cfg.model.target.mask_token == "<|mdm_mask|>"


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["model.verifier.attention=sideways"], "causal, full, prefix_causal, block_causal"),
        (["model.drafter.family=gpt"], "llama, qwen2, qwen3, dream, sdar, llada, auto"),
        (["model.target.dtype=fp8"], "float32, bfloat16, float16"),
        (["model.target.block_size=null"], "model.target.block_size"),
        (["model.drafter.gamma=0"], "model.drafter.gamma=0"),
        (["model=diffucoder", "model.verifier.hub_id=null"], "model.verifier.path"),
        (["model.verifier.arch.num_kv_heads=3"], "num_kv_heads"),
        (["method.loss=kl"], "streak, ce_streak, expce, distillspec, ar_distill, mdm"),
        (["method.divergence=l2"], "fkl, rkl, jsd, tvd"),
        (["trainer.zero_stage=1"], "0, 2, 3"),
        (["trainer.precision=fp16"], "fp32, bf16"),
        (["decoder.acceptance=yes"], "exact_greedy, leviathan, greedy_acceptance, multidraft_leviathan"),
        (["decoder.selection=first"], "streak_score, longest"),
        (["decoder.acceptance=exact_greedy", "decoder.temperature=1"], "lossless only at decoder.temperature=0"),
        (["decoder.name=beam"], "vanilla, ar_draft"),
        (["decoder.threshold=0"], "decoder.threshold"),
        (["launcher.name=k8s"], "local, slurm, ray"),
        (["experiment.stages=[bootstrap,nope]"], "choose from: doctor, bootstrap"),
        (["stage=pipeline"], "experiment=tiny_e2e"),
        (["data.mix_weights=[1.0]"], "one weight per source"),
        (["data.mix_weights=[nan,1.0]"], "must be finite numbers >= 0"),
        (["data.mix_weights=[inf,1.0]"], "must be finite numbers >= 0"),
        (["method.name=???"], "method.name is required"),
    ],
)
def test_bad_values_name_the_key_and_the_valid_choices(overrides, expected):
    with pytest.raises(ConfigError) as info:
        compose_config(overrides)
    assert expected in str(info.value)


@pytest.mark.parametrize("key", ["trainer.lr", "model.verifier.arch.qk_norm", "data.prompt_sources.0", "seed"])
def test_check_key_accepts_schema_keys(key):
    check_key(key)


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("trainer.lrr", "valid keys under 'trainer': name, zero_stage, precision, lr, min_lr_ratio"),
        ("model.verifier.arch.hiden_size", "did you mean 'hidden_size'?"),
        ("trainer.lr.x", "'trainer.lr' is a value, not a section"),
        ("sed", "top-level keys"),
    ],
)
def test_check_key_rejects_unknown_keys(key, expected):
    with pytest.raises(OverrideError) as info:
        check_key(key)
    assert expected in str(info.value)


def test_a_field_of_one_entry_of_a_list_of_sections_is_a_key():
    """``settings.scaling.arms.1.every=1`` reaches the second arm only (Hydra takes an index into an existing list
    entry); a field the entry lacks is named with the valid ones."""
    cfg = compose_config(["stage=scaling", "experiment=smol_scaling", "settings.scaling.arms.1.every=1"])
    assert [a.every for a in cfg.stage.arms] == [1, 1] and cfg.stage.arms[1].name == "cut"
    with pytest.raises(OverrideError, match=r"valid under 'arms.1': name, methods, every"):
        compose_config(["stage=scaling", "experiment=smol_scaling", "settings.scaling.arms.1.evry=1"])
    with pytest.raises(OverrideError, match="'token_sizes' is a value, not a section"):
        check_key("token_sizes.0.x", root=ScalingStage, where="stage=scaling")


def test_rewrite_leaves_flags_and_group_selections_alone():
    args = ["--cfg", "job", "-p", "model.verifier", "-m", "model=dream", "model.verifier=llama2-13b", "hydra.verbose=1"]
    assert rewrite_overrides(args, CONF_DIR) == [*args[:6], "checkpoint@model.verifier=llama2-13b", args[-1]]
    # A sweep over presets is rewritten whole; Hydra expands it under -m.
    assert rewrite_overrides(["model.drafter=dream-7b,diffucoder-7b"], CONF_DIR) == [
        "checkpoint@model.drafter=dream-7b,diffucoder-7b"
    ]


def test_role_swap_to_an_unknown_preset_lists_presets():
    with pytest.raises(OverrideError) as info:
        compose_config(["model.target=sdar-9b"])
    assert "sdar-8b-b32" in str(info.value) and "model.target.path" in str(info.value)


def test_a_composed_config_is_kept_until_a_conf_file_changes_and_each_caller_gets_its_own(tmp_path, monkeypatch):
    """compose_config keeps what Hydra composed by the overrides and the conf/ files it was composed from: the same
    overrides give the same config as a fresh composition, a caller's changes do not reach the next caller, and an
    edited (or added) YAML file is composed afresh."""
    import streakline.config as config

    monkeypatch.chdir(tmp_path)
    overrides = ["stage=evaluate", "model=micro", "run_root=out"]
    kept = compose_config(overrides)
    kept.stage.prompts = 999  # the caller's own copy
    again = compose_config(overrides)
    assert again.stage.prompts == 10
    config._COMPOSED.clear()
    config._FILES_COMPOSED.clear()
    fresh = compose_config(overrides)
    assert OmegaConf.to_yaml(again) == OmegaConf.to_yaml(fresh)
    assert OmegaConf.get_type(again.stage) is OmegaConf.get_type(fresh.stage) and OmegaConf.is_struct(again)
    assert again.run_root == str(tmp_path / "out")  # paths are resolved on every call, against the working folder

    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    monkeypatch.setattr(config, "CONF_DIR", conf)
    assert compose_config(overrides).stage.prompts == 10
    evaluate = conf / "stage" / "evaluate.yaml"
    evaluate.write_text(evaluate.read_text() + "prompts: 3\n")
    assert compose_config(overrides).stage.prompts == 3
    (conf / "model" / "micro2.yaml").write_text((conf / "model" / "micro.yaml").read_text())
    assert compose_config([*overrides[:1], "model=micro2", *overrides[2:]]).stage.prompts == 3


# Override lists whose values are applied on a kept composition of their files: plain values, lists, a list of
# sections, a stage setting (rewritten to ++settings.<stage>.<key>), a role swap (a group override) among them.
VALUE_CASES = [
    ["stage=distill", "run_root=/tmp/a", "trainer.lr=3e-4", "seed=2"],
    ["stage=spot", "model=micro", "stage.steps=20", "run_root=/tmp/b"],
    ["stage=distill", "model=smol", "model.drafter=smol-dflash", "method=dpace", "trainer.train_tokens=1000"],
    ["stage=pipeline", "experiment=smol_scaling", "data.max_prompts=36", "settings.scaling.token_sizes=[300,1000]",
     "settings.scaling.arms=[{name:dflash,methods:[dflash_ce],run_overrides:['model.drafter=smol-dflash']}]"],
    ["stage=evaluate", "model=micro", "stage.temperatures=[0.0]", "stage.methods=[{name:x,decoder:ngram}]"],
]  # fmt: skip


@pytest.mark.parametrize("overrides", VALUE_CASES, ids=lambda v: " ".join(v)[:60])
def test_values_applied_to_a_kept_composition_equal_hydras_own_composition(overrides):
    """compose_config composes the files a list's group overrides pick once, and applies the value overrides to a
    copy as Hydra does: the result is the config Hydra composes from the whole list, and a second list that differs
    only in values composes no files again. A value Hydra refuses is refused with Hydra's own error."""
    from streakline import config

    args = rewrite_overrides(list(overrides), CONF_DIR)
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="streakline"):
        whole = as_schema(compose(config_name="config", overrides=args))
    got = compose_config(overrides, check=False)
    whole.overrides = got.overrides  # compose_config records the rewritten list
    assert OmegaConf.to_yaml(got) == OmegaConf.to_yaml(whole)
    assert OmegaConf.get_type(got.stage) is OmegaConf.get_type(whole.stage) and OmegaConf.is_struct(got)

    files = len(config._FILES_COMPOSED)
    other = compose_config([*overrides, "run_root=/tmp/elsewhere", "seed=7"], check=False)
    assert (other.run_root, other.seed) == ("/tmp/elsewhere", 7) and len(config._FILES_COMPOSED) == files
    with pytest.raises(ConfigCompositionException, match="Error merging override seed=\\[1\\]"):
        compose_config([*overrides, "seed=[1]"])


def test_as_schema_rejects_keys_the_dataclass_lacks():
    with pytest.raises(Exception, match="foo"):
        as_schema({"trainer": {"foo": 1}})


def test_a_yaml_key_outside_the_schema_fails_composition(tmp_path):
    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    (conf / "trainer" / "cpu.yaml").write_text("name: cpu\nzero_stage: 0\nprecision: fp32\nlearning_rate: 1.0\n")
    register_configs()
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        with pytest.raises(ConfigCompositionException) as info:
            compose(config_name="config")
    assert "learning_rate" in str(info.value.__cause__ or info.value)


def test_hydra_keeps_the_working_directory():
    hydra_conf = OmegaConf.to_container(OmegaConf.load(Path(CONF_DIR) / "config.yaml"), resolve=False)["hydra"]
    assert hydra_conf["job"]["chdir"] is False
    # Hydra's own outputs follow run_root, so one override moves everything a run writes.
    assert hydra_conf["run"]["dir"].startswith("${run_root}/hydra/")
