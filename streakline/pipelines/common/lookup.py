"""Where each stage's artifact lives, and how a later stage finds it.

A stage's run folder is ``<run_root>/<experiment>/<stage>/<hash of its run key>/``; the key is what the artifact
depends on and nothing else. The keys of the stages whose artifacts other stages read live here, so the producer
and its consumers compute the same folder without importing each other:

| artifact | key | found by |
|---|---|---|
| trajectories (``shards/``) | ``trajectories_key`` | ``trajectories_dir`` (stage=distill) |
| SPOT order model (``order_model/``) | ``spot_key`` | ``locate_order_model``: newest match (decoder=spot) |
| Spiffy graph (``graph.json``) | ``spiffy_key`` | ``locate_graph``: newest match (decoder=spiffy) |
| distilled drafters (``drafter/``) | the distill stage's own key | ``distill_runs`` (stage=evaluate, stage=sweep) |
| their checkpoints (``checkpoints/step-*``) | the same | ``distill_checkpoints`` (Fig. 7: evaluate, sweep) |

Trajectories are found by their key (distill must train on exactly the data its settings name). Order models and
graphs are found by what the decoder needs (same target, its weights, block size and tokenizer; the rule, and for a
graph the temperature), newest first: a consumer does not repeat the producer's settings, and ``decoder.artifact``
picks one by hand, refused when it was made for another target or block size.

Keys hold content, not names (``fingerprints.py``): a data file by its sha256, a hub id by its snapshot commit, a
checkpoint folder of the user's by its fingerprint; each part is left out where the name was already exact (a
folder a finished stage wrote, a preset, a built-in source), so those runs keep their folders.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any, NamedTuple

import torch
from omegaconf import DictConfig, OmegaConf

from streakline.artifacts import complete_runs, config_hash, manifest_or_none, run_path
from streakline.data.benchmarks import parse_source
from streakline.data.self_chat import SELF_CHAT
from streakline.models import CheckpointError

from .fingerprints import role_parts, source_files, target_identity, target_overrides, weights_parts
from .roles import required_tokenizer

GRAPH = "graph.json"
ORDER_MODEL = "order_model"
# Bump when stage=spiffy's code changes what a config produces (prompt encoding, trace pairing), so that an old run
# with the same settings is not reused.
SPIFFY_RECIPE = 1
# How a set of several prompt sources orders them: "interleaved" (data/mix.py), so that a prefix of a set is the set
# at a smaller data.max_prompts. Sets made before it listed the sources one after another and carry no "mix".
MIX_ORDER = "interleaved"


# --------------------------------------------------------------------------------------------- trajectories
def role_key(cfg: DictConfig, role: str) -> dict[str, Any]:
    """A role's preset as a run key holds it: everything but ``devices`` (where it runs, not what it is; runs from
    before the field existed keep their folders), and what its path or hub id holds (``weights_parts``)."""
    out = OmegaConf.to_container(cfg.model[role], resolve=True)
    out.pop("devices", None)
    if out.get("source", "absent") is None:  # a field added later: unset, it must not move older runs' folders
        del out["source"]
    return {**out, **weights_parts(cfg, role)}


def trajectories_key(cfg: DictConfig, tok_hash: str) -> dict[str, Any]:
    """What the trajectories depend on, and nothing else (the decoder or trainer settings do not move the folder)."""
    node = cfg.model.verifier
    data = OmegaConf.to_container(cfg.data, resolve=True)
    for key, default in LATER_DATA_DEFAULTS.items():  # at their default, later fields leave older runs' folders be
        if data.get(key) == default:
            data.pop(key)
    data.pop("allow_eval_overlap", None)  # a permission: the rows do not depend on it
    data.pop("max_feature_gb", None)  # a limit on disk use: neither the rows nor the features depend on it
    data.pop("seed", None)  # the key's own "seed" is the one the rows are sampled with
    if data.get("batching") == "continuous":  # each row its own seed: the batch size changes no row (docs/data.md)
        data.pop("batch_size", None)
    key = {"verifier": node.path or node.hub_id, "tokenizer": tok_hash, "data": data, "seed": data_seed(cfg)}
    if len(cfg.data.prompt_sources) > 1:  # the sources interleaved (data/mix.py), not listed one after another
        key["mix"] = MIX_ORDER
    precision = frozen_precision(cfg)
    if precision != "fp32":  # what the rows were sampled in; fp32, what every run before the setting used, is unsaid
        key["precision"] = precision
    if any(parse_source(s)[0] == SELF_CHAT for s in cfg.data.prompt_sources):
        # the verifier's own requests: the verifier, seed and precision above pin them, with how they are written
        # and which evaluation prompts they keep out (common/self_chat.py)
        from .prompts import evaluation_sources
        from .self_chat import RECIPE

        key["self_chat"] = {"recipe": RECIPE, "excluded": dict(sorted(evaluation_sources(cfg).items()))}
    # what the names do not pin (fingerprints.py): nothing for a preset, the world's folders and built-in sources
    return {**key, **role_parts(cfg, "verifier"), **_files(cfg, cfg.data.prompt_sources)}


def frozen_dtype(cfg: DictConfig, role: str = "verifier") -> torch.dtype:
    """The dtype a frozen ``role`` (one that samples or scores, never trains) runs in here: ``models.precision.
    model_dtype`` of the top-level ``precision`` on this device (bf16 where the hardware multiplies it natively; a
    bf16 or fp16 preset stays in its own dtype). stage=trajectories samples the verifier in it, stage=evaluate and
    stage=decode run the verifier and the drafter in it."""
    from streakline.models.precision import model_dtype

    from .roles import device

    preset = str(cfg.model[role].get("dtype") or "float32")
    return model_dtype(cfg.get("precision", "auto"), preset, device(), params=verifier_params(cfg))


def verifier_params(cfg: DictConfig) -> int | None:
    """The verifier's parameter count where its preset gives its shapes (an ``arch`` block: the tiny and micro worlds),
    else None (a checkpoint folder's): what precision's size rule reads, for every role alike, so a drafter runs in
    its verifier's precision."""
    from streakline.models.builder import arch_config

    preset = cfg.model.get("verifier")
    if preset is None or preset.get("arch") is None:
        return None
    return arch_config(preset).num_parameters()


def frozen_precision(cfg: DictConfig, role: str = "verifier") -> str:
    """:func:`frozen_dtype` by name: ``fp32``, ``bf16`` or ``fp16`` (as run keys and records spell it)."""
    from streakline.models.precision import precision_name

    return precision_name(frozen_dtype(cfg, role))


def training_autocast(cfg: DictConfig) -> torch.dtype | None:
    """The autocast dtype stage=distill trains under here (``models.precision.training_autocast``: bf16 over an
    fp32 trainer where the device multiplies bf16 natively, unless ``precision=fp32`` or ``trainer.autocast=off``),
    or None."""
    from streakline.models.precision import training_autocast as resolve_autocast

    from .roles import device

    t = cfg.trainer
    return resolve_autocast(cfg.get("precision", "auto"), t.precision, t.get("autocast", "auto"), device())


def autocast_part(cfg: DictConfig) -> dict[str, str]:
    """``{"autocast": "bf16"}`` for a run key when distill autocasts, else ``{}``: runs trained in fp32, as every
    run before the setting was, keep their folders."""
    from streakline.models.precision import precision_name

    dtype = training_autocast(cfg)
    return {} if dtype is None else {"autocast": precision_name(dtype)}


def data_seed(cfg: DictConfig) -> int:
    """The seed the trajectories are sampled with: ``data.seed``, or the run's ``seed`` when that is unset. A run
    with ``data.seed`` equal to its ``seed`` has the key of one without it, so ``seed=1 data.seed=0`` trains on the
    trajectories ``seed=0`` made."""
    return cfg.seed if cfg.data.get("seed") is None else int(cfg.data.seed)


def _files(cfg: DictConfig, sources) -> dict[str, Any]:
    """``{"source_files": {source: digest}}`` for the sources that name a file, folder or hub dataset; else {}."""
    files = source_files(cfg, sources)
    return {"source_files": files} if files else {}


# ``data`` fields added after trajectories existed, with the default that reproduces what runs did before them.
LATER_DATA_DEFAULTS = {
    "long_prompts": "error", "fields": {}, "feature_layers": [], "skip_bad_lines": False, "batching": "fixed",
}  # fmt: skip


def trajectories_dir(cfg: DictConfig) -> Path:
    """The shard folder ``stage=trajectories`` writes for ``cfg`` (same verifier, tokenizer, data settings, seed).

    ``cfg`` must already point at its world (``attach_world``), as every stage's does when the runner calls it.
    """
    from streakline.models.tokenizer import tokenizer_hash

    key = trajectories_key(cfg, tokenizer_hash(required_tokenizer(cfg, "verifier", "trajectories")))
    return run_path(cfg.run_root, cfg.experiment.name, "trajectories", config_hash(key)) / "shards"


# --------------------------------------------------------------------------------------------- spot / spiffy
def stage_settings(cfg: DictConfig) -> dict[str, Any]:
    """The running stage's own settings (``cfg.stage`` without its name), as plain data for a run key."""
    settings = OmegaConf.to_container(cfg.stage, resolve=True)
    settings.pop("name", None)
    return settings


def _trace_settings(cfg: DictConfig) -> dict[str, Any]:
    """stage=spot's / stage=spiffy's settings for their key: ``threshold`` only counts for the threshold rule (the
    static rule's traces do not depend on it, and runs from before it was a setting keep their folders)."""
    settings = stage_settings(cfg)
    if settings.get("rule") != "threshold":
        settings.pop("threshold", None)
    return settings


def spot_key(cfg: DictConfig, tokenizer) -> dict[str, Any]:
    """What an order model depends on: the target preset (its folder included), its tokenizer, stage=spot's
    settings. (The settings keep the key ``spot``, so runs from before settings moved under ``stage`` keep their
    folders.)"""
    from streakline.models.tokenizer import tokenizer_hash

    return {
        "target": role_key(cfg, "target"),
        "tokenizer": tokenizer_hash(tokenizer),
        "spot": _trace_settings(cfg),
        "prompt_format": _prompt_format(cfg, tokenizer),
        **_files(cfg, cfg.stage.prompt_sources),
    }


def spiffy_key(cfg: DictConfig, tokenizer) -> dict[str, Any]:
    """What a graph depends on: the target preset (its folder included), its tokenizer, stage=spiffy's settings,
    the recipe."""
    from streakline.models.tokenizer import tokenizer_hash

    key = {
        "target": role_key(cfg, "target"),
        "tokenizer": tokenizer_hash(tokenizer),
        "spiffy": _trace_settings(cfg),
        "recipe": SPIFFY_RECIPE,
        **_files(cfg, cfg.stage.prompt_sources),
    }
    prompt_format = _prompt_format(cfg, tokenizer)
    if prompt_format != "prompt_text":  # graphs from before the choice existed keep their folders
        key["prompt_format"] = prompt_format
    return key


def _prompt_format(cfg: DictConfig, tokenizer) -> str:
    """How the trace collectors render prompts (``common.prompts``): through the chat template, or as raw text."""
    from .prompts import template_applied

    return "chat_template" if template_applied(tokenizer, cfg.data.chat_template) else "prompt_text"


class BlockArtifact(NamedTuple):
    """What a drafted block decoder reads, as the lookup and its refusals name it."""

    output: str  # its file or folder in the run folder of the stage that makes it
    what: str  # what a refusal for want of one calls it
    made: str  # what the refusal of one picked by hand (made for another target) calls it
    pick: str  # what ``decoder.artifact`` should point at


# by the stage that makes it, which is also the decoder that reads it
BLOCK_ARTIFACTS = {
    "spot": BlockArtifact(ORDER_MODEL, "trained order model", "SPOT order model", "an order_model folder"),
    "spiffy": BlockArtifact(GRAPH, "Spiffy graph", "Spiffy graph", "a graph.json"),
}


def _wanted(cfg: DictConfig, stage: str, temperature: float | None = None) -> dict[str, Any]:
    """The settings a ``stage`` artifact must have been made with: the draft-free rule (``decoder.rule``, with its
    threshold if it has one) and, for a Spiffy graph, the temperature (``temperature``, default
    ``decoder.temperature``; an order model serves any temperature)."""
    if cfg.decoder.rule == "threshold":
        wanted = {"rule": "threshold", "threshold": float(cfg.decoder.threshold)}
    else:
        wanted = {"rule": cfg.decoder.rule}
    if stage == "spiffy":
        wanted["temperature"] = float(cfg.decoder.temperature if temperature is None else temperature)
    return wanted


def locate_order_model(cfg: DictConfig) -> Path:
    """The order-model folder ``decoder=spot`` uses: ``decoder.artifact`` if set (refused when made for another
    target or block size), else the newest complete ``stage=spot`` run of this experiment for the same target, its
    weights, block size and tokenizer whose traces came from ``decoder.rule`` (an order model serves any
    temperature); CheckpointError saying what to run otherwise."""
    wanted = _wanted(cfg, "spot")
    if cfg.decoder.artifact:
        folder = Path(cfg.decoder.artifact).expanduser().absolute()
        if not (folder / "config.json").is_file():
            raise CheckpointError(
                f"decoder.artifact={cfg.decoder.artifact} is not an order-model folder (no config.json there); "
                "point it at the order_model/ folder of a stage=spot run"
            )
        _check_made_for(cfg, "spot", _recorded(folder / TARGET_RECORD, folder.parent), wanted)
        return folder
    return _newest_run(cfg, "spot", wanted)


def locate_graph(cfg: DictConfig, temperature: float | None = None) -> Path:
    """The graph.json ``decoder=spiffy`` uses: ``decoder.artifact`` (the file, or a folder holding it) if set
    (refused when calibrated on another target or block size), else the newest complete ``stage=spiffy`` run of
    this experiment for the same target, its weights, block size and tokenizer calibrated for ``decoder.rule`` at
    ``temperature`` (default ``decoder.temperature``); CheckpointError otherwise."""
    wanted = _wanted(cfg, "spiffy", temperature)
    if cfg.decoder.artifact:
        path = Path(cfg.decoder.artifact).expanduser().absolute()
        if path.is_dir():
            path = path / GRAPH
        if not path.is_file():
            raise CheckpointError(
                f"decoder.artifact={cfg.decoder.artifact} is not a Spiffy graph (no {path.name} there); point it at "
                "the graph.json of a stage=spiffy run"
            )
        _check_made_for(cfg, "spiffy", _recorded(path, path.parent, header=True), wanted)
        return path
    return _newest_run(cfg, "spiffy", wanted)


# What stage=spot writes beside its order model: the target it was trained for (``fingerprints.target_identity``).
TARGET_RECORD = "target.json"
IDENTITY = ("target", "target_fingerprint", "block_size")


def _recorded(path: Path, run: Path, header: bool = False) -> dict[str, Any]:
    """The target identity an artifact records (``IDENTITY``, the fields it has): the graph's header or the order
    model's ``target.json``, else the metrics of the run folder ``run`` it sits in; {} when none says."""
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
        found = found.get("header", {}) if header else found
    except (OSError, ValueError, AttributeError):
        found = {}
    if not found.get("target_fingerprint"):
        manifest = manifest_or_none(run)
        if manifest is not None:
            found = {**manifest.metrics, **{k: v for k, v in found.items() if v is not None}}
    return {k: found[k] for k in IDENTITY if found.get(k) is not None}


def _check_made_for(cfg: DictConfig, stage: str, recorded: dict[str, Any], wanted) -> None:
    """Refuse, in one line naming the command that makes a matching one, an artifact recorded as made for another
    target fingerprint or block size than ``model.target`` (an artifact that records neither passes)."""
    checked = [k for k in ("target_fingerprint", "block_size") if k in recorded]
    mine = target_identity(cfg) if checked else {}
    if all(recorded[k] == mine[k] for k in checked):
        return
    names = BLOCK_ARTIFACTS[stage]

    def said(identity: dict[str, Any]) -> str:
        return (f"target {identity.get('target', '?')} (block size {identity.get('block_size', '?')}, weights "
                f"{identity.get('target_fingerprint', '?')})")  # fmt: skip

    raise CheckpointError(
        f"decoder.artifact={cfg.decoder.artifact} is a {names.made} made for {said(recorded)}, not for model.target: "
        f"{said(mine)}; make one for this target with {_make_command(cfg, stage, wanted)}, or set "
        f"decoder.artifact=<{names.pick} made for it>"
    )


def _make_command(cfg: DictConfig, stage: str, wanted: dict[str, Any]) -> str:
    need = " ".join(f"stage.{k}={v}" for k, v in wanted.items())
    return f"python launch.py stage={stage} model={cfg.model.name} {target_overrides(cfg)}{need}"


def _newest_run(cfg: DictConfig, stage: str, wanted: dict[str, Any]) -> Path:
    """The artifact (``BLOCK_ARTIFACTS[stage].output``) of the newest complete ``stage`` run of this experiment whose
    key has this target (its weights included), its tokenizer, and settings equal to ``wanted``, and whose metrics
    record this target's fingerprint and block size (a run from before they were recorded is judged by its key);
    CheckpointError naming the command that makes one otherwise."""
    from streakline.models.tokenizer import tokenizer_hash

    target = role_key(cfg, "target")
    mine = target_identity(cfg)
    tok = tokenizer_hash(required_tokenizer(cfg, "target", stage))
    found, other, elsewhere = [], 0, 0
    for folder, m in complete_runs(cfg.run_root, cfg.experiment.name, stage):
        if m.config.get("target") != target or m.config.get("tokenizer") != tok:
            elsewhere += 1
            continue
        if any(m.metrics.get(k) is not None and m.metrics[k] != mine[k] for k in ("target_fingerprint", "block_size")):
            elsewhere += 1
            continue
        settings = m.config.get(stage, {})
        if all(settings.get(k) == v for k, v in wanted.items()):
            found.append((m.finished_at, folder))
        else:
            other += 1
    names = BLOCK_ARTIFACTS[stage]
    if found:
        return max(found)[1] / names.output
    need = " ".join(f"stage.{k}={v}" for k, v in wanted.items())
    elsewhere = f" ({elsewhere} complete run(s) there are for another target or tokenizer)" if elsewhere else ""
    others = f" ({other} complete run(s) there have other settings)" if other else ""
    raise CheckpointError(
        f"no {names.what} for target {cfg.model.target.name} (block size {mine['block_size']}) with "
        f"{need.replace('stage.', '')} in experiment {cfg.experiment.name!r}{elsewhere}{others}; run "
        f"{_make_command(cfg, stage, wanted)} first, or set decoder.artifact=<{names.pick}>"
    )


def precheck_block_artifact(cfg: DictConfig, decoder: str, temperatures: list[float] | None = None) -> None:
    """Before a world is built for ``model.target``: refuse a drafted block decoder (``spot``, ``spiffy``) that no
    complete run of its stage in this experiment could serve, judged by what is known before the build: the
    target's preset name and block size. A changed ``model.target.block_size`` or target preset means a new world
    (a quarter of an hour for the tiny one) that the lookup would refuse right after; this says so first. A run
    that records no block size passes (the lookup judges it by its key, after the build)."""
    node = cfg.model.target
    if decoder not in BLOCK_ARTIFACTS or node.path or cfg.model.get("world") is None:
        return
    block = node.block_size
    if cfg.decoder.artifact:  # hand-picked: judged by what it records, the weights' fingerprint after the build
        _precheck_picked(cfg, decoder)
        return
    for _, m in complete_runs(cfg.run_root, cfg.experiment.name, decoder):
        recorded = m.metrics.get("block_size")
        if (m.config.get("target") or {}).get("name") == node.name and recorded in (None, block):
            return
    names = BLOCK_ARTIFACTS[decoder]
    wanted = _wanted(cfg, decoder, temperatures[0] if temperatures else None)
    raise CheckpointError(
        f"no {names.what} for target {node.name} (block size {block}) in experiment {cfg.experiment.name!r}, so "
        f"decoder={decoder} would be refused after building a new world for this target; run "
        f"{_make_command(cfg, decoder, wanted)} first (it builds the world), or set decoder.artifact=<{names.pick}>"
    )


def _precheck_picked(cfg: DictConfig, decoder: str) -> None:
    """Refuse a hand-picked ``decoder.artifact`` recorded as made for another target preset or block size than
    ``model.target``, before a world is built for the target (the lookup would refuse it right after). What the
    artifact does not record, or a path that is not there, is left to the lookup."""
    path = Path(cfg.decoder.artifact).expanduser().absolute()
    if decoder == "spot":
        recorded = _recorded(path / TARGET_RECORD, path.parent) if path.is_dir() else {}
    else:
        graph = path / GRAPH if path.is_dir() else path
        recorded = _recorded(graph, graph.parent, header=True) if graph.is_file() else {}
    node = cfg.model.target
    if recorded.get("block_size", node.block_size) == node.block_size and recorded.get("target", node.name) == (
        node.name
    ):
        return
    names = BLOCK_ARTIFACTS[decoder]
    raise CheckpointError(
        f"decoder.artifact={cfg.decoder.artifact} is a {names.made} made for target {recorded.get('target', '?')} "
        f"(block size {recorded.get('block_size', '?')}), not for model.target: {node.name} (block size "
        f"{node.block_size}), which would need a new world built first; set model.target.block_size="
        f"{recorded.get('block_size', node.block_size)} to use it, or make one with "
        f"{_make_command(cfg, decoder, _wanted(cfg, decoder))}"
    )


def locate_block_artifact(cfg: DictConfig, decoder: str, temperature: float | None = None) -> Path:
    """The artifact a drafted block decoder (``spot`` or ``spiffy``) reads at ``temperature`` (default
    ``decoder.temperature``)."""
    if decoder == "spot":
        return locate_order_model(cfg)  # an order model serves every temperature
    if decoder == "spiffy":
        return locate_graph(cfg, temperature)
    raise ValueError(f"decoder={decoder} reads no stage artifact; valid: spot, spiffy")


# --------------------------------------------------------------------------------------------- distill
def distill_runs(cfg: DictConfig) -> list[dict[str, Any]]:
    """Complete ``stage=distill`` runs of this experiment: ``{"folder", "method", "steps", "decoder_streak",
    "start", "start_key"}``, oldest first. ``start`` is the drafter folder the run started from: its ``init/`` for a
    DFlash drafter built from scratch, else the drafter's path or hub id from the run key (None when it has none);
    ``start_key`` is equal for runs that started from the same weights (the same folder, or the same from-scratch
    preset and seed, whose seeded initialisations are equal). A run's intermediate checkpoints are listed by
    :func:`distill_checkpoints`; which kind of drafter its exports are, and so their decoder, is
    ``kinds.drafter_kind(cfg, <folder>/drafter)``."""
    runs = []
    for folder, m in complete_runs(cfg.run_root, cfg.experiment.name, "distill"):
        if not (folder / "drafter").is_dir():
            continue
        streaks = [v for k, v in m.metrics.items() if k.endswith("/decoder_streak") and isinstance(v, int | float)]
        runs.append(
            {
                "folder": str(folder),
                "method": m.config.get("method", {}).get("name", "distilled"),
                "steps": m.metrics.get("steps"),
                "decoder_streak": sum(streaks) / len(streaks) if streaks else None,
                **_start(folder, m.config),
                "finished_at": m.finished_at,
            }
        )
    return sorted(runs, key=lambda r: r["finished_at"])


def _start(folder: Path, key: dict[str, Any]) -> dict[str, str | None]:
    """``start`` and ``start_key`` of a distill run (:func:`distill_runs`) from its folder and run key."""
    drafter = key.get("drafter")
    if (folder / "init").is_dir():
        return {"start": str(folder / "init"), "start_key": json.dumps([drafter, key.get("seed")], sort_keys=True)}
    if isinstance(drafter, dict):  # a kind's own key of a folder (kinds/dflash.py): {"kind": ..., "weights": ...}
        drafter = drafter.get("weights")
    return {"start": drafter, "start_key": drafter} if isinstance(drafter, str) else {"start": None, "start_key": None}


def distill_checkpoints(run: dict[str, Any]) -> list[tuple[int, str]]:
    """(steps, folder) of every checkpoint of a :func:`distill_runs` run, by steps: each ``checkpoints/step-*``
    folder, and the final ``drafter/`` unless a step checkpoint of the same step count exists (same weights)."""
    folder = Path(run["folder"])
    found = {int(p.name.split("-")[1]): str(p) for p in folder.glob("checkpoints/step-*") if p.name[5:].isdigit()}
    if run["steps"] is not None and run["steps"] not in found:
        found[int(run["steps"])] = str(folder / "drafter")
    return sorted(found.items())


# --------------------------------------------------------------------------------------------- chains of stages
def stage_overrides(cfg: DictConfig, entry: str) -> tuple[str, list[str]]:
    """(stage name, overrides to compose it with) for one chained entry such as ``"distill method=ar_distill"``:
    the command line's overrides without its ``stage=``, then the entry's own."""
    name, *extra = shlex.split(entry)
    base = [o for o in cfg.overrides if o.split("=", 1)[0].lstrip("+~") != "stage"]
    return name, [*base, f"stage={name}", *extra]
