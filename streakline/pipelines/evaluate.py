"""Stage ``evaluate``: every method x benchmark x verifier temperature, with the same prompts and stop rules;
losslessness checked on every run; ``results.json``, ``results.md`` and the figures.

    python launch.py stage=evaluate model=tiny                       # methods discovered in this experiment
    python launch.py stage=evaluate model=tiny stage.prompts=20 stage.temperatures=[0.0]
    python launch.py stage=evaluate model=tiny launcher=ray          # methods fan out over Ray workers
    python launch.py stage=evaluate model=tiny 'stage.methods=[{name: mine, decoder: diffusion_draft,
        drafter: /ckpt/my-drafter, K: 4}]'

Methods (``stage.methods``; empty = discovered): ``vanilla`` (the reference of every speculative row), ``ngram``
(prompt lookup, no model: the baseline a trained drafter must beat; ``stage.ngram=false`` leaves it out; with
``stage.lookup=true`` each DFlash run also decodes as ``dflash_lookup:<method>``, lookup first, the drafter elsewhere),
``ar_draft`` (the model preset's drafter run autoregressively), ``base`` (the preset's diffusion drafter,
unaligned: step 0 of Fig. 7), every complete ``stage=distill`` run of this experiment (labelled by its method, with
its training steps; DFlash runs as ``dflash:<method>``, decoded with ``dflash_draft``, and ``dflash:base``, the
drafter they started from, as the step 0 of their Fig. 7 lines; which rows a drafter gets, and which decoder runs
it, are its kind's entry in ``common.kinds.DRAFTER_KINDS``; ``stage.base=false`` leaves out every undistilled
row), the K x drafter-temperature grid of Fig. 5 on
the distilled drafter with the best training-time decoder streak (K i.i.d. drafts, ``argmax_chain=False``, as in
the paper), each distill run's intermediate checkpoints (``checkpoints/step-*``, labelled ``<method>@<steps>``)
at the lowest of ``stage.temperatures`` only, for the Fig. 7 curves, and for the block-diffusion target ``static``
(the reference), ``threshold``, ``spiffy`` and ``spot`` when their stage artifacts exist. The methods run in
``evaluation/suite.py`` (``EvalMethod`` rows, in process or on Ray). Output:
``<run_root>/<experiment>/evaluate/<hash>/`` with ``results.json``, ``results.md``, ``figures/*.png``; the tables
are printed and logged to W&B (offline without an API key).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from streakline.artifacts import StageRun
from streakline.config import ConfigError
from streakline.decoding.registry import BLOCK_DRAFTED, needs_drafter_model
from streakline.evaluation.figures import draw_all
from streakline.evaluation.methods import EvalMethod
from streakline.evaluation.results import hardware, line_name, versions, write_results
from streakline.evaluation.suite import evaluate_methods
from streakline.models import locate

from .common.fingerprints import roles_parts
from .common.kinds import DRAFTER_KINDS, DrafterKind, drafter_kind, preset_rows
from .common.lookup import distill_checkpoints, distill_runs, frozen_precision, locate_block_artifact, stage_settings
from .common.prompts import evaluation_inputs
from .common.roles import check_drafter_tokenizer, role_tokenizer
from .runner import Stage, StageResult

# decoder=dflash_lookup's rule (decoding/mixed.py): a new rule decodes other rows, so runs that use it get a new key
MIX_RULE = "cost_per_token"


class Evaluate(Stage):
    name = "evaluate"
    settings = ("stage", "decoder")

    def check(self, cfg: DictConfig) -> None:
        if not cfg.stage.benchmarks or not cfg.stage.temperatures:
            raise ConfigError("stage.benchmarks and stage.temperatures must not be empty")
        bad = [T for T in cfg.stage.temperatures if not (math.isfinite(T) and T >= 0)]
        if bad:  # refused before any row decodes: a run half done under a bad grid would end in a failed manifest
            raise ConfigError(
                f"stage.temperatures={list(cfg.stage.temperatures)} holds {bad}: a verifier temperature is >= 0 "
                "(0: greedy), e.g. stage.temperatures=[0.0,1.0]"
            )
        if not 0 < cfg.stage.degenerate_share <= 1:
            raise ConfigError(
                f"stage.degenerate_share={cfg.stage.degenerate_share} must be in (0, 1]: the share of one token in the "
                "reference's output above which a benchmark leaves the headline (1 keeps every benchmark)"
            )
        if cfg.decoder.acceptance == "exact_greedy" and any(T > 0 for T in cfg.stage.temperatures):
            raise ConfigError(
                "decoder.acceptance=exact_greedy is lossless only at temperature 0, but stage.temperatures="
                f"{list(cfg.stage.temperatures)}; use decoder.acceptance=greedy_acceptance (it is exact_greedy at "
                "temperature 0) or stage.temperatures=[0.0]"
            )
        methods = [EvalMethod.from_config(m) for m in cfg.stage.methods] if cfg.stage.methods else discover(cfg)
        check_drafter_tokenizers(cfg, methods)  # before any folder is made or row decoded

    def key(self, cfg: DictConfig) -> dict[str, Any]:
        """The methods (given or discovered: a new distill run changes the key), the settings and the models."""
        ev = cfg.stage
        methods = [EvalMethod.from_config(m) for m in ev.methods] if ev.methods else discover(cfg)
        settings = stage_settings(cfg)  # (under "evaluate": the key of runs from before settings moved under stage)
        settings.pop("base", None)  # what it changes is the method list; earlier runs keep their folders
        return {
            "methods": [m.as_dict() for m in methods],
            "evaluate": settings,
            "seed": cfg.seed,
            "decoder": _decoder_key(cfg.decoder),
            **({"mix": MIX_RULE} if any(m.decoder == "dflash_lookup" for m in methods) else {}),
            "models": {r: cfg.model[r].get("path") for r in ("verifier", "drafter", "target") if r in cfg.model},
            **model_content(cfg),
            **precision_part(cfg),
        }

    def run(self, cfg: DictConfig, stage_run: StageRun) -> StageResult:
        ev = cfg.stage
        methods = [EvalMethod(**m) for m in stage_run.config["methods"]]
        t0 = time.perf_counter()
        prompts, eos = evaluation_inputs(cfg, methods)
        records = evaluate_methods(cfg, methods, prompts, eos)
        meta = {
            "experiment": cfg.experiment.name,
            "hardware": hardware(),
            "versions": versions(),
            "prompts": ev.prompts,
            "max_new_tokens": ev.max_new_tokens,
            "seconds": time.perf_counter() - t0,
        }
        json_path, _ = write_results(stage_run.dir, records, meta)
        stage_run.add_output("results.json")
        stage_run.add_output("results.md")
        figures = draw_all(records, stage_run.dir / "figures") if ev.figures else {}
        for name in figures:
            stage_run.add_output(f"figures/{name}")
        lossy = [f"{r['method']} on {r['benchmark']} T={r['temperature']:g}" for r in records if not r["lossless"]]
        stage_run.metrics.update(records=len(records), lossy=lossy, seconds=meta["seconds"])
        _log_wandb(cfg, stage_run, records, figures)
        return _result(stage_run.dir, records, {k: Path(v) for k, v in figures.items()}, lossy)

    def reuse(self, cfg: DictConfig, folder: Path) -> StageResult:
        records = json.loads((folder / "results.json").read_text())["records"]
        figures = {p.name: p for p in sorted((folder / "figures").glob("*.png"))}
        return _result(folder, records, figures, [r["method"] for r in records if not r.get("lossless", True)])

    def report(self, result: StageResult) -> None:
        print(Path(result.details["markdown"]).read_text())
        print(f"evaluate: results in {result.artifact}")
        for path in result.details["figures"].values():
            print(f"evaluate: figure {path}")
        if result.metrics["lossy"]:
            print(f"evaluate: WARNING lossless check failed for {', '.join(result.metrics['lossy'])}")


STAGE = Evaluate()


def precision_part(cfg: DictConfig) -> dict[str, str]:
    """``{"precision": "bf16"}`` when the verifier runs in reduced precision here (``common.lookup.frozen_precision``):
    its rows differ from fp32 rows in speed and may hold near-ties. Nothing for fp32, so older keys did not move."""
    precision = frozen_precision(cfg, "verifier")
    return {} if precision == "fp32" else {"precision": precision}


def model_content(cfg: DictConfig) -> dict[str, Any]:
    """What evaluate's key adds for its roles' content (``fingerprints.roles_parts``): ``{"model_content": {...}}``
    for a hub id's snapshot or a folder of the user's, nothing for presets and finished stages' folders (whose path
    is exact), so those keys did not move. A role whose weights are not here is left out: this evaluate does not
    load it, or loading it refuses with the fix."""
    content = roles_parts(cfg, ("verifier", "drafter", "target"), skip_missing=True)
    return {"model_content": content} if content else {}


def _result(folder: Path, records: list[dict], figures: dict[str, Path], lossy: list[str]) -> StageResult:
    details = {
        "markdown": str(folder / "results.md"),
        "figures": {k: str(v) for k, v in figures.items()},
        "records": records,
    }
    return StageResult("evaluate", folder, folder / "results.json", {"lossy": lossy}, details=details)


def discover(cfg: DictConfig) -> list[EvalMethod]:
    """The default method list (see the module docstring)."""
    ev = cfg.stage
    preset = drafter_kind(cfg)
    # the preset's drafter once per kind it decodes as: ar_draft and base (step 0 of every Fig. 7 line of its kind)
    # for a transformer drafter, dflash:base for a DFlash one (which never runs as AR)
    methods = [EvalMethod("vanilla", "vanilla")]
    if ev.ngram:  # prompt lookup: the free baseline (no model, no training)
        methods.append(EvalMethod("ngram", "ngram"))
    if ev.base:
        methods += preset_rows(cfg)
    runs = distill_runs(cfg)
    for r in runs:  # each run's exports decode with its kind's decoder (a DFlash run's with dflash_draft)
        r["decoder"] = drafter_kind(cfg, str(Path(r["folder"]) / "drafter")).decoder
    for kind in DRAFTER_KINDS.values():  # the lines of a kind whose runs start from weights no preset row decodes
        if ev.base and kind.start_rows and kind is not preset:  # (a from-scratch DFlash drafter's init/); the
            methods += _start_rows(kind, runs)  # preset's own kind starts from the preset's drafter, its base row
    names = [line_name(r["method"], r["decoder"]) for r in runs]  # dflash:<loss> beside a plain drafter's <loss>
    curve_temperature = min(float(T) for T in ev.temperatures)  # Fig. 7's (fig7_speedup_vs_steps picks the same)
    curves = []
    for r, name in zip(runs, names, strict=True):
        label = name if names.count(name) == 1 else f"{name}@{Path(r['folder']).name}"
        drafter, decoder = str(Path(r["folder"]) / "drafter"), r["decoder"]
        methods.append(EvalMethod(label, decoder, drafter=drafter, steps=r["steps"], distill_loss=r["method"]))
        if ev.lookup and decoder == "dflash_draft":  # the same drafter behind prompt lookup (decoding/lookup_first.py)
            hybrid = line_name(r["method"], "dflash_lookup") + label.removeprefix(name)
            # a decoder of the run's drafter, not a point of its training curve: no steps, no Fig. 7 line
            methods.append(EvalMethod(hybrid, "dflash_lookup", drafter=drafter))
        # the run's intermediate checkpoints: Fig. 7 points at one temperature (the final one is the row above)
        for steps, folder in distill_checkpoints(r):
            if steps != r["steps"]:
                curves.append(
                    EvalMethod(f"{label}@{steps}", decoder, drafter=folder, steps=steps,
                               distill_loss=r["method"], temperature=curve_temperature, curve=True)
                )  # fmt: skip
    scored = [r for r in runs if r["decoder_streak"] is not None]
    best = max(scored, key=lambda r: r["decoder_streak"]) if scored else None
    grid_drafter = str(Path(best["folder"]) / "drafter") if best else None
    grid_decoder = best["decoder"] if best else preset.decoder  # the preset's drafter when no run is scored
    for K in ev.k_grid:  # the paper's drafts: K i.i.d. samples at the drafter temperature (no argmax chain)
        for tau in ev.drafter_temperature_grid:
            methods.append(
                EvalMethod(
                    f"grid K={K} tau={tau:g}", grid_decoder, drafter=grid_drafter, K=K,
                    drafter_temperature=tau,
                    argmax_chain=False, grid=True,
                )
            )  # fmt: skip
    methods += curves
    if ev.block and cfg.model.get("target") is not None:
        methods += [EvalMethod("static", "static"), EvalMethod("threshold", "threshold")]
        for name in BLOCK_DRAFTED:
            # A Spiffy graph is calibrated for one temperature: look for one per evaluated temperature (the order
            # model serves any). A temperature without an artifact loses only its own row; the reason is printed.
            artifacts = {}
            for T in ev.temperatures:
                try:
                    artifacts[str(float(T))] = str(locate_block_artifact(cfg, name, float(T)))
                except Exception as e:  # noqa: BLE001 - a missing artifact only drops the row; say why
                    print(f"evaluate: no {name} row at T={T:g} ({e})")
            if artifacts:
                methods.append(EvalMethod(name, name, artifact=artifacts))
    return methods


def check_drafter_tokenizers(cfg: DictConfig, methods: list[EvalMethod]) -> None:
    """Refuse (one line, both hashes and the fix) a drafter folder some row decodes whose export records another
    tokenizer than the verifier's (``roles.check_drafter_tokenizer``): a DFlash drafter's ids are the verifier's,
    so under another tokenizer every row would run, silently drafting the wrong tokens."""
    drafting = [m for m in methods if needs_drafter_model(m.decoder)]
    if not drafting:
        return
    folders = {m.drafter for m in drafting if m.drafter}
    if any(not m.drafter for m in drafting):  # a row of the preset's own drafter
        folders.add(locate(cfg.model.drafter, "drafter"))
    tokenizer = role_tokenizer(cfg, "verifier")
    for folder in sorted(str(f) for f in folders if f is not None):
        check_drafter_tokenizer(folder, tokenizer)


def _start_rows(kind: DrafterKind, runs: list[dict[str, Any]]) -> list[EvalMethod]:
    """``<kind>:base`` (step 0, no loss; ``dflash:base``): the drafter the runs of ``kind`` started from (a
    from-scratch run's ``init/``, else its warm-start folder), once per distinct start (runs from one preset and
    seed share one); none when no run of the kind records one."""
    starts: dict[str, str] = {}
    for r in runs:
        if r["decoder"] == kind.decoder and r["start"]:
            starts.setdefault(r["start_key"], r["start"])
    name = line_name("base", kind.decoder)
    return [
        EvalMethod(name if len(starts) == 1 else f"{name}@{Path(start).parent.name}", kind.decoder, drafter=start,
                   steps=0)
        for start in starts.values()
    ]  # fmt: skip


def _log_wandb(cfg: DictConfig, stage_run: StageRun, records: list[dict], figures: dict[str, Path]) -> None:
    """One W&B run per evaluation (group = experiment, job type = stage): summary, the results table, figures."""
    from streakline.alignment.tracking import stage_tracker

    tracker = stage_tracker(cfg, stage_run, "evaluate", config={"evaluate": stage_settings(cfg)})
    summary = {f"{r['method']}/{r['benchmark']}/T{r['temperature']:g}/speedup": r["speedup"] for r in records}
    tracker.log(summary, step=0)
    tracker.log_table("results", records)
    for name, path in figures.items():
        tracker.log_image(name.removesuffix(".png"), path)
    tracker.close()


def _decoder_key(decoder) -> dict[str, Any]:
    """The decoder settings a result depends on. ``engine`` only when chosen (not ``auto``): every engine gives the
    same tokens, but the speed is the result too, so an explicit engine is its own run; the default keeps the keys
    of runs from before the setting existed."""
    out = OmegaConf.to_container(decoder, resolve=True)
    if out.get("engine") == "auto":
        del out["engine"]
    for key in ("draft_cost", "verify_cost"):  # added later: at their default, earlier keys did not move
        if out.get(key) is None:
            out.pop(key, None)
    return out
