"""Stage ``spiffy``: calibrate Spiffy's draft graph for a block-diffusion target from draft-free traces.

    python launch.py stage=spiffy model=tiny                                    # 50 prompts, D = 10 (docs/spiffy.md)
    python launch.py stage=spiffy model=tiny stage.rule=threshold stage.temperature=1.0 stage.budget=20

Recipe (``Spiffy.run``, top-down; the runner has attached the world, checked ``stage.*`` and found no complete run
with the same key: target preset, tokenizer, ``stage.*``, recipe version):
1. the target and its tokenizer; prompts: ``stage.prompts`` split evenly over ``stage.prompt_sources``, rendered
   exactly as ``stage=evaluate`` renders the prompts it decodes (``data.sources.prompt_for``, ``data.chat_template``);
2. traces: the draft-free decoder (``stage.rule``, ``stage.temperature`` with coupled noise keyed by
   ``stage.seed``, ``stage.max_new_tokens``), top-``stage.top_k`` stale tokens per position, with a progress bar;
3. calibration (``alignment.spiffy.calibrate``: realised (i, j)-sets up to ``stage.horizon`` steps ahead, greedy
   growth to ``stage.budget`` nodes);
4. ``graph.json`` (header: the target's name, fingerprint and block size, and the decoding config) and
   ``metrics.json`` (the target's fingerprint and block size too); the runner writes the manifest.

``decoder=spiffy`` finds the graph with ``common.lookup.locate_graph``; ``decoding.registry.block_drafter`` builds
the drafter from it, and refuses a graph made for another target or block size. Tests: ``python -m pytest
tests/pipelines/test_spiffy.py tests/pipelines/test_fingerprints.py``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from streakline.artifacts import StageRun
from streakline.decoding.registry import block_decode_config

from .common.fingerprints import target_identity
from .common.lookup import GRAPH, spiffy_key
from .common.prompts import encode_records, source_records
from .common.roles import block_target, device, required_tokenizer
from .common.traces import check_trace_settings, finish_with_metrics, reuse_metrics
from .runner import Stage, StageResult


class Spiffy(Stage):
    name = "spiffy"
    settings = ("stage",)

    def uses(self, cfg: DictConfig) -> tuple[str, ...]:
        return ("target",)

    def check(self, cfg: DictConfig) -> None:
        """ConfigError for ``stage.*`` values the stage cannot run with."""
        counts = ("prompts", "max_new_tokens", "horizon", "budget", "batch_size")
        check_trace_settings(cfg.stage, counts, "token ranks j beyond it cannot be drafted")

    def key(self, cfg: DictConfig) -> dict[str, Any]:
        return spiffy_key(cfg, required_tokenizer(cfg, "target", self.name))

    def run(self, cfg: DictConfig, stage_run: StageRun) -> StageResult:
        from streakline.alignment.block_traces import collect_traces
        from streakline.alignment.spiffy import calibrate

        s = cfg.stage
        tokenizer = required_tokenizer(cfg, "target", self.name)
        target = block_target(cfg, self.name, device())
        records = source_records(s.prompt_sources, s.prompts, self.name)
        prompts = encode_records(tokenizer, records, cfg.data.chat_template)
        decode = block_decode_config(s, eos_token_id=tokenizer.eos_token_id)

        started = time.perf_counter()
        traces = collect_traces(target, prompts, decode, batch_size=s.batch_size, top_k=s.top_k, progress=True)
        collect_seconds = time.perf_counter() - started
        started = time.perf_counter()
        header = graph_header(cfg, target, decode)
        graph, stats = calibrate(traces, horizon=s.horizon, budget=s.budget, header=header)
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
            "target_fingerprint": header["target_fingerprint"],
            "rule": s.rule,
            "temperature": s.temperature,
            "graph": [sorted(list(p) for p in q) for q in graph.nodes[1:]],
        }
        return finish_with_metrics(self.name, stage_run, GRAPH, metrics)

    def reuse(self, cfg: DictConfig, folder: Path) -> StageResult:
        return reuse_metrics(self.name, folder, GRAPH)

    def report(self, result: StageResult) -> None:
        print(format_report(result.metrics, result.folder))


STAGE = Spiffy()


def graph_header(cfg: DictConfig, target, decode) -> dict[str, Any]:
    """What the graph is keyed by: target name and decoding config (``SpiffyGraph.check`` compares the first three),
    and the target's fingerprint and block size (``lookup.locate_graph`` compares them)."""
    node = cfg.model.target
    return {
        "target": node.name,
        "target_fingerprint": target_identity(cfg)["target_fingerprint"],
        "rule": decode.rule,
        "temperature": float(decode.temperature),
        "threshold": float(decode.threshold),  # the threshold rule's tau during calibration (BlockDecodeConfig's)
        "seed": int(decode.seed),
        "target_path": str(node.path or node.hub_id),
        "block_size": int(target.config.block_size),
        "prompts": int(cfg.stage.prompts),
        "prompt_sources": list(cfg.stage.prompt_sources),
        "max_new_tokens": int(cfg.stage.max_new_tokens),
    }


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
