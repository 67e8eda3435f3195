"""Checks on a composed config that the type system cannot express, and path resolution.

The schema (``schema.py``) already rejects unknown keys and wrongly typed values; this module rejects
values that are well typed but wrong: a choice outside its tuple, a size that is not positive, a
block-causal checkpoint without a block size, a role with nowhere to get weights from. Every error
is a :class:`ConfigError` whose message names the full key, the bad value and what would be valid.

``streakline.cli`` calls :func:`validate` and then :func:`resolve_paths` on the driver, before any stage
runs; tests call them on every composed preset (``pytest tests/config``).
"""

import math
import os
import re
from collections.abc import Iterable
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from streakline.config.schema import (
    ACCEPTANCE_RULES,
    ATTENTION_MODES,
    AUTOCASTS,
    BATCHINGS,
    CHECKPOINT_KINDS,
    DECODERS,
    DIVERGENCES,
    DTYPES,
    ENGINES,
    FAMILY_CHOICES,
    INFERENCE_PRECISIONS,
    LAUNCHERS,
    LONG_PROMPTS,
    LOSSES,
    PRECISIONS,
    ROLES,
    SCALING_METRICS,
    SELECTIONS,
    STAGE_SCHEMAS,
    STAGES,
    TEACHERS,
    TRAJECTORY_BACKENDS,
    ZERO_STAGES,
)
from streakline.errors import UserError

# method.features: where a DFlash drafter's verifier layer states come from (docs/dflash.md, Offline features)
FEATURE_SOURCES = ("online", "stored")


class ConfigError(UserError, ValueError):
    """A composed config that is well typed but cannot be run."""


def validate(cfg: DictConfig) -> None:
    """Raise :class:`ConfigError` on the first problem found in ``cfg`` (a composed root config)."""
    _no_missing(cfg, "")
    _choice(cfg, "stage.name", STAGES)
    _between(cfg, "seed", 0, 2**32 - 1)
    _choice(cfg, "precision", INFERENCE_PRECISIONS)
    if not cfg.run_root:
        raise ConfigError("run_root is empty; give a folder for run outputs, e.g. run_root=runs")
    for role in ROLES:
        _checkpoint(cfg, f"model.{role}")
    _dflash(cfg)
    if cfg.stage.name == "bootstrap":
        check_world(cfg)
    _method(cfg)
    _data(cfg)
    _trainer(cfg)
    _decoder(cfg)
    _launcher(cfg)
    _experiment(cfg)
    _settings(cfg)


def resolve_paths(cfg: DictConfig) -> DictConfig:
    """Make ``run_root``, every role's ``path`` / ``tokenizer``, ``trainer.resume_from`` and stage=scaling's
    ``stage.prior`` and ``stage.ledger`` files absolute, in place; returns ``cfg``.

    Relative paths are taken against the current directory, which Hydra leaves alone
    (``hydra.job.chdir=false``), so they mean what they meant on the command line. Workers receive the
    resolved config and never resolve again.
    """
    cfg.run_root = _absolute(cfg.run_root)
    for role in ROLES:
        node = cfg.model[role]
        for key in ("path", "tokenizer"):
            if node[key] is not None:
                node[key] = _absolute(node[key])
    if cfg.trainer.resume_from:  # the run to extend, as the command line meant it (Slurm jobs start elsewhere)
        cfg.trainer.resume_from = _absolute(cfg.trainer.resume_from)
    stage = cfg.get("stage")
    if stage is not None and stage.get("prior"):  # earlier sittings' reports (stage=scaling)
        stage.prior = [_absolute(p) for p in stage.prior]
    if stage is not None and stage.get("ledger"):  # the file stage=scaling reads and writes back
        stage.ledger = _absolute(stage.ledger)
    return cfg


def _absolute(path: str) -> str:
    # abspath rather than resolve(): keep symlinked checkpoint folders under the name the user gave.
    return os.path.abspath(os.path.expanduser(path))


def _devices(devices: Any, key: str) -> None:
    """``None``, ``auto``, or a non-empty list of GPU indices and device names (``cpu``, ``cuda``, ``cuda:1``)."""
    if devices is None or devices == "auto":
        return
    items = list(devices) if isinstance(devices, (list, tuple, ListConfig)) else None
    bad = [
        d for d in items or [] if not (isinstance(d, int) and d >= 0) and not re.fullmatch(r"cpu|cuda(:\d+)?", str(d))
    ]
    if not items or bad:
        raise ConfigError(
            f"{key}={devices} is not valid; use {key}=auto (every GPU), a list such as {key}=[0,1] or "
            f"[cuda:0,cuda:1], or null (one device)" + (f"; {bad[0]!r} names no device" if bad else "")
        )


def _no_missing(node: DictConfig, prefix: str) -> None:
    # Checked first so that later checks can read any field without tripping MissingMandatoryValue.
    for key in node:
        full = f"{prefix}{key}"
        if OmegaConf.is_missing(node, key):
            raise ConfigError(f"{full} is required but no preset or override sets it (it is ???)")
        child = node[key]
        if isinstance(child, DictConfig):
            _no_missing(child, f"{full}.")


def _get(cfg: DictConfig, key: str) -> Any:
    return OmegaConf.select(cfg, key, throw_on_missing=True)


def _choice(cfg: DictConfig, key: str, valid: Iterable[Any], context: str = "") -> None:
    value = _get(cfg, key)
    if value not in valid:
        choices = ", ".join(str(v) for v in valid)
        raise ConfigError(f"{key}={value!r} is not valid{context}; choose one of: {choices}")


def _at_least(cfg: DictConfig, key: str, low: float, optional: bool = False) -> None:
    value = _get(cfg, key)
    if value is None and optional:
        return
    if value is None or not value >= low:  # NaN too
        raise ConfigError(f"{key}={value!r} is not valid; it must be >= {low}" + (" or null" if optional else ""))


def _positive(cfg: DictConfig, key: str) -> None:
    value = _get(cfg, key)
    if not value > 0:
        raise ConfigError(f"{key}={value!r} is not valid; it must be > 0")


def _between(cfg: DictConfig, key: str, low: float, high: float) -> None:
    value = _get(cfg, key)
    if not low <= value <= high:
        raise ConfigError(f"{key}={value!r} is not valid; it must lie in [{low}, {high}]")


def _checkpoint(cfg: DictConfig, key: str) -> None:
    node = _get(cfg, key)
    preset = f" (checkpoint preset {node.name!r})"
    _choice(cfg, f"{key}.family", FAMILY_CHOICES, context=preset)
    _choice(cfg, f"{key}.attention", ATTENTION_MODES, context=preset)
    _choice(cfg, f"{key}.dtype", DTYPES, context=preset)
    _at_least(cfg, f"{key}.gamma", 1)
    _devices(node.devices, f"{key}.devices")
    _at_least(cfg, f"{key}.block_size", 1, optional=True)
    if node.attention == "block_causal" and node.block_size is None:
        raise ConfigError(f"{key}.block_size is null but {key}.attention is block_causal{preset}; set {key}.block_size")
    if node.get("source") is not None:
        _source(cfg, key)
    elif node.path is None and node.hub_id is None and node.arch is None:
        raise ConfigError(
            f"{key}{preset} has no weights: set {key}.path (a local folder) or {key}.hub_id, "
            "or pick a tiny preset, which carries an arch"
        )
    if node.family == "auto" and node.path is None and node.hub_id is None:
        raise ConfigError(f"{key}.family=auto reads config.json from a checkpoint; set {key}.path or {key}.hub_id")
    if node.arch is not None:
        _arch(cfg, f"{key}.arch")
    _choice(cfg, f"{key}.kind", CHECKPOINT_KINDS, context=preset)


def _source(cfg: DictConfig, key: str) -> None:
    """An imported preset names one origin: a file in a package, or another role to cut layers from."""
    source = _get(cfg, f"{key}.source")
    _at_least(cfg, f"{key}.source.layers", 1, optional=True)
    from_file = source.package is not None or source.file is not None
    if from_file == (source.from_role is not None):
        raise ConfigError(
            f"{key}.source names {'both' if from_file else 'neither'} a file (package + file) "
            f"{'and' if from_file else 'nor'} a role to cut from (from_role); give exactly one"
        )
    if from_file and (source.package is None or source.file is None):
        raise ConfigError(f"{key}.source needs both package and file (the GGUF file's name inside that package)")
    if source.from_role is not None:
        _choice(cfg, f"{key}.source.from_role", ROLES)
        if f"model.{source.from_role}" == key:
            raise ConfigError(f"{key}.source.from_role={source.from_role} names the role itself; name another role")


def _dflash(cfg: DictConfig) -> None:
    """A DFlash preset drafts for the verifier: only in the drafter role, with the layers it reads and a block of at
    least the newest token and one mask; when both arches are known, the verifier's hidden size and vocabulary (it
    shares the verifier's embedding and head) and a layer id inside the verifier."""
    for role in ROLES:
        node = cfg.model[role]
        if node.kind == "dflash" and role != "drafter":
            raise ConfigError(
                f"model.{role}={node.name} is a DFlash drafter (kind=dflash), which only drafts for a verifier; "
                f"put it in the drafter role (model.drafter={node.name}) and give model.{role} a {role} preset"
            )
    node, key = cfg.model.drafter, "model.drafter"
    if node.kind != "dflash":
        return
    preset = f" (checkpoint preset {node.name!r})"
    if not node.target_layer_ids or min(node.target_layer_ids) < 0:
        raise ConfigError(
            f"{key}.target_layer_ids={node.target_layer_ids} is not valid{preset}: a DFlash drafter reads at least one "
            f"verifier layer (ids >= 0; id i is the stream entering layer i), e.g. {key}.target_layer_ids=[1,2]"
        )
    if node.block_size is None or node.block_size < 2:
        raise ConfigError(
            f"{key}.block_size={node.block_size} is not valid{preset}: a DFlash block holds the newest token and at "
            f"least one mask; set {key}.block_size >= 2 (drafts per cycle = block_size - 1)"
        )
    if node.gamma > node.block_size - 1:
        raise ConfigError(
            f"{key}.gamma={node.gamma} is more than a DFlash block of {node.block_size} drafts "
            f"({node.block_size - 1}); set {key}.gamma={node.block_size - 1}"
        )
    drafter, verifier = node.arch, cfg.model.verifier.arch
    if drafter is not None and (not drafter.qk_norm or drafter.qkv_bias):
        raise ConfigError(
            f"{key}.arch has qk_norm={drafter.qk_norm}, qkv_bias={drafter.qkv_bias}{preset}: DFlash layers are Qwen3's "
            f"(what speculators and vLLM load); set {key}.arch.qk_norm=true and {key}.arch.qkv_bias=false"
        )
    if drafter is None or verifier is None:
        return  # a checkpoint's shapes are checked when it is built (DFlashModel.share)
    for field in ("hidden_size", "vocab_size"):
        if drafter[field] != verifier[field]:
            raise ConfigError(
                f"{key}.arch.{field}={drafter[field]} but model.verifier.arch.{field}={verifier[field]}{preset}: a "
                f"DFlash drafter shares the verifier's embedding and head; pick the DFlash preset made for "
                f"model.verifier={cfg.model.verifier.name}"
            )
    if max(node.target_layer_ids) > verifier.num_layers:
        raise ConfigError(
            f"{key}.target_layer_ids={list(node.target_layer_ids)} reads past the verifier's {verifier.num_layers} "
            f"layers{preset}; ids go from 0 (the embedding output) to {verifier.num_layers} (the last layer's output)"
        )


def _arch(cfg: DictConfig, key: str) -> None:
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
        _at_least(cfg, f"{key}.{field}", 1)
    _at_least(cfg, f"{key}.head_dim", 1, optional=True)
    _at_least(cfg, f"{key}.max_position_embeddings", 1)
    _positive(cfg, f"{key}.rope_theta")
    _positive(cfg, f"{key}.rms_norm_eps")
    arch = _get(cfg, key)
    if arch.head_dim is None and arch.hidden_size % arch.num_heads:
        raise ConfigError(
            f"{key}.hidden_size={arch.hidden_size} is not divisible by {key}.num_heads={arch.num_heads}; "
            f"set {key}.head_dim explicitly"
        )
    if arch.num_heads % arch.num_kv_heads:
        raise ConfigError(
            f"{key}.num_heads={arch.num_heads} is not a multiple of {key}.num_kv_heads={arch.num_kv_heads}"
        )


def check_world(cfg: DictConfig) -> None:
    """Checks for building the world ``cfg.model`` describes: run by stage=bootstrap's validation and by
    ``attach_world`` before any other stage builds it. Other stages may freely swap a world's roles."""
    world = cfg.model.world
    if world is None:
        raise ConfigError(
            f"stage=bootstrap builds a world this project trains itself, but model={cfg.model.name} has no "
            "model.world recipe; use model=tiny (or model=micro for a seconds-long build)"
        )
    for role in ROLES:
        arch = cfg.model[role].arch
        if cfg.model[role].kind != "transformer":
            raise ConfigError(
                f"the {cfg.model.name} world builds its own {role}; model.{role}={cfg.model[role].name} is a "
                f"{cfg.model[role].kind} preset, which it does not build: drop the model.{role} override for "
                "stage=bootstrap (other stages use it beside the world)"
            )
        if arch is None:
            raise ConfigError(
                f"building the {cfg.model.name} world needs all three of its models, but model.{role} "
                f"({cfg.model[role].name}) is not one it can build; drop the model.{role} override"
            )
        if arch.vocab_size != world.vocab_size:
            raise ConfigError(
                f"model.{role}.arch.vocab_size={arch.vocab_size} differs from model.world.vocab_size="
                f"{world.vocab_size}; the three models share the world's tokenizer"
            )
    for key in ("vocab_size", "n_math", "window", "windows_per_seq", "report_prompts", "report_new_tokens"):
        _positive(cfg, f"model.world.{key}")
    _between(cfg, "model.world.drafter_full_share", 0.0, 1.0)
    _between(cfg, "model.world.drafter_ar_weight", 0.0, 100.0)
    for role in ROLES:
        for key in ("steps", "batch_size", "seq_len", "eval_every", "eval_batches"):
            _positive(cfg, f"model.world.{role}.{key}")
        _between(cfg, f"model.world.{role}.lr", 0.0, 1.0)
        _between(cfg, f"model.world.{role}.math_share", 0.0, 1.0)
    for i, role in enumerate(ROLES):
        source = world[role].init_from
        if source is None:
            continue
        if source not in ROLES[:i]:
            raise ConfigError(
                f"model.world.{role}.init_from={source!r} must name a role built before it: {', '.join(ROLES[:i])}"
            )
        if cfg.model[source].arch != cfg.model[role].arch:
            raise ConfigError(
                f"model.world.{role}.init_from={source} needs model.{role}.arch to equal model.{source}.arch "
                "(the weights are copied as they are)"
            )
    if world.window > world.drafter.seq_len // 2:
        raise ConfigError(
            f"model.world.window={world.window} leaves no room for a prefix in drafter sequences of "
            f"{world.drafter.seq_len} tokens; keep it at most half of model.world.drafter.seq_len"
        )


def _method(cfg: DictConfig) -> None:
    _choice(cfg, "method.loss", LOSSES)
    _choice(cfg, "method.divergence", DIVERGENCES)
    _choice(cfg, "method.teacher", TEACHERS)
    _at_least(cfg, "method.gamma", 1, optional=True)
    if cfg.method.drafter_temperature is not None:
        _positive(cfg, "method.drafter_temperature")
    _between(cfg, "method.lam", 0.0, 1.0)
    _between(cfg, "method.beta", 0.0, 1.0)
    if cfg.method.decay_gamma is not None:  # None: the DFlash paper's value for the block size
        _positive(cfg, "method.decay_gamma")
    _between(cfg, "method.dpace_alpha", 0.0, 1.0)
    _between(cfg, "method.streak_smoothing", 0.0, 1.0)
    _between(cfg, "method.onpolicy_mix", 0.0, 1.0)
    _choice(cfg, "method.features", FEATURE_SOURCES)


def _data(cfg: DictConfig) -> None:
    data = cfg.data
    if not data.prompt_sources:
        raise ConfigError("data.prompt_sources is empty; name at least one benchmark or prompt file")
    if data.mix_weights:
        if len(data.mix_weights) != len(data.prompt_sources):
            raise ConfigError(
                f"data.mix_weights has {len(data.mix_weights)} entries but data.prompt_sources has "
                f"{len(data.prompt_sources)}; give one weight per source, or [] for uniform"
            )
        finite = all(math.isfinite(w) for w in data.mix_weights)
        if not finite or min(data.mix_weights) < 0 or sum(data.mix_weights) <= 0:
            raise ConfigError(
                f"data.mix_weights={list(data.mix_weights)} must be finite numbers >= 0 with a positive sum, "
                "e.g. data.mix_weights=[0.5,0.5]"
            )
    _at_least(cfg, "data.samples_per_prompt", 1)
    _at_least(cfg, "data.max_prompts", 1, optional=True)
    _choice(cfg, "data.backend", TRAJECTORY_BACKENDS)
    _choice(cfg, "data.long_prompts", LONG_PROMPTS)
    _at_least(cfg, "data.temperature", 0)
    top_p = _get(cfg, "data.top_p")
    if not 0 < top_p <= 1:  # 0 keeps no token at all
        raise ConfigError(f"data.top_p={top_p!r} is not valid; it must lie in (0, 1]: above 0, at most 1 (no cut)")
    for key in ("max_new_tokens", "num_shards"):
        _at_least(cfg, f"data.{key}", 1)
    _at_least(cfg, "data.batch_size", 1, optional=True)
    _choice(cfg, "data.batching", BATCHINGS)
    _at_least(cfg, "data.topk_logprobs", 0)
    layers = list(data.feature_layers)
    if any(i < 0 for i in layers) or len(set(layers)) != len(layers):
        raise ConfigError(
            f"data.feature_layers={layers} must be distinct layer ids >= 0 (0: the embeddings), e.g. the DFlash "
            "drafter's target_layer_ids"
        )
    _positive(cfg, "data.max_feature_gb")


def _trainer(cfg: DictConfig) -> None:
    _choice(cfg, "trainer.zero_stage", ZERO_STAGES)
    _choice(cfg, "trainer.precision", PRECISIONS)
    _choice(cfg, "trainer.autocast", AUTOCASTS)
    _positive(cfg, "trainer.lr")
    _between(cfg, "trainer.min_lr_ratio", 0.0, 1.0)
    _at_least(cfg, "trainer.grad_clip", 0.0)
    _at_least(cfg, "trainer.warmup_steps", 0)
    for key in (
        "max_steps", "micro_batch_size", "grad_accum", "save_every", "eval_every", "log_every", "windows_per_seq",
        "stride", "pad_multiple",
    ):  # fmt: skip
        _at_least(cfg, f"trainer.{key}", 1)
    _at_least(cfg, "trainer.train_tokens", 1, optional=True)
    if cfg.trainer.max_epochs is not None:
        _positive(cfg, "trainer.max_epochs")
    if cfg.trainer.max_minutes is not None:
        _positive(cfg, "trainer.max_minutes")
    _at_least(cfg, "trainer.patience", 1, optional=True)
    _at_least(cfg, "trainer.checks_per_epoch", 1, optional=True)
    _choice(cfg, "trainer.stop_metric", SCALING_METRICS)
    if (
        cfg.trainer.stop_metric == "soft_streak"
        and cfg.trainer.patience is not None
        and not cfg.trainer.eval_soft_streak
    ):
        raise ConfigError(
            "trainer.stop_metric=soft_streak stops on the check's soft streak, which trainer.eval_soft_streak=false "
            "turns off: set trainer.eval_soft_streak=true, or stop on trainer.stop_metric=sim_streak"
        )
    if cfg.trainer.patience is not None and (cfg.trainer.eval_prompts < 1 or not cfg.trainer.eval_sources):
        raise ConfigError(
            f"trainer.patience={cfg.trainer.patience} stops on the held-out check, which trainer.eval_prompts="
            f"{cfg.trainer.eval_prompts} / eval_sources={list(cfg.trainer.eval_sources)} turn off: give both (e.g. "
            "trainer.eval_prompts=16), or trainer.patience=null"
        )
    if cfg.trainer.patience is not None and cfg.trainer.zero_stage == 3:
        raise ConfigError(
            "trainer.patience needs the held-out check of the live weights, which ZeRO-3 shards (it checks each "
            "export instead): use trainer=zero2, or trainer.patience=null"
        )
    _at_least(cfg, "trainer.eval_prompts", 0)
    _at_least(cfg, "trainer.keep_last", 1, optional=True)
    _at_least(cfg, "trainer.keep_exports", 1, optional=True)
    if cfg.trainer.resume_from is not None and not cfg.trainer.resume_from.strip():
        raise ConfigError(
            "trainer.resume_from is empty; give a distill run folder (or its deepspeed/step-* folder), or null"
        )
    if cfg.trainer.lora.enabled:
        _at_least(cfg, "trainer.lora.r", 1)
        _positive(cfg, "trainer.lora.alpha")
        _between(cfg, "trainer.lora.dropout", 0.0, 1.0)
        if not cfg.trainer.lora.targets:
            raise ConfigError("trainer.lora.targets is empty but trainer.lora.enabled is true")


def _decoder(cfg: DictConfig) -> None:
    _choice(cfg, "decoder.name", DECODERS)
    _choice(cfg, "decoder.acceptance", ACCEPTANCE_RULES)
    _choice(cfg, "decoder.selection", SELECTIONS)
    _choice(cfg, "decoder.engine", ENGINES)
    _at_least(cfg, "decoder.gamma", 1, optional=True)
    for key in ("K", "max_new_tokens", "batch_size", "budget"):
        _at_least(cfg, f"decoder.{key}", 1)
    for key in ("temperature", "drafter_temperature"):
        _at_least(cfg, f"decoder.{key}", 0)
    for key in ("draft_cost", "verify_cost"):
        _at_least(cfg, f"decoder.{key}", 0, optional=True)
    _at_least(cfg, "decoder.ngram_min", 1)
    if cfg.decoder.ngram_max < cfg.decoder.ngram_min:
        raise ConfigError(
            f"decoder.ngram_max={cfg.decoder.ngram_max} is below decoder.ngram_min={cfg.decoder.ngram_min}: ngram "
            "looks up suffixes of ngram_max tokens down to ngram_min; e.g. decoder.ngram_min=2 decoder.ngram_max=4"
        )
    top_k = cfg.decoder.top_k
    if top_k is not None and top_k < 1:  # 0 once meant "no limit" without saying so; a k of 0 keeps no token
        raise ConfigError(
            f"decoder.top_k={top_k} keeps no token to draft from: give decoder.top_k >= 1, or decoder.top_k=null to "
            "draft among the whole vocabulary"
        )
    if cfg.decoder.acceptance == "exact_greedy" and cfg.decoder.temperature > 0:
        raise ConfigError(
            f"decoder.acceptance=exact_greedy is lossless only at decoder.temperature=0, got "
            f"{cfg.decoder.temperature:g}; use decoder.acceptance=greedy_acceptance (or leviathan) to sample"
        )
    _positive(cfg, "decoder.threshold")
    _between(cfg, "decoder.threshold", 0.0, 1.0)
    if cfg.prompt is not None and not cfg.prompt:
        raise ConfigError('prompt is empty; give some text, e.g. prompt="Sam has 3 apples."')
    if cfg.prompt_ids is not None and (not cfg.prompt_ids or min(cfg.prompt_ids) < 0):
        raise ConfigError("prompt_ids needs at least one non-negative token id, e.g. prompt_ids=[12,7,99]")


def _launcher(cfg: DictConfig) -> None:
    _choice(cfg, "launcher.name", LAUNCHERS)
    _at_least(cfg, "launcher.nodes", 1)
    _at_least(cfg, "launcher.gpus_per_node", 0)
    _at_least(cfg, "launcher.time_min", 1)
    _at_least(cfg, "launcher.workers", 1, optional=True)
    if cfg.launcher.nodes > 1 and cfg.stage.name != "distill":
        raise ConfigError(
            f"launcher.nodes={cfg.launcher.nodes}: only stage=distill spans nodes (torchrun on each); stage="
            f"{cfg.stage.name} would run once per node. Use launcher.nodes=1 (trajectories and evaluate fan out "
            "with launcher=ray instead)"
        )


def stage_settings_node(name: str, *values: Any) -> DictConfig:
    """Stage ``name``'s settings schema (``STAGE_SCHEMAS``) with ``values`` merged on in order; ConfigError naming
    ``settings.<name>`` and the first line of OmegaConf's complaint for an unknown key or a badly typed value."""
    if name not in STAGE_SCHEMAS:
        raise ConfigError(f"settings.{name}: no stage {name!r} has settings; valid: {', '.join(STAGE_SCHEMAS)}")
    try:
        return OmegaConf.merge(OmegaConf.structured(STAGE_SCHEMAS[name](name=name)), *values)
    except Exception as err:  # OmegaConf's key and type errors, first line: which key, what was wrong
        raise ConfigError(f"settings.{name}: {str(err).splitlines()[0]}") from err


def _settings(cfg: DictConfig) -> None:
    """Every ``settings.<stage>`` entry names a stage with settings and fits its schema (a typo in an experiment
    file's settings fails here, not when the chained stage comes up an hour later). Each stage's ``check`` judges
    the values when it runs."""
    for name, values in cfg.settings.items():
        stage_settings_node(name, values)


def _experiment(cfg: DictConfig) -> None:
    chainable = tuple(s for s in STAGES if s != "pipeline")
    for i, entry in enumerate(cfg.experiment.stages):
        stage = (entry.split() or [""])[0]
        if stage not in chainable:
            raise ConfigError(f"experiment.stages[{i}]={stage!r} is not valid; choose from: {', '.join(chainable)}")
    if cfg.stage.name == "pipeline" and not cfg.experiment.stages:
        raise ConfigError(
            f"stage=pipeline runs the stages an experiment lists, but experiment={cfg.experiment.name!r} "
            "lists none; pick one such as experiment=tiny_e2e"
        )
