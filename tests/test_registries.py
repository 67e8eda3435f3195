"""One registry per plural thing, and the config's choices equal to it.

Every plural thing is defined once, in the code that runs it (decoders: ``decoding.registry.DECODER_SPECS``,
model families: ``models.config.FAMILIES``, losses: ``alignment.losses.LOSSES``, checkpoint kinds:
``models.CHECKPOINT_KINDS``, drafter kinds: ``pipelines.common.kinds.DRAFTER_KINDS``, ...). ``config/schema.py``
repeats the names as the allowed config choices because it must import without torch (``--help`` reads it). These
tests keep each schema tuple equal to its registry, the presets under ``conf/`` and the schema's defaults naming only
registered things, the derived decoder tables consistent, and every drafter kind tied to its drafter class, decoder
and checkpoint kind. Each check is a function returning its problems, and the last tests feed each one a wrong input
to show it can fail.

Run: ``python -m pytest tests/test_registries.py``.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import types
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pytest
from omegaconf import MISSING, OmegaConf

from streakline.config import CONF_DIR, schema


def _decoders():
    from streakline.decoding.registry import DECODER_SPECS

    return DECODER_SPECS


def _acceptance_rules():
    from streakline.decoding.acceptance import ACCEPTANCE_RULES

    return ACCEPTANCE_RULES


def _selections():
    from streakline.decoding.acceptance import SELECTIONS

    return SELECTIONS


def _losses():
    # The whole registry: mdm is registered there too (register_loss("mdm"); stage=bootstrap trains with
    # pretrain.mdm_window_loss, the same objective, and stage=distill refuses method=mdm).
    from streakline.alignment.losses import LOSSES

    return LOSSES


def _divergences():
    from streakline.alignment.losses import DIVERGENCES

    return DIVERGENCES


def _families():
    from streakline.models.config import FAMILIES

    return FAMILIES


def _attention_modes():
    from streakline.models.config import ATTENTION_MODES

    return ATTENTION_MODES


def _backends():
    from streakline.decoding.backends import BACKENDS

    return BACKENDS


def _dtypes():
    from streakline.models.builder import DTYPES

    return DTYPES


def _block_rules():
    from streakline.decoding.registry import BLOCK

    return BLOCK


def _engines():
    from streakline.models.kv_cache import ENGINES

    return ENGINES


def _checkpoint_kinds():
    from streakline.models import CHECKPOINT_KINDS

    return CHECKPOINT_KINDS


def _drafter_kinds():
    from streakline.pipelines.common.kinds import DRAFTER_KINDS

    return DRAFTER_KINDS


def _benchmarks():
    """Every name a prompt source may start with: benchmarks, conversation presets, conversations@..."""
    from streakline.data.sources import source_names

    return source_names()


# schema tuple name -> the registry whose names it must equal
REGISTRIES: dict[str, Callable[[], Iterable[str]]] = {
    "DECODERS": _decoders,
    "ACCEPTANCE_RULES": _acceptance_rules,
    "SELECTIONS": _selections,
    "LOSSES": _losses,
    "DIVERGENCES": _divergences,
    "FAMILIES": _families,
    "ATTENTION_MODES": _attention_modes,
    "TRAJECTORY_BACKENDS": _backends,
    "DTYPES": _dtypes,
    "ENGINES": _engines,
    "CHECKPOINT_KINDS": _checkpoint_kinds,
}

# config key -> the registered names its value (a string) may take, wherever the key appears in a preset or the schema
KEY_CHOICES: dict[str, Callable[[], Iterable[str]]] = {
    "family": lambda: [*_families(), "auto"],  # "auto": the checkpoint folder's config.json decides
    "attention": _attention_modes,
    "dtype": _dtypes,
    "loss": _losses,
    "divergence": _divergences,
    "acceptance": _acceptance_rules,
    "selection": _selections,
    "backend": _backends,
    "decoder": _decoders,
    "rule": _block_rules,  # the draft-free rule spot / spiffy reproduce, or that traces come from
    "kind": _checkpoint_kinds,  # what a checkpoint preset builds
}
BENCHMARK_KEYS = ("prompt_sources", "benchmarks", "eval_sources")  # lists of benchmark names (name@/file allowed)
GROUPS = tuple(schema.GROUP_SCHEMAS)  # conf/<group>/ folders holding the presets (conf/hydra is Hydra's own)


# ---------------------------------------------------------------- checks (each returns its problems)


def check_same_names(registry: Iterable[str], choices: Iterable[str], what: str) -> list[str]:
    registry, choices = list(registry), list(choices)
    problems = []
    if len(set(choices)) != len(choices):
        problems.append(f"{what} repeats a name: {choices}")
    if only := sorted(set(choices) - set(registry)):
        problems.append(f"{what} offers {only}, which the registry does not define")
    if only := sorted(set(registry) - set(choices)):
        problems.append(f"the registry defines {only}, which {what} does not offer")
    return problems


def _yaml_files(conf_dir: Path) -> list[Path]:
    return sorted(p for g in GROUPS if (conf_dir / g).is_dir() for p in (conf_dir / g).rglob("*.yaml"))


def _load(path: Path) -> dict:
    return OmegaConf.to_container(OmegaConf.load(path), resolve=False) or {}


def _walk(node, path: str = "", key: str = "") -> Iterator[tuple[str, str, object]]:
    """Every ``(dotted path, key, value)`` of a YAML tree; a list's items come with the list's key."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, value in items:
        where = f"{path}[{k}]" if isinstance(node, list) else f"{path}.{k}" if path else str(k)
        child_key = key if isinstance(node, list) else str(k)
        yield where, child_key, value
        yield from _walk(value, where, child_key)


def _override_values(text: str) -> Iterator[tuple[str, str, object]]:
    """``(key, last key part, value)`` of each ``key=value`` in a stage line (``"spiffy spiffy.temperature=1.0"``)."""
    for token in text.split():
        key, sep, value = token.partition("=")
        if not sep:
            continue
        value = value.strip("'\"")
        if value.startswith("[") and value.endswith("]"):
            value = [v.strip().strip("'\"") for v in value[1:-1].split(",") if v.strip()]
        yield key.lstrip("+~"), key.lstrip("+~").rsplit(".", 1)[-1], value


def _check_value(where: str, key: str, value, choices: dict[str, set[str]]) -> list[str]:
    if key in BENCHMARK_KEYS and isinstance(value, list):
        from streakline.data.benchmarks import parse_source

        bad = [v for v in value if isinstance(v, str) and parse_source(v)[0] not in choices["benchmark"]]
        return [f"{where}: {bad} are not registered prompt sources (data/sources.py)"] if bad else []
    if key in KEY_CHOICES and isinstance(value, str) and value not in choices[key]:
        return [f"{where}: {value!r} is not a registered {key}; valid: {sorted(choices[key])}"]
    return []


def _all_choices() -> dict[str, set[str]]:
    return {**{k: set(f()) for k, f in KEY_CHOICES.items()}, "benchmark": set(_benchmarks())}


def check_presets(conf_dir: Path) -> list[str]:
    """Every keyed value in every preset (and in the override lines of experiments) names a registered thing."""
    choices = _all_choices()
    problems = []
    for path in _yaml_files(conf_dir):
        rel = path.relative_to(conf_dir)
        for where, key, value in _walk(_load(path)):
            problems += _check_value(f"{rel}:{where}", key, value, choices)
            if isinstance(value, str) and "=" in value:  # experiment.stages / sweep.train lines
                for okey, last, ovalue in _override_values(value):
                    if okey in GROUPS:  # a preset: method=ce_streak
                        if not (conf_dir / okey / f"{ovalue}.yaml").is_file():
                            problems.append(f"{rel}:{where}: {okey}={ovalue} names no conf/{okey}/{ovalue}.yaml")
                    else:  # a key: evaluate.benchmarks=[tiny-math]
                        problems += _check_value(f"{rel}:{where} ({okey})", last, ovalue, choices)
    return problems


def check_group_names(conf_dir: Path, group: str, key: str, registry: Iterable[str], *, cover: bool) -> list[str]:
    """Every ``conf/<group>/*.yaml`` names a registered thing under ``key``; ``cover``: every one has a preset."""
    registry = list(registry)
    named = {p.stem: _load(p).get(key) for p in sorted((conf_dir / group).glob("*.yaml"))}
    problems = [f"conf/{group}/{s}.yaml: {key}={v!r} is not registered" for s, v in named.items() if v not in registry]
    if cover and (missing := sorted(set(registry) - set(named.values()))):
        problems.append(f"registered but no conf/{group} preset names them: {missing}")
    return problems


def _dataclasses_of(module) -> list[type]:
    return [v for v in vars(module).values() if dataclasses.is_dataclass(v) and v.__module__ == module.__name__]


def check_schema_defaults(module=schema) -> list[str]:
    """Every default in the schema's dataclasses (benchmark lists, rule, acceptance, ...) names a registered thing."""
    choices = _all_choices()
    problems = []
    for cls in _dataclasses_of(module):
        for f in dataclasses.fields(cls):
            if f.name not in KEY_CHOICES and f.name not in BENCHMARK_KEYS:
                continue
            if f.default_factory is not dataclasses.MISSING:
                value = f.default_factory()
            elif f.default is not dataclasses.MISSING:
                value = f.default
            else:
                continue
            if value is None or value == MISSING:
                continue
            problems += _check_value(f"schema.{cls.__name__}.{f.name}", f.name, value, choices)
    return problems


_ROW = re.compile(r"^\| (?P<names>``.*?``(?: / ``.*?``)*) \| .* \| (?P<needs>[^|]+) \|$")


def check_decoder_docstring(doc: str) -> list[str]:
    """The registry module's docstring table lists every decoder, with its ``needs``."""
    specs = _decoders()
    rows = {}
    for line in doc.splitlines():
        if m := _ROW.match(line.strip()):
            for name in re.findall(r"``(\w+)``", m["names"]):
                rows[name] = m["needs"].strip()
    problems = check_same_names(specs, rows, "the registry docstring's table")
    for name, spec in specs.items():
        if name in rows and rows[name] != spec.needs:
            problems.append(f"docstring says {name} needs {rows[name]!r}, DECODER_SPECS {spec.needs!r}")
    return problems


def check_drafter_kinds(kinds: dict) -> list[str]:
    """Every drafter kind is one drafter class of ``decoding.drafters.DRAFTERS`` (the same names), runs under the
    decoder whose spec names that class, builds a registered checkpoint kind and drafts in a role's tokenizer; every
    drafted speculative decoder is some kind's; every checkpoint kind is trained as exactly one drafter kind."""
    from torch import nn

    from streakline.decoding.drafters import DRAFTERS

    specs, checkpoints = _decoders(), _checkpoint_kinds()
    problems = check_same_names(DRAFTERS, kinds, "DRAFTER_KINDS")
    for name, kind in kinds.items():
        if kind.name != name:
            problems.append(f"DRAFTER_KINDS[{name!r}] is named {kind.name!r}")
        if kind.decoder not in specs or specs[kind.decoder].drafter != kind.name:
            problems.append(f"drafter kind {name}: decoder={kind.decoder!r} is not a decoder of drafter kind {name}")
        if kind.checkpoint not in checkpoints:
            problems.append(f"drafter kind {name}: checkpoint={kind.checkpoint!r} is no models.CHECKPOINT_KINDS key")
        if kind.tokenizer_role not in ("drafter", "verifier"):
            problems.append(f"drafter kind {name}: tokenizer_role={kind.tokenizer_role!r} is not a role it drafts in")
        if kind.train_module is not None and not issubclass(kind.train_module, nn.Module):
            problems.append(f"drafter kind {name}: train_module {kind.train_module!r} is no torch module")
    drafted = sorted(n for n, s in specs.items() if s.drafter in DRAFTERS)  # a model's (not ngram: no model)
    problems += check_same_names(drafted, sorted(k.decoder for k in kinds.values()), "the drafter kinds' decoders")
    for checkpoint in checkpoints:
        trained = [k.name for k in kinds.values() if k.checkpoint == checkpoint and k.trains]
        if len(trained) != 1:
            problems.append(f"checkpoint kind {checkpoint} is trained as {trained}; exactly one drafter kind must be")
    return problems


# ---------------------------------------------------------------- the tests


@pytest.mark.parametrize("choice", sorted(REGISTRIES))
def test_schema_choices_equal_registry(choice):
    assert check_same_names(REGISTRIES[choice](), getattr(schema, choice), f"schema.{choice}") == []


def test_family_choices_and_one_family_registry():
    from streakline import models
    from streakline.models import checkpoint, config

    assert schema.FAMILY_CHOICES == (*schema.FAMILIES, "auto")
    assert config.FAMILIES is checkpoint.FAMILIES is models.FAMILIES  # defined once, imported elsewhere
    assert set(checkpoint.BASE_FAMILY) <= set(config.FAMILIES)


def test_block_decoders_are_the_commit_rules():
    from streakline.decoding.block_diffusion import COMMIT_RULES

    assert check_same_names(COMMIT_RULES, _block_rules(), "decoding.registry.BLOCK") == []


def test_selections_map_onto_kernel_selections():
    from streakline.decoding.kernels.verify import SELECTIONS as KERNEL_SELECTIONS

    assert set(_selections().values()) <= set(KERNEL_SELECTIONS)


def test_trainer_precisions_are_registered():
    from streakline.alignment.strategy import PRECISIONS

    assert set(schema.PRECISIONS) <= set(PRECISIONS)


def test_decoder_tables_derive_from_specs():
    from streakline.decoding import drafters, registry
    from streakline.evaluation import results

    specs = registry.DECODER_SPECS
    assert all(name == spec.name for name, spec in specs.items())
    assert set(registry.SPECULATIVE) == {n for n, s in specs.items() if s.family == "speculative"}
    model_free, composite = set(registry.MODEL_FREE_DRAFTERS.values()), set(registry.COMPOSITE_DRAFTERS.values())
    assert set(registry.SPECULATIVE.values()) - {None} <= set(drafters.DRAFTERS.values()) | model_free | composite
    assert not set(registry.MODEL_FREE_DRAFTERS) & set(drafters.DRAFTERS)  # a kind has a model or has none
    assert not set(registry.COMPOSITE_DRAFTERS) & (set(drafters.DRAFTERS) | set(registry.MODEL_FREE_DRAFTERS))
    assert all(registry.needs_drafter_model(n) for n in registry.COMPOSITE_DRAFTERS)  # lookup + a DFlash model
    assert {n for n in specs if not registry.needs_drafter_model(n)} == {
        "vanilla",
        *registry.MODEL_FREE_DRAFTERS,
        *registry.BLOCK,
        *registry.BLOCK_DRAFTED,
    }
    assert registry.SPECULATIVE["vanilla"] is None
    assert {*registry.BLOCK, *registry.BLOCK_DRAFTED} == {n for n, s in specs.items() if s.family == "block"}
    assert not set(registry.BLOCK) & set(registry.BLOCK_DRAFTED)
    assert all(specs[n].drafted for n in registry.BLOCK_DRAFTED)
    assert registry.REFERENCE == {"speculative": "vanilla", "block": "static"}
    assert results.REFERENCE is registry.REFERENCE
    assert registry.REFERENCE_DECODERS == ("vanilla", "static", "threshold")
    assert set(registry.REFERENCE.values()) <= set(registry.REFERENCE_DECODERS)
    for name, spec in specs.items():
        assert registry.decoder_family(name) == spec.family
    with pytest.raises(ValueError, match="valid: vanilla, ar_draft"):
        registry.decoder_family("medusa")


def test_checkpoint_kinds_are_their_model_classes():
    from streakline.models import CHECKPOINT_KINDS, Transformer
    from streakline.models.dflash import DFlashModel

    assert all(cls.kind == name for name, cls in CHECKPOINT_KINDS.items())
    assert CHECKPOINT_KINDS == {"transformer": Transformer, "dflash": DFlashModel}


def test_drafter_kinds_are_their_drafters_decoders_and_checkpoint_kinds():
    assert check_drafter_kinds(_drafter_kinds()) == []


def test_decoder_docstring_table_is_true():
    from streakline.decoding import registry

    assert check_decoder_docstring(registry.__doc__) == []


def test_decoder_presets_name_registered_decoders():
    assert check_group_names(CONF_DIR, "decoder", "name", _decoders(), cover=True) == []


def test_method_presets_name_registered_losses():
    assert check_group_names(CONF_DIR, "method", "loss", _losses(), cover=False) == []


def test_checkpoint_presets_name_valid_families():
    assert check_group_names(CONF_DIR, "checkpoint", "family", KEY_CHOICES["family"](), cover=False) == []


def test_presets_name_registered_things():
    """Families, losses, rules, benchmark lists (prompt_sources / benchmarks / eval_sources), ... in conf/**."""
    assert check_presets(CONF_DIR) == []


def test_schema_defaults_name_registered_things():
    """SpotConfig / SpiffyConfig.prompt_sources, EvaluateConfig.benchmarks, TrainerConfig.eval_sources, rules, ..."""
    assert check_schema_defaults() == []


def test_schema_imports_without_torch():
    """Why schema.py repeats the names instead of importing the registries."""
    code = "import sys, streakline.config.schema; assert 'torch' not in sys.modules, 'schema pulled in torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------- each check can fail


def test_a_choice_only_the_schema_offers_fails(monkeypatch):
    monkeypatch.setattr(schema, "DECODERS", (*schema.DECODERS, "medusa"))
    with pytest.raises(AssertionError):
        test_schema_choices_equal_registry("DECODERS")
    monkeypatch.setattr(schema, "FAMILIES", schema.FAMILIES[:-1])
    with pytest.raises(AssertionError):
        test_schema_choices_equal_registry("FAMILIES")
    assert check_same_names(["a", "b"], ["a", "a", "b"], "X") == ["X repeats a name: ['a', 'a', 'b']"]


def test_wrong_presets_fail(tmp_path):
    for group, text in {
        "decoder": "name: medusa\n",
        "method": "name: x\nloss: kl\n",
        "checkpoint": "name: x\nfamily: gpt2\n",
        "data": "name: x\nprompt_sources: [tiny-math-train, gsm8k@/data/g.jsonl, tiny-mth]\n",
        "experiment": "experiment:\n  stages:\n    - distill method=nope\n    - evaluate evaluate.benchmarks=[mmlu]\n",
    }.items():
        (tmp_path / group).mkdir()
        (tmp_path / group / "bad.yaml").write_text(text)
    assert len(check_group_names(tmp_path, "decoder", "name", _decoders(), cover=True)) == 2  # medusa; none cover
    assert check_group_names(tmp_path, "method", "loss", _losses(), cover=False)
    assert check_group_names(tmp_path, "checkpoint", "family", KEY_CHOICES["family"](), cover=False)
    problems = check_presets(tmp_path)
    for needle in ("'kl'", "'gpt2'", "['tiny-mth']", "method=nope", "['mmlu']"):
        assert any(needle in p for p in problems), (needle, problems)
    assert len(problems) == 5, problems


def test_a_wrong_schema_default_fails():
    @dataclasses.dataclass
    class Defaults:
        benchmarks: list[str] = dataclasses.field(default_factory=lambda: ["tiny-math", "humaneval", "tiny-mth"])
        rule: str = "spot"  # a drafted decoder, not a draft-free rule
        loss: str = MISSING  # no default: skipped

    fake = types.ModuleType("fake_schema")
    Defaults.__module__ = fake.__name__
    fake.Defaults = Defaults
    problems = check_schema_defaults(fake)
    assert len(problems) == 2 and "['tiny-mth']" in problems[0] and "'spot'" in problems[1], problems


def test_a_stale_docstring_table_fails():
    from streakline.decoding import registry

    doc = registry.__doc__.replace("| target + artifact |", "| target |").replace("``spiffy``", "``medusa``")
    problems = check_decoder_docstring(doc)
    assert any("medusa" in p for p in problems) and any("spot needs" in p for p in problems), problems


def test_a_wrong_drafter_kind_fails():
    import dataclasses as dc

    kinds = dict(_drafter_kinds())
    kinds["dflash"] = dc.replace(kinds["dflash"], decoder="diffusion_draft", tokenizer_role="target", checkpoint="gguf")
    kinds["ar"] = dc.replace(kinds["ar"], train_module=kinds["diffusion"].train_module)  # two train transformers
    problems = check_drafter_kinds(kinds)
    for needle in ("decoder='diffusion_draft'", "tokenizer_role='target'", "checkpoint='gguf'", "['dflash_draft']",
                   "dflash is trained as []", "transformer is trained as ['ar', 'diffusion']"):  # fmt: skip
        assert any(needle in p for p in problems), (needle, problems)
    del kinds["ar"]
    assert any("['ar']" in p for p in check_drafter_kinds(kinds))
