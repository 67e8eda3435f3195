"""Stage ``scaling``: distill throughput against world size, and the held-out accepted streak against training tokens
per loss with a fitted power law, as one report (``scaling.md``, two PNGs, W&B). docs/scaling.md has the details.

    python launch.py stage=pipeline experiment=scaling                # the micro world on CPU, gloo ranks
    python launch.py stage=scaling experiment=scaling stage.world_sizes=[1,2,4,8]   # one node's GPUs, NCCL
    python launch.py stage=scaling experiment=scaling stage.launch=external stage.ranks_per_node=8 \
        'stage.world_sizes=[8,16,32]'                    # a Slurm cluster: sbatch the jobs it writes, then rerun

Recipe (``Scaling.run``):
1. trajectories for every ``stage.data_sizes`` entry (``data.max_prompts``), through the runner (cached);
2. throughput: per ``stage.world_sizes`` entry N one ``stage=distill`` run of ``stage.throughput_steps`` steps under
   ZeRO-``stage.zero_stage`` with ``stage.global_batch`` examples a step split over the N ranks (micro batch
   ``global_batch / N``: the run key holds it, so each world size is its own run, and every size trains on the same
   batches). A complete run with that key is reused; otherwise ``stage.launch=torchrun`` starts its N ranks here
   (``torch.distributed.run --standalone``: gloo on CPU, NCCL on GPUs) and ``stage.launch=external`` writes the
   Slurm job that makes it (``commands.sh``: sbatch, srun + torchrun per node) and stops until it exists, so ranks
   from Slurm nodes give the same runs. The rate is each run's telemetry (``label_tokens_per_s``, ``metrics.jsonl``);
3. acceptance: per method of ``stage.methods`` and data size one distill run in this process (the experiment's
   ``trainer``: ``max_steps``, a held-out check every ``eval_every`` steps), cached like any distill run; each check
   is a point (label tokens seen, mean ``eval/<source>/<stage.metric>``);
4. the report (``evaluation/scaling.py``): efficiency, power-law fits, ``scaling.md``, ``scaling.json``,
   ``throughput.png``, ``acceptance.png``, and the same to W&B (offline without an API key).
"""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from streakline.artifacts import StageRun, atomic_file, config_hash, find_complete, read_manifest
from streakline.config import CONF_DIR, ConfigError, compose_config
from streakline.config.schema import SCALING_LAUNCHES, SCALING_METRICS, ZERO_STAGES
from streakline.evaluation import scaling as scaling_report
from streakline.evaluation.scaling_md import write_report
from streakline.launch.slurm import launch_script

from .common import data_scaling
from .common.lookup import autocast_part, stage_overrides, stage_settings
from .runner import Stage, StageResult

# Bump when the recipe changes what a config produces (which runs are read, how a rate is taken).
RECIPE = 1
# What torchrun sets in a rank: a rank of ours must not hand its own to the ranks it starts.
RANK_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
            "TORCHELASTIC_RUN_ID")  # fmt: skip
THROUGHPUT_LOGS = 6  # logged intervals per throughput run: the first is dropped, the median taken of the rest


class Scaling(Stage):
    name = "scaling"
    settings = ("stage",)
    needs_world = False  # every stage it runs attaches its own

    def check(self, cfg: DictConfig) -> None:
        s = cfg.stage
        if s.launch not in SCALING_LAUNCHES:
            raise ConfigError(f"stage.launch={s.launch} is not valid; choose from: {', '.join(SCALING_LAUNCHES)}")
        if s.metric not in SCALING_METRICS:
            raise ConfigError(f"stage.metric={s.metric} is not valid; choose from: {', '.join(SCALING_METRICS)}")
        if s.metric == "soft_streak" and not cfg.trainer.eval_soft_streak:
            raise ConfigError(
                "stage.metric=soft_streak reads the held-out checks' soft streak, which trainer.eval_soft_streak=false "
                "turns off: set trainer.eval_soft_streak=true, or stage.metric=sim_streak"
            )
        sizes = list(s.world_sizes)
        if any(n < 1 for n in sizes) or len(set(sizes)) != len(sizes):
            raise ConfigError(f"stage.world_sizes={sizes} must be distinct rank counts >= 1, e.g. [1,2,4] ([]: none)")
        uneven = [n for n in sizes if s.global_batch % n]
        if s.global_batch < 1 or uneven:
            step = math.lcm(*sizes) if sizes else 1
            fits = -(-s.global_batch // step) * step  # the next multiple of every world size
            raise ConfigError(
                f"stage.global_batch={s.global_batch} must split evenly over every world size (not over {uneven}): "
                f"each rank takes global_batch / N examples a step; e.g. stage.global_batch={fits}"
            )
        if s.ranks_per_node is not None and any(n > s.ranks_per_node and n % s.ranks_per_node for n in sizes):
            raise ConfigError(
                f"stage.world_sizes={sizes} with stage.ranks_per_node={s.ranks_per_node}: a world size above one node "
                "must fill whole nodes (a multiple of ranks_per_node)"
            )
        for key in ("throughput_steps", "threads_per_rank"):
            if s[key] < 1:
                raise ConfigError(f"stage.{key}={s[key]} must be at least 1")
        if not s.methods or not s.data_sizes or any(d < 1 for d in s.data_sizes):
            raise ConfigError("stage.methods and stage.data_sizes (prompts, each >= 1) must not be empty")
        tokens = list(s.token_sizes)
        if any(t < 1 for t in tokens) or len(set(tokens)) != len(tokens):
            raise ConfigError(f"stage.token_sizes={tokens} must be distinct token counts >= 1, e.g. [10000,100000]")
        if s.seeds and not tokens:
            raise ConfigError("stage.seeds adds seeds at the ends of stage.token_sizes, which is empty")
        names = [a.name for a in s.arms]
        if s.arms and (not tokens or len(set(names)) != len(names) or any(not a.methods for a in s.arms)):
            raise ConfigError(
                f"stage.arms {names}: recipes of a data-scaling study need stage.token_sizes, distinct names and "
                "methods each, e.g. [{name: dflash, methods: [ce_streak]}]"
            )
        if s.evaluate and not tokens:
            raise ConfigError("stage.evaluate decodes the drafters of stage.token_sizes, which is empty")
        data_scaling.read_prior(cfg)  # a missing or mismatched file is refused before anything trains
        if s.zero_stage not in ZERO_STAGES:
            raise ConfigError(f"stage.zero_stage={s.zero_stage} is not valid; choose from: 0, 2, 3")
        every = (*s.methods, s.throughput_method, *(m for a in s.arms for m in a.methods))
        every += tuple(a.adapt for a in s.arms if a.adapt is not None)
        unknown = [m for m in every if not (CONF_DIR / "method" / f"{m}.yaml").is_file()]
        if unknown:
            raise ConfigError(
                f"stage.methods / stage.throughput_method name no method preset: {unknown} (conf/method/)"
            )

    def key(self, cfg: DictConfig) -> dict[str, Any]:
        """The settings and everything the distill runs it reads depend on (their own keys decide reuse)."""
        plain = {k: OmegaConf.to_container(cfg[k], resolve=True) for k in ("model", "data", "trainer", "decoder")}
        plain["trainer"].pop("wandb_project", None)  # where the runs log, not what they measure
        plain["trainer"].pop("autocast", None)  # the setting; what it resolves to here is "autocast" (absent: fp32)
        settings = stage_settings(cfg)
        settings.pop("prior", None)  # what the files say (below), not where they lie
        settings.pop("ledger", None)
        points = data_scaling.read_prior(cfg).points  # [] without files: earlier reports keep their folders
        if points:
            settings["prior"] = config_hash(points)
        return {"scaling": settings, **plain, **autocast_part(cfg), "seed": cfg.seed, "recipe": RECIPE}

    def run(self, cfg: DictConfig, stage_run: StageRun) -> StageResult:
        from . import run_stage  # the dispatcher: every run goes through the runner like any stage

        s = cfg.stage
        t0 = time.perf_counter()
        by_tokens = bool(s.token_sizes)
        for size in [None] if by_tokens else s.data_sizes:  # the trajectories every distill run below reads
            # token sizes: one set, the config's, sampled with one data seed whatever seed each run trains with
            extra = f" {data_scaling.data_seed(cfg)}" if size is None else f" data.max_prompts={size}"
            made = run_stage(compose_config(stage_overrides(cfg, f"trajectories{extra}")[1]))
            if size is None:  # before any run trains: a size the set cannot hold would fail hours into the study
                data_scaling.check_set_holds(cfg, made.metrics)
        rows, missing = [], []
        for world in s.world_sizes:
            row = _throughput_row(cfg, world, missing)
            if row is not None:
                rows.append(row)
        if missing:
            commands = _write_commands(stage_run.dir / "commands.sh", missing)
            raise ConfigError(
                f"stage.launch=external: {len(missing)} throughput run(s) are not made yet; submit the Slurm jobs in "
                f"{commands} (bash {commands}), and once they are done rerun this command"
            )
        scaling_report.add_efficiency(rows)
        prior = data_scaling.read_prior(cfg) if by_tokens else None  # earlier sittings' points and decodes
        if by_tokens:  # the study at a glance before hours of training: what is cached, what will run
            for line in data_scaling.study_plan(cfg, finished_distill, prior):
                print(f"scaling: {line}", flush=True)
        points = data_scaling.token_points(cfg, run_stage) if by_tokens else _prompt_points(cfg)
        records = data_scaling.wall_clock(cfg, points, run_stage) if by_tokens and s.evaluate else []
        wall_clock = scaling_report.wall_clock_rows(records, points)
        if by_tokens:  # earlier sittings' points join the table, fits and figures, and their decodes the speedups
            points = data_scaling.with_prior(points, prior.points)
            wall_clock = scaling_report.with_prior_rows(wall_clock, prior.rows)
        fits = {
            m: scaling_report.fit_power_law([p["label_tokens"] for p in pts], [p["value"] for p in pts])
            for m, pts in points.items()
        }
        out = stage_run.dir
        drawn = {
            "throughput": scaling_report.throughput_figure(rows, out / "throughput.png"),
            "acceptance": scaling_report.acceptance_figure(
                points, fits, out / "acceptance.png", s.metric, by_tokens=by_tokens
            ),
            "speedup": scaling_report.speedup_figure(wall_clock, out / "speedup.png"),
            "slots": scaling_report.slot_figure(
                scaling_report.slot_points([p for pts in points.values() for p in pts]), out / "slots.png"
            ),
        }
        figures = {name: str(path) for name, path in drawn.items() if path is not None}
        summary = {
            "setup": _setup(cfg),
            "metric": s.metric,
            "throughput": rows,
            "acceptance": [p for pts in points.values() for p in pts],
            "fits": {m: None if f is None else f.as_dict() for m, f in fits.items()},
            "wall_clock": wall_clock,
            "figures": {k: Path(v).name for k, v in figures.items()},
            "seconds": time.perf_counter() - t0,
        }
        write_report(out / "scaling.md", summary)
        with atomic_file(out / "scaling.json", "w") as f:
            f.write(json.dumps(summary, indent=2) + "\n")
        for name in ("scaling.md", "scaling.json", *(Path(p).name for p in figures.values())):
            stage_run.add_output(name)
        data_scaling.write_ledger(cfg, summary["acceptance"], _decoded(summary))
        metrics = _headline(summary)
        stage_run.metrics.update(metrics)
        _log_wandb(cfg, stage_run, summary, metrics, figures)
        return _result(out, summary, metrics)

    def reuse(self, cfg: DictConfig, folder: Path) -> StageResult:
        summary = json.loads((folder / "scaling.json").read_text(encoding="utf-8"))
        # a ledger made or moved since: it gets the points and decodes too
        data_scaling.write_ledger(cfg, summary["acceptance"], _decoded(summary))
        return _result(folder, summary, _headline(summary))

    def report(self, result: StageResult) -> None:
        print(Path(result.details["markdown"]).read_text(encoding="utf-8"))
        print(f"scaling: report {result.details['markdown']}")
        for path in result.details["figures"].values():
            print(f"scaling: figure {path}")


STAGE = Scaling()


def _distill(cfg: DictConfig, extra: str) -> list[str]:
    """The overrides of a distill run: the command line's (without its stage=), then ``extra``."""
    return stage_overrides(cfg, f"distill {extra}")[1]


def _prompt_points(cfg: DictConfig) -> dict[str, list[dict[str, Any]]]:
    """``stage.data_sizes``: per method and trajectory set one distill run; every held-out check is a point at the
    label tokens seen so far."""
    from . import run_stage

    s, points = cfg.stage, {}
    for method in s.methods:
        points[method] = []
        for size in s.data_sizes:
            result = run_stage(compose_config(_distill(cfg, f"method={method} data.max_prompts={size}")))
            records = scaling_report.read_metrics(Path(result.folder) / "metrics.jsonl")
            for p in scaling_report.acceptance_points(records, s.metric):
                points[method].append({"method": method, "data_size": size, **p, "folder": str(result.folder)})
    return points


def _throughput_overrides(cfg: DictConfig, world: int) -> list[str]:
    s = cfg.stage
    steps = s.throughput_steps
    extra = (
        f"method={s.throughput_method} data.max_prompts={max(s.data_sizes)} trainer.zero_stage={s.zero_stage} "
        f"trainer.micro_batch_size={s.global_batch // world} trainer.grad_accum=1 trainer.max_steps={steps} "
        f"trainer.save_every={steps} trainer.log_every={max(1, steps // THROUGHPUT_LOGS)} trainer.eval_prompts=0"
    )  # no held-out check: its time is not training, and the rate leaves it out anyway
    return _distill(cfg, extra)


def finished_distill(cfg: DictConfig) -> Path | None:
    """The folder of the complete distill run that ``cfg`` (a composed distill config) names, without running it:
    the runner's lookup (the world attached, the stage's checks and run key), or None."""
    from streakline.world import attach_world

    from . import load_stage
    from .common.roles import device

    distill = load_stage("distill")
    distill.prepare(cfg)
    attach_world(cfg, roles=distill.uses(cfg), device=device())
    distill.check(cfg)
    return find_complete(cfg.run_root, cfg.experiment.name, distill.name, config_hash(distill.key(cfg)))


def _throughput_row(cfg: DictConfig, world: int, missing: list) -> dict[str, Any] | None:
    """The throughput of the world-size-``world`` run, started first when it is missing (``stage.launch=torchrun``);
    None, with its command added to ``missing``, when someone else must start it (``external``)."""
    overrides = _throughput_overrides(cfg, world)
    folder = finished_distill(compose_config(overrides))
    if folder is None:
        if cfg.stage.launch == "external":
            missing.append((world, overrides, cfg.stage.ranks_per_node))
            return None
        _torchrun(world, overrides, cfg.stage.threads_per_rank)
        folder = finished_distill(compose_config(overrides))
        if folder is None:
            raise RuntimeError(f"the {world}-rank distill run finished but left no complete run folder")
    ranks = read_manifest(folder).metrics.get("run/world_size")
    if ranks is not None and int(ranks) != world:
        raise ConfigError(
            f"the complete distill run {folder} has these settings but ran on {ranks} ranks, not {world}: it was "
            f"started by hand with another rank count; delete it or start it with {world} ranks"
        )
    rate = scaling_report.throughput(scaling_report.read_metrics(folder / "metrics.jsonl"))
    return {"world_size": world, "micro_batch": cfg.stage.global_batch // world, **rate, "folder": str(folder)}


def torchrun_command(world: int, overrides: list[str]) -> list[str]:
    """``python -m torch.distributed.run`` starting ``world`` ranks of ``launch.py <overrides>`` on this machine."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
            "--max_restarts=0", launch_script(), *overrides]  # fmt: skip


def _torchrun(world: int, overrides: list[str], threads: int) -> None:
    command = torchrun_command(world, overrides)
    print(f"scaling: starting {world} rank(s): {shlex.join(command)}", flush=True)
    env = {k: v for k, v in os.environ.items() if k not in RANK_ENV}
    env["OMP_NUM_THREADS"] = str(threads)  # ranks sharing a machine: one core's worth each unless told otherwise
    code = subprocess.call(command, env=env, cwd=os.getcwd())
    if code == 2:  # the ranks refused the config; their one-line message is above
        raise ConfigError(
            f"the {world}-rank distill run refused its settings (its message is above): {shlex.join(command)}"
        )
    if code != 0:
        raise RuntimeError(f"the {world}-rank distill run exited with status {code}: {shlex.join(command)}")


def sbatch_command(world: int, overrides: list[str], ranks_per_node: int | None) -> str:
    """The sbatch line that makes the world-size-``world`` run on Slurm nodes: an allocation of exactly its nodes
    (``streakline.launch.slurm`` takes the job's node count and first host for the rendezvous), one task per node,
    each starting its node's ranks with torchrun (NCCL on GPUs)."""
    per_node = world if ranks_per_node is None else min(world, ranks_per_node)
    nodes = world // per_node
    ranks = f"{shlex.quote(sys.executable)} -m streakline.launch.slurm --nproc-per-node {per_node} --"
    inner = f"srun {ranks} {shlex.quote(launch_script())} {shlex.join(overrides)}"
    return (
        f"sbatch --job-name=scaling-{world}ranks --nodes={nodes} --ntasks-per-node=1 --gpus-per-node={per_node} "
        f"--chdir={shlex.quote(os.getcwd())} --wrap={shlex.quote(inner)}"
    )


def _write_commands(path: Path, missing: list) -> Path:
    lines = ["#!/bin/bash", "# stage=scaling: one Slurm job per missing throughput run (add --partition, --account,",
             "# --time as your cluster wants; each job gets exactly the nodes its world size fills)"]  # fmt: skip
    lines += [sbatch_command(world, overrides, per_node) for world, overrides, per_node in missing]
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def _setup(cfg: DictConfig) -> dict[str, Any]:
    """What ran, for the report's text."""
    import torch

    s = cfg.stage
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU, {os.cpu_count()} cores"
    return {
        "experiment": cfg.experiment.name,
        "model": cfg.model.name,
        "throughput_method": s.throughput_method,
        "throughput_steps": s.throughput_steps,
        "zero_stage": s.zero_stage,
        "global_batch": s.global_batch,
        "launch": f"ranks by {s.launch}" + (f", {s.threads_per_rank} thread(s) each" if s.launch == "torchrun" else ""),
        "device": device,
        "steps": cfg.trainer.max_steps,
        "eval_every": cfg.trainer.eval_every,
        "methods": list(s.methods),
        "data_sizes": list(s.data_sizes),
        "token_sizes": list(s.token_sizes),
        "seeds": [cfg.seed, *s.seeds],
        "run_overrides": list(s.run_overrides),
        "arms": [
            {"name": name, "methods": methods, "sizes": sizes, "overrides": overrides, "adapt": adapt}
            for name, methods, sizes, overrides, adapt in data_scaling.arms(cfg)
        ]
        if s.token_sizes
        else [],
    }


def _decoded(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """A report's decoded rows (an older scaling.json may have none)."""
    return (summary.get("wall_clock") or {}).get("rows") or []


def _headline(summary: dict[str, Any]) -> dict[str, Any]:
    """The manifest's (and W&B's) numbers: tokens/s and efficiency per world size, the exponent per loss."""
    out: dict[str, Any] = {}
    for r in summary["throughput"]:
        n = r["world_size"]
        out[f"tokens_per_s/ranks{n}"] = r["label_tokens_per_s"]
        out[f"tokens_per_s_per_rank/ranks{n}"] = r["per_rank"]
        out[f"efficiency/ranks{n}"] = r["efficiency"]
    for loss, fit in summary["fits"].items():
        out[f"exponent/{loss}"] = None if fit is None else fit["exponent"]
    wall = summary.get("wall_clock") or {}  # stage.evaluate: the training-free bar and the best trained drafter
    for key, bar in wall.get("ngram", {}).items():
        out[f"speedup/ngram/{key}"] = bar
    for r in wall.get("rows", []):
        key = f"best_speedup/{scaling_report.panel_key(r['benchmark'], r['temperature'])}"
        if r["speedup"] is not None and r["speedup"] > (out.get(key) or 0):
            out[key] = r["speedup"]
    return out


def _result(folder: Path, summary: dict[str, Any], metrics: dict[str, Any]) -> StageResult:
    details = {
        "markdown": str(folder / "scaling.md"),
        "figures": {name: str(folder / file) for name, file in summary["figures"].items()},
        "summary": summary,
    }
    return StageResult("scaling", folder, folder / "scaling.md", metrics, details=details)


def _log_wandb(cfg: DictConfig, stage_run: StageRun, summary: dict, metrics: dict, figures: dict[str, str]) -> None:
    """One W&B run for the report (group = experiment, job type = stage): the headline numbers, the throughput and
    acceptance tables and both figures, as stage=evaluate logs its own."""
    from streakline.alignment.tracking import stage_tracker

    tracker = stage_tracker(cfg, stage_run, "scaling", config={"scaling": stage_settings(cfg)})
    tracker.log({k: v for k, v in metrics.items() if v is not None}, step=0)
    tracker.log_table("throughput_runs", summary["throughput"])  # the figures take the bare names
    tracker.log_table("acceptance_points", summary["acceptance"])
    if (summary.get("wall_clock") or {}).get("rows"):
        tracker.log_table("wall_clock", summary["wall_clock"]["rows"])
    for name, path in figures.items():
        tracker.log_image(name, path)
    tracker.close()
