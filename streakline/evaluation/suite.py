"""Run evaluation methods over benchmarks and temperatures, check every run against its reference decoder, and
return finished records (``stage=evaluate`` and ``stage=sweep`` both call :func:`evaluate_methods`).

    records = evaluate_methods(cfg, methods, prompts, eos)

``prompts``: ``{"speculative": {benchmark: ids}, "block": {benchmark: ids}}`` encoded with the verifier's and the
target's tokenizer; ``eos``: ``{"verifier": id, "target": id}``. Methods run in this process, or fan out over Ray
actors with ``launcher=ray`` (one :class:`EvalWorker` each, models built once per worker).
"""

from __future__ import annotations

import functools
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from streakline.artifacts import manifest_or_none
from streakline.config import ConfigError
from streakline.decoding.acceptance import get_rule
from streakline.decoding.registry import (
    BLOCK,
    BLOCK_DRAFTED,
    REFERENCE,
    REFERENCE_DECODERS,
    SPECULATIVE,
    block_decode_config,
    block_drafter,
    decoder_family,
    needs_drafter_model,
    speculative_setup,
)
from streakline.decoding.vanilla import NEW_TOKENS_KNOB, PositionLimitError

from .lossless import exact_check, sampled_check, tie_check
from .methods import DECODER_OVERRIDES, EvalMethod
from .results import DEGENERATE_SHARE, finalize
from .runner import MethodRun, batches, merge_runs, run_block, run_speculative, sequence_logprobs, tie_gap

family = decoder_family  # "block" (the block-diffusion target's decoders) or "speculative" (the verifier's)


class EvalWorker:
    """Builds the models once; ``run(i)`` evaluates method i on every benchmark and temperature. Runs in-process
    or as a Ray actor (``launcher=ray``)."""

    def __init__(self, job: dict[str, Any]) -> None:
        self.cfg = OmegaConf.create(job["cfg"])
        self.methods: list[EvalMethod] = job["methods"]
        self.prompts = job["prompts"]
        torch.set_num_threads(max(1, self.cfg.stage.threads))
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self._models: dict[str, Any] = {}
        self.eos = {role: job["eos"].get(role) for role in ("verifier", "target")}
        self._trained: dict[str | None, dict[str, float | None]] = {}
        self._warm: dict[str, float] = {}  # method name -> seconds of its untimed warm-up decode
        self.decodes: list[tuple[str, str, float, int]] = []  # (method, benchmark, temperature, prompts) per call

    def model(self, role: str, path: str | None = None, dtype: torch.dtype | None = None):
        """The model of ``role`` (at ``path`` if given), built once. The verifier and the drafter run in the
        precision ``precision`` resolves to here (``common.lookup.frozen_dtype``); the block-diffusion target stays
        in its preset's dtype, so the block decoders' exact check holds as before. ``dtype`` overrides (the fp32
        reference of ``tie_gap``)."""
        from streakline.models import build
        from streakline.pipelines.common.lookup import frozen_dtype

        if dtype is None and role in ("verifier", "drafter"):
            dtype = frozen_dtype(self.cfg, role)
        key = f"{role}:{path}:{dtype}"
        if key not in self._models:
            preset = self.cfg.model[role]
            if path is not None:
                preset = OmegaConf.merge(preset, {"path": path})
            self._models[key] = build(preset, role, device=self.device, inference=True, dtype=dtype)
        return self._models[key]

    def precision(self) -> str:
        """The verifier's precision in this run: ``fp32``, ``bf16`` or ``fp16``."""
        from streakline.pipelines.common.lookup import frozen_precision

        return frozen_precision(self.cfg, "verifier")

    def tie_gap(self, benchmark: str, index: int, prefix: list[int], token: int, other: int) -> dict[str, float]:
        """``runner.tie_gap`` at prompt ``index`` of ``benchmark`` plus ``prefix``, against the verifier in fp32
        (built on first use: only a run in reduced precision whose output diverged needs it)."""
        prompt = self.prompts["speculative"][benchmark][index]
        reference = self.model("verifier", dtype=torch.float32)
        return tie_gap(self.model("verifier"), reference, prompt, prefix, token, other)

    def cells(self, index: int) -> list[tuple[str, float]]:
        """The (benchmark, verifier temperature) pairs method ``index`` decodes, in the order its rows come."""
        method = self.methods[index]
        temps = list(self.cfg.stage.temperatures)
        if method.grid:
            temps = [self.cfg.stage.grid_temperature]
        elif method.temperature is not None:
            temps = [method.temperature]
        return [
            (bench, float(t))
            for bench in self.prompts[family(method.decoder)]
            for t in temps
            # no artifact for this temperature (discovery said why)
            if not (isinstance(method.artifact, dict) and str(float(t)) not in method.artifact)
        ]

    def run(self, index: int) -> list[dict[str, Any]]:
        """Method ``index``'s rows: one per benchmark and temperature (what a Ray actor runs)."""
        return self.run_all([index])

    def run_all(self, indices: list[int], *, interleave: bool = True, progress: bool = False) -> list[dict[str, Any]]:
        """The rows of methods ``indices``, method by method in that order, each as :meth:`run` gives it.

        With ``interleave`` the methods take turns: in each benchmark and temperature, every method decodes the
        first batch of prompts (``stage.batch_size``), then every method the next, the first to go moving on by one
        each batch. A slow spell of a shared machine then falls on all of them alike, where one method decoding all
        its prompts before the next would take it alone and skew every speedup against it. The tokens and counts do
        not change (every decode call seeds its own generators; the counts of the calls are summed); the order of
        the calls is kept in ``self.decodes``. Without, each method decodes all its prompts before the next starts."""
        if not interleave:
            return [row for i in indices for row in self.run_all([i], progress=progress)]
        cells: dict[tuple[str, str, float], list[int]] = {}  # (family, benchmark, temperature) -> its methods
        for i in indices:
            for bench, temperature in self.cells(i):
                cells.setdefault((family(self.methods[i].decoder), bench, temperature), []).append(i)
        size = self.cfg.stage.batch_size
        total = sum(len(batches(self.prompts[fam][bench], size)) * len(ms) for (fam, bench, _), ms in cells.items())
        runs: dict[tuple[int, str, float], list[MethodRun]] = {}
        settings: dict[tuple[int, str, float], dict] = {}
        turn = 0
        with tqdm(total=total, desc="evaluate", unit="decode", dynamic_ncols=True, disable=not progress) as bar:
            for (fam, bench, temperature), members in cells.items():
                prompts = self.prompts[fam][bench]
                for batch in batches(prompts, size):
                    first = turn % len(members)
                    turn += 1
                    for i in members[first:] + members[:first]:
                        run, settings[i, bench, temperature] = self._decode(i, prompts, batch, temperature)
                        runs.setdefault((i, bench, temperature), []).append(run)
                        self.decodes.append((self.methods[i].name, bench, temperature, len(batch)))
                        bar.update()
        return [
            self._row(i, bench, t, merge_runs(runs[i, bench, t]), settings[i, bench, t])
            for i in indices
            for bench, t in self.cells(i)
        ]

    def _decode(self, index: int, prompts: list, batch: list, temperature: float):
        """Method ``index`` on one ``batch`` of a benchmark's ``prompts`` (warmed up first on the benchmark's first
        prompt if it has not been): ``(MethodRun, settings)``."""
        method = self.methods[index]
        decode = self._block if family(method.decoder) == "block" else self._speculative
        try:
            self._warm_up(decode, method, prompts, temperature)
            return decode(method, batch, temperature)
        except PositionLimitError as e:  # evaluate's own setting, not stage=decode's
            raise PositionLimitError(str(e).replace(NEW_TOKENS_KNOB, "stage.max_new_tokens")) from e

    def _row(self, index: int, bench: str, temperature: float, run: MethodRun, settings: dict) -> dict[str, Any]:
        method = self.methods[index]
        fam = family(method.decoder)
        prompts = self.prompts[fam][bench]
        row = {
            "method": method.name,
            "decoder": method.decoder,
            "family": fam,
            "drafter": method.drafter,
            "steps": method.steps,
            "benchmark": bench,
            "temperature": temperature,
            "settings": settings,
            "precision": self.precision() if fam == "speculative" else self._target_precision(),
            "prompts": len(prompts),
            "tokens": run.tokens,
            **run.metrics,
            **({"warmup_s": self._warm[method.name]} if method.name in self._warm else {}),
        }
        if fam == "speculative" and temperature > 0:
            row["logprobs"] = sequence_logprobs(self.model("verifier"), prompts, run.tokens)
        return row

    def _warm_up(self, decode, method: EvalMethod, prompts, temperature: float) -> None:
        """Before a method's first timed decode, decode its first prompt for ``stage.warmup_tokens`` new tokens (at
        most a quarter of ``stage.max_new_tokens``), untimed: the costs of a model's first calls (oneDNN primitives and
        weight reorders, allocator growth, a GPU engine's graph capture) then fall on no row. Without it the verifier's
        fall on vanilla's first benchmark, inflating every speedup measured against it, and a drafter's on its
        method's first. Outputs are unchanged: every decode seeds its own generators."""
        # at most a quarter of the timed decode's length: enough for the prefill, decode and verify shapes, and a
        # test-sized evaluate (a dozen tokens) does not decode a third more for it
        n = min(int(self.cfg.stage.get("warmup_tokens", 0)), max(1, int(self.cfg.stage.max_new_tokens) // 4))
        if n < 1 or method.name in self._warm or not prompts:
            return
        t0 = time.perf_counter()
        decode(method, prompts[:1], temperature, new_tokens=n)
        self._warm[method.name] = time.perf_counter() - t0

    def _target_precision(self) -> str:
        from streakline.models.precision import precision_name

        return precision_name(next(self.model("target").parameters()).dtype)

    def _pick(self, method: EvalMethod) -> dict[str, Any]:
        return {k: method.override(k, self.cfg.decoder.get(k)) for k in DECODER_OVERRIDES}

    def _block(self, method: EvalMethod, prompts, temperature: float, new_tokens: int | None = None):
        ev, pick = self.cfg.stage, self._pick(method)
        rule = method.decoder if method.decoder in BLOCK else pick["rule"]
        decode = block_decode_config(
            self.cfg.decoder, eos_token_id=self.eos["target"], rule=rule,
            max_new_tokens=new_tokens or ev.max_new_tokens, temperature=temperature, seed=self.cfg.seed,
        )  # fmt: skip
        drafter = None
        if method.decoder in BLOCK_DRAFTED:
            if method.decoder == "spiffy" and method.budget is None:
                pick["budget"] = None  # the whole calibrated graph unless the method says otherwise
            artifact = method.artifact[str(temperature)] if isinstance(method.artifact, dict) else method.artifact
            drafter = block_drafter(
                method.decoder, artifact, pick, device=self.device, target=self.cfg.model.target.name
            )
        run = run_block(self.model("target"), prompts, decode, drafter, batch_size=ev.batch_size)
        settings = {"rule": rule, **({k: pick[k] for k in ("budget", "prune", "prefix_mass_floor")} if drafter else {})}
        return run, settings

    def _speculative(self, method: EvalMethod, prompts, temperature: float, new_tokens: int | None = None):
        ev, pick = self.cfg.stage, self._pick(method)
        decoder = OmegaConf.merge(
            self.cfg.decoder,
            {
                "name": method.decoder,
                "temperature": temperature,
                "max_new_tokens": new_tokens or ev.max_new_tokens,
                "K": pick["K"],
                "gamma": pick["gamma"],
                "drafter_temperature": pick["drafter_temperature"],
                "argmax_chain": pick["argmax_chain"],
            },
        )
        drafter_model = self.model("drafter", method.drafter) if needs_drafter_model(method.decoder) else None
        try:
            spec, drafter = speculative_setup(
                decoder,
                drafter_model,
                gamma_default=self.cfg.model.drafter.gamma,
                eos_token_id=self.eos["verifier"],
                seed=self.cfg.seed,
                verifier=self.model("verifier"),  # a DFlash drafter shares its embedding and head
            )
        except (ValueError, NotImplementedError) as e:
            raise ConfigError(f"evaluate: method {method.name!r}: {e}") from e
        run = run_speculative(self.model("verifier"), prompts, spec, drafter, batch_size=ev.batch_size)
        if method.decoder == "vanilla":
            return run, {"grid": False}
        settings = {
            "K": spec.K,
            "gamma": spec.gamma,
            "acceptance": spec.acceptance,
            "grid": bool(method.grid),
            "drafter_temperature": decoder.drafter_temperature,
            # what was drafted: chain 0 the argmax (True) or K i.i.d. draws from q (False; also when the rule needs it)
            "argmax_chain": bool(spec.argmax_chain and not get_rule(spec.acceptance, spec.temperature, spec.K).iid),
            "distill_loss": method.distill_loss,
            "curve": bool(method.curve),
            **self._training(method.drafter),
        }
        return run, settings

    def _training(self, drafter: str | None) -> dict[str, Any]:
        """The temperatures a drafter was trained with, read once per checkpoint (see :func:`training_temperatures`)."""
        if drafter not in self._trained:
            self._trained[drafter] = training_temperatures(drafter)
        return self._trained[drafter]


TRAINING_TEMPERATURES = ("train_drafter_temperature", "data_temperature", "data_top_p")


def training_temperatures(drafter: str | None) -> dict[str, float | None]:
    """``train_drafter_temperature`` (the distill run's ``method.drafter_temperature``, the temperature q was trained
    at), ``data_temperature`` and ``data_top_p`` (how the verifier sampled the trajectories it was trained on) of a
    drafter checkpoint: from the manifest of the ``stage=distill`` run that holds it (``<run>/drafter`` or
    ``<run>/checkpoints/step-*``), and through its ``trajectories`` entry from that stage's manifest. None for what
    is unknown: the preset's drafter, a folder from elsewhere, a manifest without the value, and a run's ``init/``
    (the weights a DFlash run started from, trained by nobody)."""
    out: dict[str, float | None] = dict.fromkeys(TRAINING_TEMPERATURES)
    if drafter is None or Path(drafter).name == "init":
        return out
    folder = Path(drafter)
    found = (
        manifest_or_none(run) for run in (folder.parent, folder.parent.parent)
    )  # <run>/drafter, <run>/checkpoints/x
    distill = next((m for m in found if m is not None and m.stage == "distill"), None)
    if distill is None:
        return out
    out["train_drafter_temperature"] = _number((distill.config.get("method") or {}).get("drafter_temperature"))
    shards = distill.config.get("trajectories")
    data = manifest_or_none(Path(shards).parent) if isinstance(shards, str) else None
    if data is not None and data.stage == "trajectories":
        sampling = data.config.get("data") or {}
        out["data_temperature"] = _number(sampling.get("temperature"))
        out["data_top_p"] = _number(sampling.get("top_p"))
    return out


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def check_lossless(rows: list[dict], gap: Any = None) -> None:
    """Attach ``lossless``, ``lossless_check`` and ``divergence_rate`` to every row, against its family's reference
    decoder: token for token at temperature 0 (and for every block decoder), a statistical test of the sequences'
    verifier log-probs for sampled speculative rows. A temperature-0 speculative row whose verifier ran in reduced
    precision is checked with ``tie_check`` when ``gap`` is given (``EvalWorker.tie_gap``'s signature): a
    divergence at a bf16 near-tie is reported, not called lossy (``lossless.py``)."""
    refs = {(r["decoder"], r["benchmark"], r["temperature"]): r for r in rows if r["decoder"] in REFERENCE_DECODERS}
    for r in rows:
        if r["decoder"] in REFERENCE_DECODERS:
            r.update(lossless=True, lossless_check={"lossless": True, "check": "reference decoder"})
            r["divergence_rate"] = 0.0
            continue
        ref_name = r["settings"].get("rule") if r["family"] == "block" else REFERENCE["speculative"]
        ref = refs.get((ref_name, r["benchmark"], r["temperature"]))
        if ref is None:
            r.update(lossless=False, lossless_check={"lossless": False, "check": f"no {ref_name} reference run"})
            r["divergence_rate"] = None
            continue
        sampled = r["family"] == "speculative" and r["temperature"] > 0
        if sampled:
            check = sampled_check(r["logprobs"], ref["logprobs"])
        elif r["family"] == "speculative" and r["precision"] != "fp32" and gap is not None:
            check = tie_check(r["tokens"], ref["tokens"], functools.partial(gap, r["benchmark"]))
        else:
            check = exact_check(r["tokens"], ref["tokens"])
        r.update(lossless=check["lossless"], lossless_check=check, divergence_rate=check.get("divergence_rate"))


def mark_reference_diversity(rows: list[dict], threshold: float = DEGENERATE_SHARE) -> None:
    """Give every row ``reference_top_share``: the share of the most frequent token id in its family's reference
    output (vanilla or static) at temperature 0 on that benchmark, ``reference_top_token`` (that id), and
    ``degenerate`` (the share is above ``threshold``). A share near 1 means the verifier (target) repeats one token
    there: any drafter that learns it accepts every draft, so the benchmark measures nothing about alignment
    (``results.headline`` keeps it out of the headline)."""
    share: dict[tuple[str, str], tuple[float, int]] = {}
    for r in rows:
        if r["decoder"] in REFERENCE_DECODERS and r["temperature"] == 0 and r["decoder"] == REFERENCE[r["family"]]:
            counts = Counter(t for seq in r["tokens"] for t in seq)
            total = sum(counts.values())
            if total:
                token, n = counts.most_common(1)[0]
                share[(r["family"], r["benchmark"])] = (n / total, token)
    for r in rows:
        top = share.get((r["family"], r["benchmark"]))
        r["reference_top_share"], r["reference_top_token"] = top if top is not None else (None, None)
        r["degenerate"] = top is not None and top[0] > threshold


def with_references(methods: list[EvalMethod]) -> list[EvalMethod]:
    """``methods`` plus the reference decoders their checks and speedups need (vanilla, static, threshold)."""
    names = {m.decoder for m in methods}
    extra = []
    drafted = {name for name, drafter in SPECULATIVE.items() if drafter is not None}  # every kind's decoder
    if names & drafted and "vanilla" not in names:
        extra.append(EvalMethod("vanilla", "vanilla"))
    rules = {m.rule or "static" for m in methods if m.decoder in BLOCK_DRAFTED}
    extra += [EvalMethod(rule, rule) for rule in sorted(rules) if rule not in names]
    return extra + methods


def evaluate_methods(cfg: DictConfig, methods: list[EvalMethod], prompts: dict, eos: dict) -> list[dict]:
    """Run ``methods`` (with their references added) on cfg.stage's benchmarks and temperatures; checked,
    finalised records (without tokens)."""
    methods = with_references(methods)
    ev = cfg.stage
    print(f"evaluate: {len(methods)} methods x {len(ev.benchmarks)} benchmarks x {len(ev.temperatures)} temperatures")
    job = {"cfg": OmegaConf.to_container(cfg, resolve=True), "methods": methods, "prompts": prompts, "eos": eos}
    rows, worker = _evaluate_all(cfg, job, methods)
    local: list[EvalWorker] = [worker] if worker is not None else []

    def gap(bench: str, i: int, prefix: list[int], a: int, b: int) -> dict[str, float]:
        if not local:  # the methods ran on Ray: the near-ties are weighed here, with models of this process
            local.append(EvalWorker(job))
        return local[0].tie_gap(bench, i, prefix, a, b)

    check_lossless(rows, gap)
    mark_reference_diversity(rows, float(ev.get("degenerate_share", DEGENERATE_SHARE)))
    return finalize([{k: v for k, v in r.items() if k not in ("tokens", "logprobs")} for r in rows])


def _evaluate_all(cfg: DictConfig, job: dict, methods: list[EvalMethod]) -> tuple[list[dict], EvalWorker | None]:
    """Every method's rows, and the in-process worker that ran them (None when they ran on Ray). In process the
    methods take turns batch by batch (``stage.interleave``, :meth:`EvalWorker.run_all`); on Ray each actor decodes
    whole methods, side by side with the others."""
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
        return [row for i in range(len(methods)) for row in results[i]], None
    worker = EvalWorker(job)
    interleave = bool(cfg.stage.get("interleave", True))
    return worker.run_all(list(range(len(methods))), interleave=interleave, progress=True), worker
