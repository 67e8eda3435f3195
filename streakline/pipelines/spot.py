"""Stage ``spot``: collect draft-free traces of the block-diffusion target and train SPOT's order model.

    python launch.py stage=spot model=tiny                         # 128 prompts, 1200 steps (docs/spot.md)
    python launch.py stage=spot model=tiny stage.prompts=200 stage.steps=2000 stage.temperature=1.0

Recipe (``Spot.run``, top-down; the runner has attached the world, checked ``stage.*`` and found no complete run
with the same key: target preset, tokenizer, ``stage.*``):
1. the target and its tokenizer; prompts: ``stage.prompts`` split evenly over ``stage.prompt_sources``, rendered
   as stage=evaluate renders what it decodes (``data.sources.prompt_for`` with ``data.chat_template``);
2. traces: the draft-free decoder (``stage.rule``, ``stage.temperature`` with coupled noise keyed by ``stage.seed``,
   ``stage.max_new_tokens``) over ``stage.num_shards`` contiguous prompt slices, each written atomically to
   ``shards/shard-XXXXX-of-YYYYY.parquet``; shards already there and readable are kept (a killed run resumes);
3. examples (``alignment.spot.data``: stale step t paired with root S_{t+1}, depths < ``stage.horizon``), split by
   prompt, and the order model trained (``alignment.spot.train``);
4. ``order_model/`` (config.json + model.safetensors, and ``target.json``: the target's name, fingerprint and block
   size) and ``metrics.json`` (those too); the runner writes the manifest last.

``decoder=spot`` finds the order model with ``common.lookup.locate_order_model``; ``decoding.registry.block_drafter``
builds the drafter from it; an order model made for another target or block size is refused. Tests: ``python -m
pytest tests/pipelines/test_spot.py tests/pipelines/test_fingerprints.py``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from streakline.artifacts import StageRun, write_json_atomic
from streakline.config import ConfigError
from streakline.decoding.registry import block_decode_config

from .common.fingerprints import target_identity
from .common.lookup import ORDER_MODEL, TARGET_RECORD, spot_key
from .common.prompts import encode_records, source_records
from .common.roles import block_target, device, required_tokenizer
from .common.traces import check_trace_settings, finish_with_metrics, reuse_metrics
from .runner import Stage, StageResult


class Spot(Stage):
    name = "spot"
    settings = ("stage",)

    def uses(self, cfg: DictConfig) -> tuple[str, ...]:
        return ("target",)

    def check(self, cfg: DictConfig) -> None:
        """ConfigError for ``stage.*`` values the stage cannot run with."""
        s = cfg.stage
        counts = ("max_new_tokens", "horizon", "batch_size", "num_shards", "steps", "train_batch", "layers")
        check_trace_settings(s, counts, "the second token hypothesis")
        if s.prompts < 2:
            raise ConfigError(f"stage.prompts must be >= 2 (some are held out), got {s.prompts}")
        if not 0.0 < s.heldout_fraction < 1.0:
            raise ConfigError(f"stage.heldout_fraction must be in (0, 1), got {s.heldout_fraction}")
        if s.d_model % s.heads:
            raise ConfigError(f"stage.d_model={s.d_model} must be divisible by stage.heads={s.heads}")

    def key(self, cfg: DictConfig) -> dict[str, Any]:
        return spot_key(cfg, required_tokenizer(cfg, "target", self.name))

    def run(self, cfg: DictConfig, stage_run: StageRun) -> StageResult:
        from streakline.alignment.block_traces import read_trace_shards
        from streakline.alignment.spot import SpotTrainConfig, build_examples, split_by_prompt, train_order_model
        from streakline.models.order_model import OrderModelConfig

        s = cfg.stage
        tokenizer = required_tokenizer(cfg, "target", self.name)
        where = device()  # the GPU when there is one: the traces and the order model's training
        target = block_target(cfg, self.name, where)
        L = target.config.block_size
        if L > s.max_block:
            raise ConfigError(f"the target's block size {L} exceeds stage.max_block={s.max_block}; raise it")
        records = source_records(s.prompt_sources, s.prompts, self.name)
        prompts = encode_records(tokenizer, records, cfg.data.chat_template)

        folder = stage_run.add_output("shards")
        folder.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        collected = _collect(cfg, target, tokenizer, prompts, folder, stage_run.cfg_hash)
        collect_seconds = time.perf_counter() - started
        traces = read_trace_shards(folder)
        data = build_examples(traces, horizon=s.horizon)
        train, heldout = split_by_prompt(data, s.heldout_fraction, s.seed)
        model_cfg = OrderModelConfig(
            top_k=s.top_k, d_model=s.d_model, layers=s.layers, heads=s.heads, ffn=s.ffn, max_block=s.max_block,
            rule=s.rule, threshold=float(s.threshold) if s.rule == "threshold" else None,
        )  # fmt: skip
        train_cfg = SpotTrainConfig(steps=s.steps, batch_size=s.train_batch, lr=s.lr, seed=s.seed)
        model, fit = train_order_model(train, heldout, model_cfg, train_cfg, device=where)
        model.save(stage_run.add_output(ORDER_MODEL))
        identity = {**target_identity(cfg), "block_size": L}  # the built target's: what the traces came from
        write_json_atomic(stage_run.dir / ORDER_MODEL / TARGET_RECORD, identity)
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
            "target_fingerprint": identity["target_fingerprint"],
            "rule": s.rule,
            "temperature": s.temperature,
        }
        return finish_with_metrics(self.name, stage_run, ORDER_MODEL, metrics)

    def reuse(self, cfg: DictConfig, folder: Path) -> StageResult:
        return reuse_metrics(self.name, folder, ORDER_MODEL)

    def report(self, result: StageResult) -> None:
        print(format_report(result.metrics, result.folder))


STAGE = Spot()


def stale_token_agreement(traces) -> float:
    """How often a step's stale rank-0 token equals the token the position finally gets, over positions still
    masked after the step (docs/algorithms.md section 8: tokens are mostly known; the order is what must be learnt)."""
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
        f"spot: order model ({metrics['parameters']:,} parameters) -> {folder / ORDER_MODEL}",
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

    s = cfg.stage
    n = min(s.num_shards, len(prompts))
    bounds = [(i * len(prompts) // n, (i + 1) * len(prompts) // n) for i in range(n)]
    decode = block_decode_config(s, eos_token_id=tokenizer.eos_token_id)
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
