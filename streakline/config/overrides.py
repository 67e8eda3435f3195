"""Command-line overrides, checked and rewritten before Hydra sees them.

Two things happen here, for ``streakline.cli`` and for :func:`streakline.config.compose_config` alike:

* the role-swap shorthand ``model.verifier=NAME`` (also ``model.drafter``, ``model.target``; NAME a
  file in ``conf/checkpoint/``) becomes ``checkpoint@model.verifier=NAME``, the key under which Hydra
  knows the model preset's package-directive default ``- /checkpoint@verifier: ...``;
* a stage's settings go to ``settings.<stage>``: ``stage.steps=2000`` (with ``stage=spot``) and
  ``settings.spot.steps=2000`` both become ``++settings.spot.steps=2000``, checked against that stage's schema
  (``SpotStage``); ``config.as_schema`` applies ``settings.<stage>`` to ``cfg.stage`` when that stage runs, alone
  or chained. The old top-level form ``spot.steps=2000`` still works for one release, with a deprecation note;
* every plain ``a.b.c=value`` key is looked up in the dataclass schema, so a typo such as
  ``trainer.lrr=1`` stops with the valid keys at that level instead of Hydra's bare "Could not override".

Group selections (``model=dream``, ``+group=option``) are checked against the group's YAML files, so
``model=dreem`` stops with the options instead of Hydra's 20-line "Could not find". ``hydra.*`` keys, deletions
(``~key``) and keys with ``@`` or ``/`` pass through for Hydra to judge. ``+key=value`` and ``++key=value`` are
checked like plain keys: Hydra adds such keys with struct mode lifted, and the schema has no room for new ones.

Try it: ``python launch.py --cfg job model.verifier=qwen2.5-72b``.
"""

import dataclasses
import difflib
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

from streakline.config.schema import ROLES, STAGE_SCHEMAS, Config
from streakline.errors import UserError

ROLE_KEYS = tuple(f"model.{role}" for role in ROLES)
CHECKPOINT_GROUP = "checkpoint"
# Hydra's flags that take a value (hydra/_internal/utils.py get_args_parser); the value is never an override.
VALUE_FLAGS = {"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn", "--experimental-rerun"}
# A folder Hydra searches besides ours; presets found there are valid role-swap names.
CONF_DIR_FLAGS = {"--config-dir", "-cd"}


class OverrideError(UserError, ValueError):
    """An override that names a key or preset that does not exist."""


def group_options(conf_dir: Path, group: str) -> list[str]:
    """Option names of a config group: the YAML files in ``conf_dir/group``, sorted."""
    return sorted(p.stem for p in (Path(conf_dir) / group).glob("*.yaml"))


def config_groups(conf_dir: Path) -> list[str]:
    """Top-level config groups on disk (folders of ``conf_dir`` holding YAML files)."""
    return sorted(p.name for p in Path(conf_dir).iterdir() if p.is_dir() and any(p.glob("*.yaml")))


def rewrite_overrides(args: list[str], conf_dir: Path) -> list[str]:
    """Return ``args`` with role swaps rewritten; raise :class:`OverrideError` on an unknown key or preset.

    ``args`` is argv without the program name; flags (``--cfg job``, ``-m``) and their values pass through.
    Presets in a folder added with ``--config-dir`` count too, as they do for Hydra.
    """
    conf_dirs = [Path(conf_dir)]
    overrides: list[tuple[int, str]] = []
    position = 0
    while position < len(args):
        arg = args[position]
        if arg in VALUE_FLAGS | CONF_DIR_FLAGS and position + 1 < len(args):
            if arg in CONF_DIR_FLAGS:
                conf_dirs.append(Path(args[position + 1]))
            position += 2
            continue
        if arg.startswith("--config-dir="):
            conf_dirs.append(Path(arg.split("=", 1)[1]))
        elif not arg.startswith("-") and "=" in arg:
            overrides.append((position, arg))
        position += 1

    presets = sorted({p for d in conf_dirs for p in group_options(d, CHECKPOINT_GROUP)})
    groups = sorted({g for d in conf_dirs if d.is_dir() for g in config_groups(d)})
    stage = next((a.split("=", 1)[1] for _, a in overrides if a.split("=", 1)[0].lstrip("+") == "stage"), None)
    out = list(args)
    for position, arg in overrides:
        key, value = arg.split("=", 1)
        if key in ROLE_KEYS:
            _check_presets(key, value, presets, conf_dirs)
            out[position] = f"{CHECKPOINT_GROUP}@{key}={value}"
            continue
        plain = key.lstrip("+")
        if plain in RENAMED:
            new = RENAMED[plain]
            if plain not in _WARNED:
                _WARNED.add(plain)
                print(f"streakline: {plain}= is now {new}= (the old name goes in the next release)", file=sys.stderr)
            out[position] = f"{key[: len(key) - len(plain)]}{new}={value}"
            continue
        if plain in groups:
            options = sorted({o for d in conf_dirs for o in group_options(d, plain)})
            _check_option(
                plain, value, options, f"an option of {plain}; {plain}=NAME takes one of: {', '.join(options)}"
            )
            continue
        setting = stage_setting(plain, stage)
        if setting is not None:
            name, _, rest = setting.partition(".")
            check_value(plain, value, check_key(rest, root=STAGE_SCHEMAS[name], where=f"stage={name}"))
            out[position] = f"++settings.{setting}={value}"
        elif not _passes_through(plain, groups):
            check_value(plain, value, check_key(plain, groups))
    return out


_WARNED: set[str] = set()
# Keys renamed for clarity; the old name still works for one release, with a note.
RENAMED = {"decoder.gamma_floor": "decoder.prefix_mass_floor"}  # a probability, not a draft length like gamma


def stage_setting(key: str, stage: str | None) -> str | None:
    """``"<stage>.<key>"`` when the override key ``key`` sets a stage's setting (``stage.<k>`` for ``stage``, the
    running stage; ``settings.<stage>.<k>``; the deprecated ``<stage>.<k>``), checked against that stage's schema;
    None for any other key."""
    head, _, rest = key.partition(".")
    if head == "stage" and rest:
        if rest == "name":
            raise OverrideError("stage.name is set by choosing the stage: use stage=<name>")
        if stage is None:
            which = "no stage= was given"
        elif "," in stage:
            which = f"stage={stage} is a sweep over stages"
        elif stage not in STAGE_SCHEMAS:
            which = f"stage={stage} has no settings"
        else:
            which = None
        if which is not None:
            raise OverrideError(
                f"{key} sets a setting of the running stage, but {which}; the stages with settings are "
                f"{', '.join(STAGE_SCHEMAS)} (e.g. stage=spot stage.steps=2000, or settings.spot.steps=2000)"
            )
        name = stage
    elif head == "settings" and rest:
        name, _, rest = rest.partition(".")
        if name not in STAGE_SCHEMAS:
            raise OverrideError(f"settings.{name}: no stage {name!r} has settings; valid: {', '.join(STAGE_SCHEMAS)}")
        if not rest:
            raise OverrideError(f"{key} needs a setting, e.g. settings.{name}.<key>=value")
    elif head in STAGE_SCHEMAS and rest:
        name = head
        if key not in _WARNED:  # once per process: stage=pipeline composes every stage from the same overrides
            _WARNED.add(key)
            print(
                f"streakline: {key}= is deprecated and goes in the next release; write stage.{rest}= (with "
                f"stage={name}) or settings.{name}.{rest}= (from any stage, e.g. stage=pipeline)",
                file=sys.stderr,
            )
    else:
        return None
    check_key(rest, root=STAGE_SCHEMAS[name], where=f"stage={name}")
    return f"{name}.{rest}"


def _passes_through(key: str, groups: list[str]) -> bool:
    return (
        key.startswith("~") or "@" in key or "/" in key or key == "hydra" or key.startswith("hydra.") or key in groups
    )


def _check_presets(key: str, value: str, presets: list[str], conf_dirs: list[Path] = ()) -> None:
    if "/" in value and "(" not in value and "," not in value:
        if any((d / CHECKPOINT_GROUP / f"{value}.yaml").is_file() for d in conf_dirs):
            return  # a preset in a subfolder of conf/checkpoint/
        if value.startswith(("/", ".", "~")):
            fix = f"to point the role at a local checkpoint folder use {key}.path={value}"
        else:
            fix = f"for a Hugging Face hub id use {key}.hub_id={value}"
        raise OverrideError(
            f"'{value}' is not a checkpoint preset ({key}=NAME takes a file of conf/checkpoint/, e.g. "
            f"{presets[0] if presets else 'tiny-verifier'}); {fix}"
        )
    _check_option(
        key, value, presets,
        f"a checkpoint preset; {key}=NAME takes one of: {', '.join(presets)}. To point the role at a local folder "
        f"use {key}.path=/path/to/checkpoint",
    )  # fmt: skip


def _check_option(key: str, value: str, options: list[str], what: str) -> None:
    """Raise :class:`OverrideError` unless every name in ``value`` is one of ``options``; ``what`` ends the message
    ("'x' is not <what>"). A comma list is a multirun sweep; a function such as choice(...), ``null`` (no option)
    and a path into a subfolder are left to Hydra."""
    if "(" in value:
        return
    for name in (v.strip() for v in value.split(",")):
        if name not in options and name != "null" and "/" not in name:
            close = difflib.get_close_matches(name, options, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise OverrideError(f"'{name}' is not {what}{hint}")


def check_key(key: str, groups: list[str] | None = None, root: type = Config, where: str = "") -> Any:
    """Raise :class:`OverrideError` unless the dotted ``key`` names a field of the schema dataclass ``root`` (the
    :class:`Config` root, or a stage's settings named by ``where`` in messages); returns the field's type hint (a
    list's item type for an index).

    A list field also accepts one integer index (``data.prompt_sources.0``), and a list of sections an index and a
    field of its item (``settings.scaling.arms.1.every``).
    """
    parts = key.split(".")
    node: type = root
    depth = 0
    while depth < len(parts):
        part = parts[depth]
        fields = {
            k: v for k, v in schema_fields(node).items() if not (root is not Config and depth == 0 and k == "name")
        }
        if part not in fields:
            inside = ".".join(parts[:depth])
            valid = ", ".join(fields)
            if root is not Config:
                message = (
                    f"unknown setting '{key}' of {where}; valid{' under ' + repr(inside) if inside else ''}: {valid}"
                )
            elif not inside:
                groups_hint = f"config groups: {', '.join(groups)}; " if groups else ""
                message = f"unknown config key '{key}'; {groups_hint}top-level keys: {valid}"
            else:
                message = f"unknown config key '{key}'; valid keys under '{inside}': {valid}"
            close = difflib.get_close_matches(part, list(fields), n=1)
            raise OverrideError(message + (f" (did you mean '{close[0]}'?)" if close else ""))
        hint = _strip_optional(fields[part])
        depth += 1
        if dataclasses.is_dataclass(hint):
            node = hint
            continue
        rest = parts[depth:]
        if not rest:
            return fields[part]
        if typing.get_origin(hint) is list and rest[0].isdigit():
            item = _strip_optional((typing.get_args(hint) or (Any,))[0])
            if len(rest) == 1:
                return item
            if dataclasses.is_dataclass(item):  # a field of one entry of a list of sections
                node, depth = item, depth + 1
                continue
        raise OverrideError(f"unknown config key '{key}': '{'.'.join(parts[:depth])}' is a value, not a section")
    return node


# What OmegaConf reads as a bool (case-insensitive), and an integer or a float as Hydra's grammar writes them.
_BOOLS = {"true", "false", "yes", "no", "on", "off", "1", "0"}
_INT = re.compile(r"[+-]?\d[\d_]*")
_FLOAT = re.compile(r"[+-]?(\d[\d_]*\.?\d*|\.\d+)([eE][+-]?\d+)?|[+-]?(inf|nan)", re.IGNORECASE)
_KINDS = {int: ("an integer", "4"), float: ("a number", "1e-3"), bool: ("true or false", "true")}


def check_value(key: str, value: str, hint: Any) -> None:
    """Raise :class:`OverrideError` when ``value`` cannot be a value of the schema type ``hint`` (an int, float or
    bool field; others are left to OmegaConf): Hydra would say so in a multi-line error with status 1. A sweep
    (``1,2,3``) is checked item by item; interpolations, functions, quoted and list values pass through."""
    if value == "" or any(mark in value for mark in ("${", "(", "[", "{", "'", '"', "*")):
        return
    optional = typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint)
    kind = _strip_optional(hint)
    if kind not in _KINDS:
        return
    for item in (v.strip() for v in value.split(",")):
        if optional and item.lower() in ("null", "none"):
            continue
        ok = (
            item.lower() in _BOOLS
            if kind is bool
            else _INT.fullmatch(item) is not None
            if kind is int
            else _FLOAT.fullmatch(item) is not None
        )
        if not ok:
            what, example = _KINDS[kind]
            raise OverrideError(
                f"{key}={item} is not valid: {key} takes {what}{' or null' if optional else ''} (e.g. {key}={example})"
            )


def schema_fields(node: type) -> dict[str, type]:
    """Field name -> type hint of a schema dataclass, in declaration order."""
    hints = typing.get_type_hints(node)
    return {f.name: hints[f.name] for f in dataclasses.fields(node)}


def _strip_optional(hint: type) -> type:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint
