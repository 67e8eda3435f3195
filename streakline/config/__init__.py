"""The configuration layer: schema, validation, override checks, and one way to compose a config in code.

``streakline.cli`` composes through ``@hydra.main``; tests and tools that need a config without a command
line call :func:`compose_config`, which applies the same override rewriting, validation and path
resolution::

    from streakline.config import compose_config
    cfg = compose_config(["stage=distill", "model.verifier=qwen2.5-72b"])

The YAML presets live in the repository's ``conf/`` (:data:`CONF_DIR`); docs/config.md explains them.
"""

import copy
import os
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from streakline.config.overrides import OverrideError, config_groups, rewrite_overrides
from streakline.config.schema import STAGE_SCHEMAS, Config, register_configs
from streakline.config.validate import ConfigError, check_world, resolve_paths, stage_settings_node, validate

# conf/ sits beside the package in the source tree; the package is meant to be installed editable.
CONF_DIR = Path(__file__).resolve().parents[2] / "conf"

__all__ = [
    "CONF_DIR",
    "Config",
    "ConfigError",
    "OverrideError",
    "as_schema",
    "check_world",
    "compose_config",
    "register_configs",
    "resolve_paths",
    "rewrite_overrides",
    "validate",
]


def as_schema(cfg: DictConfig | dict) -> DictConfig:
    """Return ``cfg`` merged onto the :class:`Config` dataclass, in struct mode.

    Hydra's composition already starts from the schema, but ``+key=value`` overrides add keys with struct
    mode lifted, and a config-typed node merged onto the schema keeps them; going through a plain container
    makes every key face the dataclass again, however ``cfg`` was produced (a saved manifest, a dict).

    The running stage's node is typed by its settings schema (``STAGE_SCHEMAS``), and ``settings.<stage>`` (what
    ``stage.<key>=`` overrides and experiment files set) is applied over it: ``cfg.stage`` is then the one place a
    stage reads its settings from, however it was started.
    """
    plain = OmegaConf.to_container(cfg, resolve=False) if isinstance(cfg, DictConfig) else dict(cfg)
    name = (plain.get("stage") or {}).get("name")
    if name in STAGE_SCHEMAS:
        own = (plain.get("settings") or {}).get(name) or {}
        plain["stage"] = stage_settings_node(name, plain["stage"], own)
    merged = OmegaConf.merge(OmegaConf.structured(Config), plain)
    OmegaConf.set_struct(merged, True)
    return merged


def compose_config(overrides: Sequence[str] = (), check: bool = True) -> DictConfig:
    """Compose ``conf/config.yaml`` with command-line style ``overrides``, as ``launch.py`` would.

    The overrides are kept in ``cfg.overrides`` (stage=pipeline composes each stage from them). Inside a
    running Hydra app (launch.py) it composes with that app's search path.

    With ``check`` (the default) the result is validated and its paths made absolute. Must not be called
    while a Hydra app is running in this process (Hydra's global state is then already initialised).
    """
    from hydra import compose
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    args = rewrite_overrides(list(overrides), CONF_DIR)
    if GlobalHydra.instance().is_initialized():  # inside launch.py's app (stage=pipeline): compose in place
        cfg = as_schema(compose(config_name="config", overrides=args))
    else:
        fingerprint = _conf_fingerprint(CONF_DIR)
        key = (fingerprint, tuple(args))
        if key not in _COMPOSED:
            _COMPOSED[key] = as_schema(_composed_from_parts(fingerprint, args))
            _trim(_COMPOSED)
        _COMPOSED.move_to_end(key)
        cfg = copy.deepcopy(_COMPOSED[key])  # the caller's own: what it changes is not the next caller's
    cfg.overrides = args  # rewritten: a stage.<key> override is settings.<stage>.<key>, so chained stages read it right
    if check:
        validate(cfg)
        resolve_paths(cfg)
    return cfg


# Composed configs, by the files composed from and the overrides: Hydra's composition and the schema merge take about
# a quarter of a second on 2 CPU cores, and one process composes the same config many times (stage=pipeline and
# stage=scaling compose every stage and every planned run; the test suite, thousands). Validation and path
# resolution read the disk and the working directory, so they run on every call.
_COMPOSED: "OrderedDict[tuple, DictConfig]" = OrderedDict()
_COMPOSED_KEPT = 128


_FILES_COMPOSED: "OrderedDict[tuple, DictConfig]" = OrderedDict()  # Hydra's own result, by the group overrides


def _trim(kept: OrderedDict) -> None:
    while len(kept) > _COMPOSED_KEPT:
        kept.popitem(last=False)


def _composed_from_parts(fingerprint: int, args: list[str]) -> DictConfig:
    """What Hydra composes from ``args`` (rewritten), before the schema merge: the files the group overrides pick,
    composed once (:data:`_FILES_COMPOSED`), then the value overrides applied to a copy as Hydra applies them. Most
    configs one process composes differ only in values (a test's ``run_root``, a study run's token size), and
    composing the files is most of the cost. Where the split would not be exactly Hydra's order (a ``+key`` or
    ``~key`` among them, a sweep) or a value does not apply, Hydra composes the whole, and says what is wrong."""
    from hydra import compose, initialize_config_dir

    def hydra_compose(overrides: list[str]) -> DictConfig:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="streakline"):
            return compose(config_name="config", overrides=overrides)

    split = _split_overrides(args)
    if split is None:
        return hydra_compose(args)
    groups, values = split
    key = (fingerprint, tuple(groups))
    if key not in _FILES_COMPOSED:
        _FILES_COMPOSED[key] = hydra_compose(groups)
        _trim(_FILES_COMPOSED)
    _FILES_COMPOSED.move_to_end(key)
    cfg = copy.deepcopy(_FILES_COMPOSED[key])
    try:
        for override in values:  # in order, after every file, as Hydra's config loader applies them
            force = override.is_force_add()
            OmegaConf.update(cfg, override.key_or_group, override.value(), merge=True, force_add=force)
    except Exception:  # noqa: BLE001 - Hydra composes it again and raises its own, clearer error
        return hydra_compose(args)
    return cfg


def _split_overrides(args: list[str]) -> tuple[list[str], list] | None:
    """``(group overrides, parsed value overrides)`` of ``args``, or None where composing them apart would not be
    Hydra's composition: Hydra picks the files by the group overrides, then applies every other override in
    order, so group overrides plus ``key=value`` and ``++key=value`` overrides split exactly; ``+key`` (which fails
    on an existing key), ``~key``, sweeps and ``hydra.*`` keys stay with Hydra."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides=args)
    except Exception:  # noqa: BLE001 - Hydra's own parse error, from Hydra
        return None
    on_disk, groups, values = set(config_groups(CONF_DIR)), [], []
    for arg, o in zip(args, parsed, strict=True):
        key = o.key_or_group
        if o.is_sweep_override() or o.is_add() or o.is_delete() or key == "hydra" or key.startswith("hydra."):
            return None
        if o.package is not None or "/" in key or key in on_disk:  # a group, as rewrite_overrides tells them
            groups.append(arg)
        else:
            values.append(o)
    return groups, values


def _conf_fingerprint(conf_dir: Path) -> int:
    """The YAML files under ``conf_dir`` with their sizes and modification times: a file added, removed or edited
    changes it, so a composed config is reused only while what it was composed from is unchanged."""
    files = []
    for folder, _, names in os.walk(conf_dir):
        for name in names:
            if name.endswith(".yaml"):
                stat = os.stat(os.path.join(folder, name))
                files.append((folder, name, stat.st_size, stat.st_mtime_ns))
    return hash(tuple(sorted(files)))
