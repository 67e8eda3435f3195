"""Stage ``spiffy``: calibrate Spiffy's draft graph for a block-diffusion target from draft-free traces.

    python launch.py stage=spiffy model=tiny                                    # 50 prompts, D = 10 (docs/spiffy.md)
    python launch.py stage=spiffy model=tiny spiffy.rule=threshold spiffy.temperature=1.0 spiffy.budget=20

Order of work (top-down):
1. the world (``attach_world``), the target and its tokenizer;
2. the run folder ``<run_root>/<experiment>/spiffy/<hash of target preset, tokenizer, spiffy.*>/``; a complete run
   there is reused as is (its report is printed again);
3. prompts: ``spiffy.prompts`` split evenly over ``spiffy.prompt_sources``, as raw text (``prompt_text``) encoded
   with the target's tokenizer, exactly as ``stage=decode`` and ``stage=evaluate`` encode the prompts they decode;
4. traces: the draft-free decoder (``spiffy.rule``, ``spiffy.temperature`` with coupled noise keyed by
   ``spiffy.seed``, ``spiffy.max_new_tokens``), top-``spiffy.top_k`` stale tokens per position, with a progress bar;
5. calibration (``alignment.spiffy.calibrate``: realised (i, j)-sets up to ``spiffy.horizon`` steps ahead, greedy
   growth to ``spiffy.budget`` nodes);
6. ``graph.json`` (header: target name and decoding config), ``metrics.json`` and the manifest, written last.

``locate(cfg)`` is how ``decoder=spiffy`` finds the graph: ``decoder.artifact`` if set, else this experiment's
complete run for the same target and ``spiffy.*``; ``decoding.registry.block_drafter`` builds the drafter from it.
Tests: ``python -m pytest tests/pipelines/test_spiffy.py``.
"""

from __future__ import annotations

import json
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

STAGE = "spiffy"
GRAPH = "graph.json"
# Bump when this stage's code changes what a config produces (prompt encoding, trace pairing), so that an old run
# with the same settings is not reused.
RECIPE_VERSION = 1


def run(cfg: DictConfig) -> dict[str, Any]:
    from streakline.alignment.block_traces import collect_traces
    from streakline.alignment.spiffy import calibrate
    from streakline.decoding.block_diffusion import BlockDecodeConfig

    attach_world(cfg)
    check(cfg)
    tokenizer = target_tokenizer(cfg, STAGE)
    key = run_key(cfg, tokenizer)
    done = find_complete(cfg.run_root, cfg.experiment.name, STAGE, config_hash(key))
    if done is not None:
        metrics = json.loads((done / "metrics.json").read_text(encoding="utf-8"))
        print(f"spiffy: already calibrated with these settings: {done / GRAPH}")
        print(format_report(metrics, done))
        return {"folder": str(done), "graph": str(done / GRAPH), "metrics": metrics, "cached": True}

    device = "cuda" if torch.cuda.is_available() else "cpu"
    target = block_target(cfg, STAGE, device)
    s = cfg.spiffy
    prompts = encode_records(tokenizer, source_records(cfg.spiffy.prompt_sources, cfg.spiffy.prompts, "spiffy"))
    decode = BlockDecodeConfig(
        rule=s.rule,
        max_new_tokens=s.max_new_tokens,
        temperature=s.temperature,
        seed=s.seed,
        eos_token_id=tokenizer.eos_token_id,
    )
    with StageRun(cfg.run_root, cfg.experiment.name, STAGE, key) as stage_run:
        started = time.perf_counter()
        traces = collect_traces(target, prompts, decode, batch_size=s.batch_size, top_k=s.top_k, progress=True)
        collect_seconds = time.perf_counter() - started
        started = time.perf_counter()
        graph, stats = calibrate(traces, horizon=s.horizon, budget=s.budget, header=graph_header(cfg, target, decode))
        calibrate_seconds = time.perf_counter() - started
        graph.save(stage_run.add_output(GRAPH))
        metrics = {
            **stats,
            "prompts": len(prompts),
            "steps_per_block": sum(len(t.steps) for t in traces) / max(1, len(traces)),
            "decoded_positions": sum(int((t.states[-1] != t.initial).sum()) for t in traces),  # whole blocks
            "collect_seconds": collect_seconds,
            "calibrate_seconds": calibrate_seconds,
            "block_size": target.config.block_size,
            "rule": s.rule,
            "temperature": s.temperature,
            "graph": [sorted(list(p) for p in q) for q in graph.nodes[1:]],
        }
        write_json_atomic(stage_run.add_output("metrics.json"), metrics)
        stage_run.metrics.update(metrics)
    print(format_report(metrics, stage_run.dir))
    out = stage_run.dir
    return {"folder": str(out), "graph": str(out / GRAPH), "metrics": metrics, "cached": False}


def check(cfg: DictConfig) -> None:
    """ConfigError for ``spiffy.*`` values the stage cannot run with."""
    s = cfg.spiffy
    if s.rule not in BLOCK:
        raise ConfigError(f"spiffy.rule={s.rule} is not a draft-free rule; valid: {', '.join(BLOCK)}")
    if not s.prompt_sources:
        raise ConfigError("spiffy.prompt_sources is empty; name at least one benchmark (e.g. tiny-math-train)")
    for name in ("prompts", "max_new_tokens", "horizon", "budget", "batch_size"):
        if s[name] < 1:
            raise ConfigError(f"spiffy.{name} must be >= 1, got {s[name]}")
    if s.top_k < 2:
        raise ConfigError(f"spiffy.top_k must be >= 2 (token ranks j beyond it cannot be drafted), got {s.top_k}")
    if s.temperature < 0:
        raise ConfigError(f"spiffy.temperature must be >= 0, got {s.temperature}")


def run_key(cfg: DictConfig, tokenizer) -> dict[str, Any]:
    """What the run depends on: the target preset (its folder included), its tokenizer, ``spiffy.*`` and the recipe."""
    from streakline.models.tokenizer import tokenizer_hash

    return {
        "target": OmegaConf.to_container(cfg.model.target, resolve=True),
        "tokenizer": tokenizer_hash(tokenizer),
        "spiffy": OmegaConf.to_container(cfg.spiffy, resolve=True),
        "recipe": RECIPE_VERSION,
    }


def graph_header(cfg: DictConfig, target, decode) -> dict[str, Any]:
    """What the graph is keyed by: target name and decoding config (``SpiffyGraph.check`` compares the first three)."""
    node = cfg.model.target
    return {
        "target": node.name,
        "rule": decode.rule,
        "temperature": float(decode.temperature),
        "threshold": float(decode.threshold),  # the threshold rule's tau during calibration (BlockDecodeConfig's)
        "seed": int(decode.seed),
        "target_path": str(node.path or node.hub_id),
        "block_size": int(target.config.block_size),
        "prompts": int(cfg.spiffy.prompts),
        "prompt_sources": list(cfg.spiffy.prompt_sources),
        "max_new_tokens": int(cfg.spiffy.max_new_tokens),
    }


def locate(cfg: DictConfig) -> Path:
    """The graph.json ``decoder=spiffy`` uses: ``decoder.artifact`` (the file, or a folder holding it) if set, else
    this experiment's complete ``stage=spiffy`` run for the same target and ``spiffy.*``; CheckpointError otherwise."""
    if cfg.decoder.artifact:
        path = Path(cfg.decoder.artifact).expanduser().absolute()
        if path.is_dir():
            path = path / GRAPH
        if not path.is_file():
            raise CheckpointError(
                f"decoder.artifact={cfg.decoder.artifact} is not a Spiffy graph (no {path.name} there); point it at "
                "the graph.json of a stage=spiffy run"
            )
        return path
    attach_world(cfg)
    digest = config_hash(run_key(cfg, target_tokenizer(cfg, STAGE)))
    found = find_complete(cfg.run_root, cfg.experiment.name, STAGE, digest)
    if found is None:
        raise CheckpointError(
            f"no Spiffy graph for this target and spiffy.* settings (experiment {cfg.experiment.name!r}, hash "
            f"{digest}); run python launch.py stage=spiffy model={cfg.model.name} first (with the same spiffy.* "
            "overrides), or set decoder.artifact=<a graph.json>"
        )
    return found / GRAPH


def format_report(metrics: dict[str, Any], folder: Path) -> str:
    depth = ", ".join(f"depth {d}: {n}" for d, n in metrics["nodes_by_depth"].items()) or "root only"
    return "\n".join(
        [
            f"spiffy: graph of {metrics['nodes']} states ({depth}) -> {folder / GRAPH}",
            f"  traces: {metrics['traces']} blocks of {metrics['prompts']} prompts ({metrics['rule']}, "
            f"T={metrics['temperature']}), {metrics['steps_per_block']:.1f} steps per block, {metrics['steps']} "
            f"stale/root pairs, {metrics['distinct_states']} distinct realised states",
            f"  coverage: next state is a node {metrics['coverage']:.1%}, realised states that are nodes "
            f"{metrics['state_coverage']:.1%}, mean walk depth with every node verified "
            f"{metrics['mean_walk_depth']:.2f}; paths cut by a token outside the top-k: "
            f"{metrics['unrepresentable_paths']}",
            f"  seconds: traces {metrics['collect_seconds']:.1f}, calibration {metrics['calibrate_seconds']:.2f}",
        ]
    )
