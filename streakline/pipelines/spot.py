"""Stage ``spot``: collect draft-free traces of the block-diffusion target and train SPOT's order model.

    python launch.py stage=spot model=tiny                         # about 64 prompts, 600 steps (docs/spot.md)
    python launch.py stage=spot model=tiny spot.prompts=200 spot.steps=2000 spot.temperature=1.0

Order of work (top-down):
1. the world (``attach_world``), the target and its tokenizer;
2. the run folder ``<run_root>/<experiment>/spot/<hash of target preset, tokenizer, spot.*>/``; a complete run
   there is reused as is (its report is printed again);
3. prompts: ``spot.prompts`` split evenly over ``spot.prompt_sources``, raw text (``prompt_text``, as stage=decode
   and stage=evaluate encode what they decode), encoded with the target's tokenizer;
4. traces: the draft-free decoder (``spot.rule``, ``spot.temperature`` with coupled noise keyed by ``spot.seed``,
   ``spot.max_new_tokens``) over ``spot.num_shards`` contiguous prompt slices, each written atomically to
   ``shards/shard-XXXXX-of-YYYYY.parquet``; shards already there and readable are kept (a killed run resumes);
5. examples (``alignment.spot.data``: stale step t paired with root S_{t+1}, depths < ``spot.horizon``), split by
   prompt, and the order model trained (``alignment.spot.train``);
6. ``order_model/`` (config.json + model.safetensors), ``metrics.json`` and the manifest, written last.

``locate(cfg)`` is how ``decoder=spot`` finds the order model: ``decoder.artifact`` if set, else this experiment's
complete run for the same target and ``spot.*``; ``decoding.registry.block_drafter`` builds the drafter from it.
Tests: ``python -m pytest tests/pipelines/test_spot.py``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from streakline.artifacts import StageRun, config_hash, find_complete, write_json_atomic
from streakline.config import ConfigError
from streakline.decoding.registry import BLOCK
from streakline.models import CheckpointError

from .bootstrap import attach_world
from .decode import block_target, encode_records, source_records, target_tokenizer

STAGE = "spot"


def run(cfg: DictConfig) -> dict[str, Any]:
    from streakline.alignment.block_traces import read_trace_shards
    from streakline.alignment.spot import SpotTrainConfig, build_examples, split_by_prompt, train_order_model
    from streakline.models.order_model import OrderModelConfig

    attach_world(cfg)
    check(cfg)
    tokenizer = target_tokenizer(cfg, STAGE)
    key = run_key(cfg, tokenizer)
    digest = config_hash(key)
    done = find_complete(cfg.run_root, cfg.experiment.name, STAGE, digest)
    if done is not None:
        import json

        metrics = json.loads((done / "metrics.json").read_text(encoding="utf-8"))
        print(f"spot: already trained with these settings: {done / 'order_model'}")
        print(format_report(metrics, done))
        return {"folder": str(done), "order_model": str(done / "order_model"), "metrics": metrics, "cached": True}

    device = "cuda" if torch.cuda.is_available() else "cpu"
    target = block_target(cfg, STAGE, device)
    L = target.config.block_size
    if L > cfg.spot.max_block:
        raise ConfigError(f"the target's block size {L} exceeds spot.max_block={cfg.spot.max_block}; raise it")
    prompts = encode_records(tokenizer, source_records(cfg.spot.prompt_sources, cfg.spot.prompts, "spot"))

    with StageRun(cfg.run_root, cfg.experiment.name, STAGE, key) as stage_run:
        folder = stage_run.add_output("shards")
        folder.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        collected = _collect(cfg, target, tokenizer, prompts, folder, digest)
        collect_seconds = time.perf_counter() - started
        traces = read_trace_shards(folder)
        data = build_examples(traces, horizon=cfg.spot.horizon)
        train, heldout = split_by_prompt(data, cfg.spot.heldout_fraction, cfg.spot.seed)
        model_cfg = OrderModelConfig(
            top_k=cfg.spot.top_k,
            d_model=cfg.spot.d_model,
            layers=cfg.spot.layers,
            heads=cfg.spot.heads,
            ffn=cfg.spot.ffn,
            max_block=cfg.spot.max_block,
        )
        train_cfg = SpotTrainConfig(
            steps=cfg.spot.steps, batch_size=cfg.spot.train_batch, lr=cfg.spot.lr, seed=cfg.spot.seed
        )
        model, fit = train_order_model(train, heldout, model_cfg, train_cfg)
        model.save(stage_run.add_output("order_model"))
        metrics = {
            "heldout": fit["heldout"],
            "parameters": fit["parameters"],
            "examples": {"train": len(train), "heldout": len(heldout)},
            "train_loss": fit["train_loss"],
            "prompts": len(prompts),
            "traces": len(traces),
            "steps_per_block": sum(len(t.steps) for t in traces) / len(traces),
            "stale_token_agreement": stale_token_agreement(traces),
            "collected_shards": collected,
            "collect_seconds": collect_seconds,
            "train_seconds": fit["train_seconds"],
            "block_size": L,
            "rule": cfg.spot.rule,
            "temperature": cfg.spot.temperature,
        }
        write_json_atomic(stage_run.add_output("metrics.json"), metrics)
        stage_run.metrics.update(metrics)
    print(format_report(metrics, stage_run.dir))
    out = stage_run.dir
    return {"folder": str(out), "order_model": str(out / "order_model"), "metrics": metrics, "cached": False}


def check(cfg: DictConfig) -> None:
    """ConfigError for ``spot.*`` values the stage cannot run with."""
    s = cfg.spot
    if s.rule not in BLOCK:
        raise ConfigError(f"spot.rule={s.rule} is not a draft-free rule; valid: {', '.join(BLOCK)}")
    if not s.prompt_sources:
        raise ConfigError("spot.prompt_sources is empty; name at least one benchmark (e.g. tiny-math-train)")
    if s.prompts < 2:
        raise ConfigError(f"spot.prompts must be >= 2 (some are held out), got {s.prompts}")
    if not 0.0 < s.heldout_fraction < 1.0:
        raise ConfigError(f"spot.heldout_fraction must be in (0, 1), got {s.heldout_fraction}")
    for name in ("max_new_tokens", "horizon", "batch_size", "num_shards", "steps", "train_batch", "layers"):
        if s[name] < 1:
            raise ConfigError(f"spot.{name} must be >= 1, got {s[name]}")
    if s.top_k < 2:
        raise ConfigError(f"spot.top_k must be >= 2 (the second token hypothesis), got {s.top_k}")
    if s.d_model % s.heads:
        raise ConfigError(f"spot.d_model={s.d_model} must be divisible by spot.heads={s.heads}")
    if s.temperature < 0:
        raise ConfigError(f"spot.temperature must be >= 0, got {s.temperature}")


def run_key(cfg: DictConfig, tokenizer) -> dict[str, Any]:
    """What the run depends on: the target preset (its folder included), its tokenizer, and ``spot.*``."""
    from streakline.models.tokenizer import tokenizer_hash

    return {
        "target": OmegaConf.to_container(cfg.model.target, resolve=True),
        "tokenizer": tokenizer_hash(tokenizer),
        "spot": OmegaConf.to_container(cfg.spot, resolve=True),
        "prompt_format": "prompt_text",  # raw text, as decode / evaluate encode prompts (was the chat template)
    }


def locate(cfg: DictConfig) -> Path:
    """The order-model folder ``decoder=spot`` uses: ``decoder.artifact`` if set, else this experiment's complete
    ``stage=spot`` run for the same target and ``spot.*``; CheckpointError saying what to run otherwise."""
    if cfg.decoder.artifact:
        folder = Path(cfg.decoder.artifact).expanduser().absolute()
        if not (folder / "config.json").is_file():
            raise CheckpointError(
                f"decoder.artifact={cfg.decoder.artifact} is not an order-model folder (no config.json there); "
                "point it at the order_model/ folder of a stage=spot run"
            )
        return folder
    attach_world(cfg)
    digest = config_hash(run_key(cfg, target_tokenizer(cfg, STAGE)))
    found = find_complete(cfg.run_root, cfg.experiment.name, STAGE, digest)
    if found is None:
        raise CheckpointError(
            f"no trained order model for this target and spot.* settings (experiment {cfg.experiment.name!r}, "
            f"hash {digest}); run python launch.py stage=spot model={cfg.model.name} first (with the same spot.* "
            "overrides), or set decoder.artifact=<an order_model folder>"
        )
    return found / "order_model"


def stale_token_agreement(traces) -> float:
    """How often a step's stale rank-0 token equals the token the position finally gets, over positions still
    masked after the step (ALGORITHMS.md section 8: tokens are mostly known; the order is what must be learnt)."""
    hits = total = 0
    for trace in traces:
        final = trace.states[-1]
        for step in trace.steps:
            later = step.masked & ~step.commit
            hits += int((step.topk_ids[later, 0] == final[later]).sum())
            total += int(later.sum())
    return hits / total if total else float("nan")


def format_report(metrics: dict[str, Any], folder: Path) -> str:
    held = metrics["heldout"] or {}
    lines = [
        f"spot: order model ({metrics['parameters']:,} parameters) -> {folder / 'order_model'}",
        f"  traces: {metrics['traces']} blocks of {metrics['prompts']} prompts, {metrics['steps_per_block']:.1f} "
        f"steps per block, stale rank-0 token = final token {metrics['stale_token_agreement']:.1%}; "
        f"collected in {metrics['collect_seconds']:.1f} s",
        f"  examples: {metrics['examples']['train']} train, {metrics['examples']['heldout']} held out; "
        f"trained in {metrics['train_seconds']:.1f} s (final loss {metrics['train_loss']:.3f})",
    ]
    if held:
        lines.append(
            f"  held-out next-commit accuracy: order model {held['accuracy']:.3f} vs stale confidence "
            f"{held['baseline_accuracy']:.3f}"
        )
        lines.append(
            "  by depth: "
            + ", ".join(
                f"d{d} {v['accuracy']:.2f}/{v['baseline_accuracy']:.2f} (n={v['examples']})"
                for d, v in held["by_depth"].items()
            )
        )
    return "\n".join(lines)


def _shard_path(folder: Path, i: int, n: int) -> Path:
    return folder / f"shard-{i:05d}-of-{n:05d}.parquet"


def _shard_problem(path: Path, meta: dict) -> str | None:
    """None when the shard at ``path`` is complete and was written for ``meta``; else why it must be recollected."""
    from streakline.alignment.block_traces import read_trace_meta, read_trace_shard

    if not path.exists():
        return "missing"
    try:
        found = read_trace_meta(path)
        read_trace_shard(path)
    except Exception as e:  # any unreadable file is recollected, whatever the parquet library raised
        return f"unreadable ({type(e).__name__})"
    if any(found.get(k) != v for k, v in meta.items()):
        return "from other settings"
    return None


def _collect(cfg: DictConfig, target, tokenizer, prompts, folder: Path, digest: str) -> list[int]:
    """Write every missing or damaged shard; returns the shard indices collected now."""
    from streakline.alignment.block_traces import collect_traces, write_trace_shard
    from streakline.decoding.block_diffusion import BlockDecodeConfig

    s = cfg.spot
    n = min(s.num_shards, len(prompts))
    bounds = [(i * len(prompts) // n, (i + 1) * len(prompts) // n) for i in range(n)]
    decode = BlockDecodeConfig(
        rule=s.rule,
        max_new_tokens=s.max_new_tokens,
        temperature=s.temperature,
        seed=s.seed,
        eos_token_id=tokenizer.eos_token_id,
    )
    metas = [{"config_hash": digest, "shard": i, "num_shards": n, "prompts": list(b)} for i, b in enumerate(bounds)]
    todo = []
    for i, meta in enumerate(metas):
        problem = _shard_problem(_shard_path(folder, i, n), meta)
        if problem is not None:
            if problem != "missing":
                print(f"spot: shard {i} is {problem}; recollecting it")
            todo.append(i)
    print(f"spot: {len(prompts)} prompts in {n} shards, {n - len(todo)} already collected -> {folder}")
    for i in todo:
        begin, end = bounds[i]
        traces = collect_traces(
            target, prompts[begin:end], decode, batch_size=s.batch_size, top_k=s.top_k, progress=True
        )
        for t in traces:  # global prompt indices, so the held-out split sees one numbering across shards
            t.prompt += begin
        meta = {**metas[i], "target": str(cfg.model.target.path or cfg.model.target.hub_id), "rule": s.rule}
        write_trace_shard(_shard_path(folder, i, n), traces, meta)
    return todo
