"""Stage ``evaluate``: every method x benchmark x verifier temperature, with the same prompts and stop rules;
losslessness checked on every run; ``results.json``, ``results.md`` and the figures.

    python launch.py stage=evaluate model=tiny                       # methods discovered in this experiment
    python launch.py stage=evaluate model=tiny evaluate.prompts=20 evaluate.temperatures=[0.0]
    python launch.py stage=evaluate model=tiny launcher=ray          # methods fan out over Ray workers
    python launch.py stage=evaluate model=tiny 'evaluate.methods=[{name: mine, decoder: diffusion_draft,
        drafter: /ckpt/my-drafter, K: 4}]'

Methods (``evaluate.methods``; empty = discovered): ``vanilla`` (the reference of every speculative row),
``ar_draft`` (the model preset's drafter run autoregressively), ``base`` (the preset's diffusion drafter,
unaligned), every complete ``stage=distill`` run of this experiment (labelled by its method, with its training
steps), the K x drafter-temperature grid of Fig. 5 on the distilled drafter with the best training-time decoder
streak, and for the block-diffusion target ``static`` (the reference), ``threshold``, ``spiffy`` and ``spot`` when
their stage artifacts exist. Output: ``<run_root>/<experiment>/evaluate/<hash>/`` with ``results.json``,
``results.md``, ``figures/*.png``; the tables are printed and logged to W&B (offline without an API key).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from streakline.artifacts import ArtifactError, StageRun, config_hash, find_complete, read_manifest
from streakline.config import ConfigError
from streakline.data.benchmarks import load_benchmark, prompt_text
from streakline.decoding.block_diffusion import BlockDecodeConfig
from streakline.decoding.registry import BLOCK, BLOCK_DRAFTED, speculative_setup
from streakline.evaluation.figures import draw_all
from streakline.evaluation.lossless import exact_check, sampled_check
from streakline.evaluation.results import REFERENCE, finalize, hardware, versions, write_results
from streakline.evaluation.runner import run_block, run_speculative, sequence_logprobs

from .bootstrap import attach_world
from .decode import encode, role_tokenizer

STAGE = "evaluate"


# --------------------------------------------------------------------------------------------- methods
def _method(name: str, decoder: str, **kw) -> dict[str, Any]:
    keys = (
        "drafter",
        "steps",
        "K",
        "gamma",
        "drafter_temperature",
        "rule",
        "budget",
        "prune",
        "gamma_floor",
        "artifact",
        "grid",
        "loss",
    )
    return {"name": name, "decoder": decoder, **{k: kw.get(k) for k in keys}}


def distill_runs(cfg: DictConfig) -> list[dict[str, Any]]:
    """Complete ``stage=distill`` runs of this experiment: ``{"folder", "method", "steps", "decoder_streak"}``,
    oldest first. Intermediate checkpoints (``checkpoints/step-*``) are the sweep's business."""
    runs = []
    for manifest_path in sorted(Path(cfg.run_root, cfg.experiment.name, "distill").glob("*/manifest.json")):
        try:
            m = read_manifest(manifest_path.parent)
        except ArtifactError:
            continue
        if m.status != "complete" or not (manifest_path.parent / "drafter").is_dir():
            continue
        streaks = [v for k, v in m.metrics.items() if k.endswith("/decoder_streak") and isinstance(v, int | float)]
        runs.append(
            {
                "folder": str(manifest_path.parent),
                "method": m.config.get("method", {}).get("name", "distilled"),
                "steps": m.metrics.get("steps"),
                "decoder_streak": sum(streaks) / len(streaks) if streaks else None,
                "finished_at": m.finished_at,
            }
        )
    return sorted(runs, key=lambda r: r["finished_at"])


def discover(cfg: DictConfig) -> list[dict[str, Any]]:
    """The default method list (see the module docstring)."""
    ev = cfg.evaluate
    methods = [_method("vanilla", "vanilla"), _method("ar_draft", "ar_draft"), _method("base", "diffusion_draft")]
    runs = distill_runs(cfg)
    names = [r["method"] for r in runs]
    for r in runs:
        label = r["method"] if names.count(r["method"]) == 1 else f"{r['method']}@{Path(r['folder']).name}"
        methods.append(
            _method(
                label, "diffusion_draft", drafter=str(Path(r["folder"]) / "drafter"), steps=r["steps"], loss=r["method"]
            )
        )
    scored = [r for r in runs if r["decoder_streak"] is not None]
    grid_drafter = str(Path(max(scored, key=lambda r: r["decoder_streak"])["folder"]) / "drafter") if scored else None
    for K in ev.k_grid:
        for tau in ev.drafter_temperature_grid:
            methods.append(
                _method(
                    f"grid K={K} tau={tau:g}",
                    "diffusion_draft",
                    drafter=grid_drafter,
                    K=K,
                    drafter_temperature=tau,
                    grid=True,
                )
            )
    if ev.block and cfg.model.get("target") is not None:
        methods += [_method("static", "static"), _method("threshold", "threshold")]
        for name in BLOCK_DRAFTED:
            # A Spiffy graph is calibrated for one temperature: look for one per evaluated temperature (the order
            # model serves any). A temperature without an artifact loses only its own row; the reason is printed.
            artifacts = {}
            for T in cfg.evaluate.temperatures:
                local = cfg.copy()
                local[name].temperature = float(T) if name == "spiffy" else local[name].temperature
                try:
                    artifacts[str(float(T))] = str(_locate(local, name))
                except Exception as e:  # noqa: BLE001 - a missing artifact only drops the row; say why
                    print(f"evaluate: no {name} row at T={T:g} ({e})")
            if artifacts:
                methods.append(_method(name, name, artifact=artifacts))
    return methods


def _locate(cfg: DictConfig, name: str) -> Path:
    import importlib

    return importlib.import_module(f"{__package__}.{name}").locate(cfg)


# --------------------------------------------------------------------------------------------- worker
class EvalWorker:
    """Builds the models once; ``run(i)`` evaluates method i on every benchmark and temperature. Runs in-process
    or as a Ray actor (``launcher=ray``)."""

    def __init__(self, job: dict[str, Any]) -> None:
        self.cfg = OmegaConf.create(job["cfg"])
        self.methods, self.prompts = job["methods"], job["prompts"]
        torch.set_num_threads(max(1, self.cfg.evaluate.threads))
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self._models: dict[str, Any] = {}
        self.eos = {role: job["eos"].get(role) for role in ("verifier", "target")}

    def model(self, role: str, path: str | None = None):
        from streakline.models import build

        key = f"{role}:{path}"
        if key not in self._models:
            preset = self.cfg.model[role]
            if path is not None:
                preset = OmegaConf.merge(preset, {"path": path})
            self._models[key] = build(preset, role, device=self.device).eval()
        return self._models[key]

    def run(self, index: int) -> list[dict[str, Any]]:
        method = self.methods[index]
        family = "block" if method["decoder"] in BLOCK + BLOCK_DRAFTED else "speculative"
        out = []
        for bench, prompts in self.prompts[family].items():
            temps = [self.cfg.evaluate.grid_temperature] if method["grid"] else list(self.cfg.evaluate.temperatures)
            for temperature in temps:
                if isinstance(method["artifact"], dict) and str(float(temperature)) not in method["artifact"]:
                    continue  # no artifact for this temperature (discover said why)
                run, settings = self._decode(method, family, prompts, float(temperature))
                row = {
                    "method": method["name"],
                    "decoder": method["decoder"],
                    "family": family,
                    "drafter": method["drafter"],
                    "steps": method["steps"],
                    "benchmark": bench,
                    "temperature": float(temperature),
                    "settings": settings,
                    "prompts": len(prompts),
                    "tokens": run.tokens,
                    **run.metrics,
                }
                if family == "speculative" and temperature > 0:
                    row["logprobs"] = sequence_logprobs(self.model("verifier"), prompts, run.tokens)
                out.append(row)
        return out

    def _decode(self, method, family, prompts, temperature):
        ev, dec = self.cfg.evaluate, self.cfg.decoder
        pick = {
            k: (method[k] if method.get(k) is not None else dec.get(k))
            for k in ("K", "gamma", "rule", "budget", "prune", "gamma_floor", "drafter_temperature")
        }
        if family == "block":
            rule = method["decoder"] if method["decoder"] in BLOCK else pick["rule"]
            cfg = BlockDecodeConfig(
                rule=rule,
                threshold=dec.threshold,
                max_new_tokens=ev.max_new_tokens,
                eos_token_id=self.eos["target"],
                temperature=temperature,
                seed=self.cfg.seed,
            )
            drafter = None
            if method["decoder"] in BLOCK_DRAFTED:
                from streakline.decoding.registry import block_drafter

                if method["decoder"] == "spiffy" and method.get("budget") is None:
                    pick = {**pick, "budget": None}  # the whole calibrated graph unless the method says otherwise
                artifact = method["artifact"]
                artifact = artifact[str(temperature)] if isinstance(artifact, dict) else artifact
                drafter = block_drafter(
                    method["decoder"], artifact, pick, device=self.device, target=self.cfg.model.target.name
                )
            run = run_block(self.model("target"), prompts, cfg, drafter, batch_size=ev.batch_size)
            settings = {"rule": rule, **({k: pick[k] for k in ("budget", "prune", "gamma_floor")} if drafter else {})}
            return run, settings
        decoder = OmegaConf.merge(
            dec,
            {
                "name": method["decoder"],
                "temperature": temperature,
                "max_new_tokens": ev.max_new_tokens,
                "K": pick["K"],
                "gamma": pick["gamma"],
                "drafter_temperature": pick["drafter_temperature"],
            },
        )
        drafter_model = None if method["decoder"] == "vanilla" else self.model("drafter", method["drafter"])
        try:
            spec, drafter = speculative_setup(
                decoder,
                drafter_model,
                gamma_default=self.cfg.model.drafter.gamma,
                eos_token_id=self.eos["verifier"],
                seed=self.cfg.seed,
            )
        except (ValueError, NotImplementedError) as e:
            raise ConfigError(f"evaluate: method {method['name']!r}: {e}") from e
        run = run_speculative(self.model("verifier"), prompts, spec, drafter, batch_size=ev.batch_size)
        settings = {
            "K": spec.K,
            "gamma": spec.gamma,
            "acceptance": spec.acceptance,
            "grid": bool(method["grid"]),
            "drafter_temperature": decoder.drafter_temperature,
            "method": method.get("loss"),
        }
        if method["decoder"] == "vanilla":
            settings = {"grid": False}
        return run, settings


# --------------------------------------------------------------------------------------------- stage
def _prompts(cfg: DictConfig, tokenizer) -> dict[str, list[list[int]]]:
    return {
        b: [encode(tokenizer, prompt_text(r)) for r in load_benchmark(b, limit=cfg.evaluate.prompts)]
        for b in cfg.evaluate.benchmarks
    }


def _check(rows: list[dict]) -> None:
    """Attach ``lossless`` / ``lossless_check`` to every row, against its family's reference decoder."""
    refs = {}
    for r in rows:
        if r["decoder"] in ("vanilla", "static", "threshold"):
            refs[(r["decoder"], r["benchmark"], r["temperature"])] = r
    for r in rows:
        if r["decoder"] in ("vanilla", "static", "threshold"):
            r.update(lossless=True, lossless_check={"lossless": True, "check": "reference decoder"})
            continue
        ref_name = r["settings"].get("rule") if r["family"] == "block" else REFERENCE["speculative"]
        ref = refs.get((ref_name, r["benchmark"], r["temperature"]))
        if ref is None:
            r.update(lossless=False, lossless_check={"lossless": False, "check": f"no {ref_name} reference run"})
            continue
        sampled = r["family"] == "speculative" and r["temperature"] > 0
        check = sampled_check(r["logprobs"], ref["logprobs"]) if sampled else exact_check(r["tokens"], ref["tokens"])
        r.update(lossless=check["lossless"], lossless_check=check)


def with_references(methods: list[dict]) -> list[dict]:
    """``methods`` plus the reference decoders their checks and speedups need (vanilla, static, threshold)."""
    names = {m["decoder"] for m in methods}
    extra = []
    if names & {"ar_draft", "diffusion_draft"} and "vanilla" not in names:
        extra.append(_method("vanilla", "vanilla"))
    rules = {m.get("rule") or "static" for m in methods if m["decoder"] in BLOCK_DRAFTED}
    extra += [_method(rule, rule) for rule in sorted(rules) if rule not in names]
    return extra + methods


def evaluate_methods(cfg: DictConfig, methods: list[dict]) -> list[dict]:
    """Run ``methods`` (``_method`` dicts) on cfg.evaluate's benchmarks and temperatures; checked, finalised
    records (without tokens). The sweep calls this too."""
    methods = with_references(methods)
    prompts, eos = {}, {}
    if any(m["decoder"] not in BLOCK + BLOCK_DRAFTED for m in methods):
        tok = role_tokenizer(cfg, "verifier")
        prompts["speculative"], eos["verifier"] = _prompts(cfg, tok), tok.eos_token_id
    if any(m["decoder"] in BLOCK + BLOCK_DRAFTED for m in methods):
        tok = role_tokenizer(cfg, "target")
        prompts["block"], eos["target"] = _prompts(cfg, tok), tok.eos_token_id
    job = {"cfg": OmegaConf.to_container(cfg, resolve=True), "methods": methods, "prompts": prompts, "eos": eos}
    ev = cfg.evaluate
    print(f"evaluate: {len(methods)} methods x {len(ev.benchmarks)} benchmarks x {len(ev.temperatures)} temperatures")
    rows = _evaluate_all(cfg, job, methods)
    _check(rows)
    return finalize([{k: v for k, v in r.items() if k not in ("tokens", "logprobs")} for r in rows])


def run(cfg: DictConfig) -> dict[str, Any]:
    attach_world(cfg)
    ev = cfg.evaluate
    if not ev.benchmarks or not ev.temperatures:
        raise ConfigError("evaluate.benchmarks and evaluate.temperatures must not be empty")
    if ev.methods:
        methods = [
            dict(_method(m.name, m.decoder), **{k: v for k, v in m.items() if v is not None}) for m in ev.methods
        ]
    else:
        methods = discover(cfg)
    key = {
        "methods": methods,
        "evaluate": OmegaConf.to_container(ev, resolve=True),
        "seed": cfg.seed,
        "decoder": OmegaConf.to_container(cfg.decoder, resolve=True),
        "models": {r: cfg.model[r].get("path") for r in ("verifier", "drafter", "target") if r in cfg.model},
    }
    done = find_complete(cfg.run_root, cfg.experiment.name, STAGE, config_hash(key))
    if done is not None:
        print((done / "results.md").read_text())
        print(f"evaluate: already evaluated with these settings: {done / 'results.json'}")
        figures = {p.name: str(p) for p in sorted((done / "figures").glob("*.png"))}
        records = json.loads((done / "results.json").read_text())["records"]
        return {
            "folder": str(done),
            "results": str(done / "results.json"),
            "markdown": str(done / "results.md"),
            "figures": figures,
            "records": records,
            "cached": True,
        }
    t0 = time.perf_counter()
    with StageRun(cfg.run_root, cfg.experiment.name, STAGE, key) as stage_run:
        records = evaluate_methods(cfg, methods)
        meta = {
            "experiment": cfg.experiment.name,
            "hardware": hardware(),
            "versions": versions(),
            "prompts": ev.prompts,
            "max_new_tokens": ev.max_new_tokens,
            "seconds": time.perf_counter() - t0,
        }
        json_path, md_path = write_results(stage_run.dir, records, meta)
        stage_run.add_output("results.json")
        stage_run.add_output("results.md")
        figures = draw_all(records, stage_run.dir / "figures") if ev.figures else {}
        for name in figures:
            stage_run.add_output(f"figures/{name}")
        lossy = [f"{r['method']} on {r['benchmark']} T={r['temperature']:g}" for r in records if not r["lossless"]]
        stage_run.metrics.update(records=len(records), lossy=lossy, seconds=meta["seconds"])
    _log_wandb(cfg, stage_run, records, figures)
    print(md_path.read_text())
    print(f"evaluate: results in {json_path}")
    for path in figures.values():
        print(f"evaluate: figure {path}")
    if lossy:
        print(f"evaluate: WARNING lossless check failed for {', '.join(lossy)}")
    return {
        "folder": str(stage_run.dir),
        "results": str(json_path),
        "markdown": str(md_path),
        "figures": {k: str(v) for k, v in figures.items()},
        "records": records,
        "cached": False,
    }


def _evaluate_all(cfg: DictConfig, job: dict, methods: list[dict]) -> list[dict]:
    rows: list[dict] = []
    if cfg.launcher.name == "ray" and len(methods) > 1:
        from streakline.launch.ray_pool import run_on_ray

        results: dict[int, list] = {}
        run_on_ray(
            EvalWorker,
            (job,),
            list(range(len(methods))),
            cfg.launcher.workers or 2,
            lambda i, out: results.__setitem__(i, out),
            address=cfg.launcher.ray_address,
            gpus_per_worker=1 if torch.cuda.is_available() else 0,
        )
        for i in range(len(methods)):
            rows.extend(results[i])
        return rows
    worker = EvalWorker(job)
    for i in tqdm(range(len(methods)), desc="evaluate", unit="method", dynamic_ncols=True):
        rows.extend(worker.run(i))
    return rows


def _log_wandb(cfg: DictConfig, stage_run: StageRun, records: list[dict], figures: dict[str, Path]) -> None:
    """One W&B run per evaluation (project = experiment, group = stage): summary, the results table, figures."""
    from streakline.alignment.tracking import Tracker, experiment_project

    tracker = Tracker(
        stage_run.dir / "metrics.jsonl",
        project=experiment_project(cfg.trainer.wandb_project, cfg.experiment.name),
        run_id=f"evaluate-{stage_run.cfg_hash}",
        name=f"{cfg.experiment.name}/evaluate",
        config={"evaluate": OmegaConf.to_container(cfg.evaluate, resolve=True)},
        group="evaluate",
        job_type="evaluate",
    )
    summary = {f"{r['method']}/{r['benchmark']}/T{r['temperature']:g}/speedup": r["speedup"] for r in records}
    tracker.log(summary, step=0)
    tracker.log_table("results", records)
    for name, path in figures.items():
        tracker.log_image(name.removesuffix(".png"), path)
    tracker.close()
