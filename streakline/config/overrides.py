"""Command-line overrides, checked and rewritten before Hydra sees them.

Two things happen here, for ``streakline.cli`` and for :func:`streakline.config.compose_config` alike:

* the role-swap shorthand ``model.verifier=NAME`` (also ``model.drafter``, ``model.target``; NAME a
  file in ``conf/checkpoint/``) becomes ``checkpoint@model.verifier=NAME``, the key under which Hydra
  knows the model preset's package-directive default ``- /checkpoint@verifier: ...``;
* every plain ``a.b.c=value`` key is looked up in the dataclass schema, so a typo such as
  ``trainer.lrr=1`` stops with the valid keys at that level instead of Hydra's bare "Could not override".

Group selections (``model=dream``, ``+group=option``), ``hydra.*`` keys, deletions (``~key``) and keys
with ``@`` or ``/`` pass through for Hydra to judge. ``+key=value`` and ``++key=value`` are checked like
plain keys: Hydra adds such keys with struct mode lifted, and the schema has no room for new ones.

Try it: ``python launch.py --cfg job model.verifier=qwen2.5-72b``.
"""

import dataclasses
import difflib
import types
import typing
from pathlib import Path

from streakline.config.schema import ROLES, Config

ROLE_KEYS = tuple(f"model.{role}" for role in ROLES)
CHECKPOINT_GROUP = "checkpoint"
# Hydra's flags that take a value (hydra/_internal/utils.py get_args_parser); the value is never an override.
VALUE_FLAGS = {"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn", "--experimental-rerun"}
# A folder Hydra searches besides ours; presets found there are valid role-swap names.
CONF_DIR_FLAGS = {"--config-dir", "-cd"}


class OverrideError(ValueError):
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
    out = list(args)
    for position, arg in overrides:
        key, value = arg.split("=", 1)
        if key in ROLE_KEYS:
            _check_presets(key, value, presets)
            out[position] = f"{CHECKPOINT_GROUP}@{key}={value}"
            continue
        plain = key.lstrip("+")
        if not _passes_through(plain, groups):
            check_key(plain, groups)
    return out


def _passes_through(key: str, groups: list[str]) -> bool:
    return (
        key.startswith("~") or "@" in key or "/" in key or key == "hydra" or key.startswith("hydra.") or key in groups
    )


def _check_presets(key: str, value: str, presets: list[str]) -> None:
    # A comma list is a multirun sweep over presets; a function such as choice(...) is left to Hydra.
    if "(" in value:
        return
    for name in (v.strip() for v in value.split(",")):
        if name not in presets:
            raise OverrideError(
                f"'{name}' is not a checkpoint preset; {key}=NAME takes one of: {', '.join(presets)}. "
                f"To point the role at a local folder use {key}.path=/path/to/checkpoint"
            )


def check_key(key: str, groups: list[str] | None = None) -> None:
    """Raise :class:`OverrideError` unless the dotted ``key`` names a field of the :class:`Config` schema.

    A list field also accepts one integer index (``data.prompt_sources.0``).
    """
    parts = key.split(".")
    node: type = Config
    for depth, part in enumerate(parts):
        fields = schema_fields(node)
        if part not in fields:
            where = ".".join(parts[:depth])
            valid = ", ".join(fields)
            if not where:
                groups_hint = f"config groups: {', '.join(groups)}; " if groups else ""
                message = f"unknown config key '{key}'; {groups_hint}top-level keys: {valid}"
            else:
                message = f"unknown config key '{key}'; valid keys under '{where}': {valid}"
            close = difflib.get_close_matches(part, list(fields), n=1)
            raise OverrideError(message + (f" (did you mean '{close[0]}'?)" if close else ""))
        hint = _strip_optional(fields[part])
        if dataclasses.is_dataclass(hint):
            node = hint
            continue
        rest = parts[depth + 1 :]
        if not rest or (typing.get_origin(hint) is list and len(rest) == 1 and rest[0].isdigit()):
            return
        raise OverrideError(f"unknown config key '{key}': '{'.'.join(parts[: depth + 1])}' is a value, not a section")


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
