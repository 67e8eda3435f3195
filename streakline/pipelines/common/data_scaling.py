"""stage=scaling's data-scaling part (``stage.token_sizes``, docs/scaling.md): which distill runs it makes, the
point each gives, and the wall-clock decode of their drafters. The stage (``pipelines/scaling.py``) calls it; the
arithmetic and figures are ``evaluation/scaling.py``'s.

    runs = token_runs(cfg)                   # [Run(label, method, size, seed, overrides), ...]
    prior = read_prior(cfg)                  # stage.ledger, stage.prior: earlier sittings' points and decoded rows
    lines = study_plan(cfg, finished, prior)  # printed first: each run found by its key or to train
    points = token_points(cfg, run_stage)    # {label: [{"data_size", "seed", "value", "folder", ...}, ...]}
    rows = wall_clock(cfg, points, run_stage)   # stage.evaluate: speedup per point, beside vanilla and ngram
    points = with_prior(points, prior.points)  # the earlier points where this sitting has none
    # prior.rows: their decodes (scaling_report.with_prior_rows merges them)
    write_ledger(cfg, summary["acceptance"], summary["wall_clock"]["rows"])  # stage.ledger: measured points, decodes

A run is one loss of one recipe (an arm: ``stage.arms``, or the stage's own methods and run_overrides) at one
token size and seed; every run is an ordinary distill run, cached by its key, so a cut-off study resumes. Where the
run folders do not survive (a new machine, a purged scratch), ``stage.prior`` reads the points of earlier sittings
from their reports, so a study's curve spans sittings on any machine.
"""

from __future__ import annotations

import json
import math
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from omegaconf import DictConfig

from streakline.artifacts import read_manifest, write_text_atomic
from streakline.config import ConfigError, compose_config
from streakline.errors import UserError
from streakline.evaluation import scaling as scaling_report
from streakline.evaluation.scaling import panel_key, point_name
from streakline.locks import update_lock

from .lookup import stage_overrides


@dataclass(frozen=True)
class Run:
    label: str  # the line it is a point of: the loss, or <arm>:<loss>
    method: str
    size: int  # trainer.train_tokens
    seed: int
    overrides: tuple[str, ...]  # the arm's (after the stage's)
    adapt: str | None = None  # the arm's: a run of this method on the same subset first, which the run starts from


def arms(cfg: DictConfig) -> list[tuple[str, list[str], list[int], list[str], str | None]]:
    """``(name, methods, token sizes, overrides, adapt)`` per recipe: each ``stage.arms`` entry (every ``every``-th
    of the stage's sizes, its overrides after the stage's ``run_overrides``), or one unnamed recipe of
    ``stage.methods``."""
    s = cfg.stage
    common, sizes = list(s.run_overrides), sorted(s.token_sizes)
    if not s.arms:
        return [("", list(s.methods), sizes, common, None)]
    return [(a.name, list(a.methods), every(sizes, a.every), [*common, *a.run_overrides], a.adapt) for a in s.arms]


def every(sizes: list[int], k: int) -> list[int]:
    """Every ``k``-th of ``sizes`` (sorted) from the smallest, and the largest always."""
    picked = sizes[::k]
    return picked if not sizes or picked[-1] == sizes[-1] else [*picked, sizes[-1]]


def token_runs(cfg: DictConfig) -> list[Run]:
    """Every acceptance run of ``stage.token_sizes``: each recipe's losses at each of its sizes at the config's seed,
    and at its smallest and largest size also at every ``stage.seeds`` entry."""
    out = []
    for name, methods, sizes, overrides, adapt in arms(cfg):
        sizes = sorted(sizes)
        ends = {sizes[0], sizes[-1]}
        for m in methods:
            for size in sizes:
                for seed in dict.fromkeys([cfg.seed, *(cfg.stage.seeds if size in ends else [])]):
                    out.append(Run(f"{name}:{m}" if name else m, m, size, seed, tuple(overrides), adapt))
    return out


def data_seed(cfg: DictConfig) -> str:
    """``data.seed=<s>``: the seed the one trajectory set is sampled with (``data.seed``, else the run seed), pinned
    so that runs of other seeds read the same set."""
    return f"data.seed={cfg.data.seed if cfg.data.seed is not None else cfg.seed}"


def check_set_holds(cfg: DictConfig, metrics: dict[str, Any]) -> None:
    """Refuse, naming the ``data.max_prompts`` that would do, token sizes past the completion tokens of the set
    (the trajectories' manifest ``metrics``): each distill run would refuse its own size only when its turn came."""
    largest, held, rows = max(cfg.stage.token_sizes), int(metrics["completion_tokens"]), int(metrics["rows"])
    if largest <= held:
        return
    # the set's own tokens a prompt, and 5% to spare: a set of more prompts starts with the rows of this one
    prompts = math.ceil(largest / max(held / max(rows, 1), 1.0) * 1.05 / cfg.data.samples_per_prompt)
    raise ConfigError(
        f"stage.token_sizes reaches {largest:,} completion tokens, but the set holds {held:,} in {rows} rows "
        f"(data.max_prompts={cfg.data.max_prompts}); make it larger (about data.max_prompts={prompts}: its first rows "
        "are this set's) or drop the sizes past it. Nothing was trained"
    )


def run_overrides(cfg: DictConfig, run: Run, method: str | None = None) -> list[str]:
    """The composed overrides of one run's distill (of ``method`` in place of the run's: its adaptation run): the
    command line's, then the run's own."""
    words = [f"method={method or run.method}", f"trainer.train_tokens={run.size}", f"seed={run.seed}",
             data_seed(cfg), *run.overrides]  # fmt: skip
    if run.adapt is not None and method is None:  # the same command with method=<adapt> made what it starts from
        words.append(f"trainer.init_from='distill:method={run.adapt}'")
    return stage_overrides(cfg, f"distill {shlex.join(words)}")[1]


def study_plan(cfg: DictConfig, finished, prior: Prior) -> list[str]:
    """What the study is about to do, a line each, before any run trains: every :func:`token_runs` run found by its
    key (``finished``: a composed distill config -> its complete folder or None) or to be trained, with its
    adaptation where its arm has one, and how many earlier sittings' points ``prior`` (:func:`read_prior`) adds. A
    run whose config cannot be looked up yet (its adaptation is not made) is one to train."""

    def found(overrides: list[str]) -> Path | None:
        try:
            return finished(compose_config(overrides))
        except UserError:  # a run that cannot be looked up before another is made
            return None

    runs, rows, todo = token_runs(cfg), [], 0
    for run in runs:
        folder = found(run_overrides(cfg, run))
        todo += folder is None
        row = f"  {'to train' if folder is None else 'found':<8}  {run.label} at {run.size:,} tokens, seed {run.seed}"
        row += "" if folder is None else f": {folder.name}"
        if run.adapt is not None:
            adapted = found(run_overrides(cfg, run, run.adapt)) is not None
            row += f" (from its {run.adapt} adaptation, {'found' if adapted else 'to train'})"
        rows.append(row)
    n_prior = len(prior.points)
    head = f"{len(runs)} distill run(s): {len(runs) - todo} found by their keys, {todo} to train"
    head += f"; {n_prior} point(s) of earlier sittings from stage.ledger / stage.prior" if n_prior else ""
    return [head, *rows]


def token_points(cfg: DictConfig, run_stage) -> dict[str, list[dict[str, Any]]]:
    """One distill run per :func:`token_runs` entry, each one point: x the subset's completion tokens, y its best
    held-out check (the run's ``best/<metric>`` with ``trainer.patience``, else its last check)."""
    metric, points = cfg.stage.metric, {}
    for run in token_runs(cfg):
        if run.adapt is not None:  # cached by its key: one adaptation serves every loss of the arm at this size
            run_stage(compose_config(run_overrides(cfg, run, run.adapt)))
        result = run_stage(compose_config(run_overrides(cfg, run)))
        manifest = read_manifest(result.folder)
        value = manifest.metrics.get(f"best/{metric}")
        if value is None:
            records = scaling_report.read_metrics(Path(result.folder) / "metrics.jsonl")
            checks = scaling_report.acceptance_points(records, metric)
            value = checks[-1]["value"] if checks else None
        if value is None:
            raise ConfigError(
                f"the distill run {result.folder} has no held-out {metric}: give it a check (trainer.eval_prompts > 0 "
                "and trainer.eval_sources)"
            )
        points.setdefault(run.label, []).append({
            "method": run.label, "loss": run.method, "data_size": run.size, "seed": run.seed,
            "step": manifest.metrics.get("steps"), "label_tokens": run.size, "value": value,
            "folder": str(result.folder), **best_check(Path(result.folder), metric), "set": set_key(manifest),
        })  # fmt: skip
    return points


def set_key(manifest) -> str | None:
    """The key of the trajectory set a distill run read (the name of its folder, ``.../trajectories/<key>/shards``),
    or None for a run that read none. Points of one set are nested subsets of it; points of two sets are not."""
    trajectories = manifest.config.get("trajectories")
    return Path(trajectories).parent.name if trajectories else None


def best_check(folder: Path, metric: str) -> dict[str, Any]:
    """What a distill run's best held-out check says per benchmark (its last check without ``best_step``):
    ``benchmarks``, the value of ``metric`` on each, and ``slots``, each one's per-slot acceptance ``alpha``. {}
    for a folder without a manifest or metrics."""
    if not (folder / "manifest.json").is_file() or not (folder / "metrics.jsonl").is_file():
        return {}
    records = scaling_report.read_metrics(folder / "metrics.jsonl")
    best = read_manifest(folder).metrics.get("best_step")
    if best is None:
        checks = scaling_report.acceptance_points(records, metric)
        best = checks[-1]["step"] if checks else None
    check = scaling_report.check_at(records, best)
    return {"benchmarks": scaling_report.per_source(check, metric), "slots": scaling_report.per_source(check, "alpha")}


def wall_clock(cfg: DictConfig, points: dict[str, list[dict[str, Any]]], run_stage) -> list[dict[str, Any]]:
    """``stage.evaluate``: one stage=evaluate (``settings.evaluate``: benchmarks, prompts, temperatures) of vanilla,
    ngram and the drafter of every point at the config's seed, each decoded by its kind's decoder and checked
    lossless; returns its records (``method`` = :func:`point_name`), cached by evaluate's key like any run."""
    from streakline.config.schema import EvalMethodConfig
    from streakline.evaluation.methods import EvalMethod

    from .kinds import drafter_kind

    evaluation = compose_config(stage_overrides(cfg, "evaluate")[1])
    lookup = bool(evaluation.stage.get("lookup"))
    methods = [EvalMethod("vanilla", "vanilla"), EvalMethod("ngram", "ngram")]
    for pts in points.values():
        for p in pts:
            if p["seed"] != cfg.seed:
                continue
            drafter = str(Path(p["folder"]) / "drafter")
            decoder = drafter_kind(cfg, drafter).decoder
            methods.append(EvalMethod(point_name(p), decoder, drafter=drafter, distill_loss=p["loss"]))
            if lookup and decoder == "dflash_draft":  # settings.evaluate.lookup: behind prompt lookup too
                methods.append(EvalMethod(point_name(p, lookup=True), "dflash_lookup", drafter=drafter))
    evaluation.stage.methods = [EvalMethodConfig(**m.as_dict()) for m in methods]
    result = run_stage(evaluation)
    return [{**r, "evaluate": _relative(result.folder)} for r in result.details["records"]]


def _relative(folder: str | Path) -> str:
    """A run folder as the ledger keeps it: relative to the current directory where it lies under it (a
    repository's runs/), so the file reads the same from any checkout."""
    folder, here = Path(folder), Path.cwd()
    return str(folder.relative_to(here)) if folder.is_relative_to(here) else str(folder)


PRIOR_KEYS = ("method", "data_size", "seed", "value")  # what a prior point must give (label, size, seed, the value)
ROW_KEYS = ("method", "data_size", "benchmark", "temperature", "speedup")  # and a prior decoded row


def _prior_files(cfg: DictConfig) -> list[tuple[str, Path]]:
    """``(setting, path)`` of every file whose points join the report: the ledger first (the study's own record),
    then ``stage.prior``'s, in their order. Absolute already (config.validate.resolve_paths)."""
    s = cfg.stage
    return ([("stage.ledger", Path(s.ledger))] if s.ledger else []) + [("stage.prior", Path(n)) for n in s.prior]


def _checked_files(cfg: DictConfig) -> list[tuple[str, Path, dict[str, Any]]]:
    """``(setting, path, contents)`` of ``stage.ledger``'s file and ``stage.prior``'s files, each checked against this
    study: a scaling.json (or a file of its shape) of the same metric and model. Refuses (naming the file and the
    fix) a file that is not JSON or does not match, and a prior file that is missing; a missing ledger is one this
    study starts."""
    s, out = cfg.stage, []
    if (s.prior or s.ledger) and not s.token_sizes:
        setting = "stage.prior adds earlier points to" if s.prior else "stage.ledger records"
        raise ConfigError(f"{setting} a data-scaling study, and stage.token_sizes is empty")
    for setting, path in _prior_files(cfg):
        if setting == "stage.ledger" and not path.exists():
            continue
        summary = _read_points_file(setting, path)
        if summary.get("metric") != s.metric:
            other = "another file" if setting == "stage.ledger" else "leave it out"
            raise ConfigError(
                f"{setting}: {path} holds {summary.get('metric')!r} points and this study fits stage.metric="
                f"{s.metric}: give the same metric, or {other}"
            )
        model = (summary.get("setup") or {}).get("model")
        if model is not None and model != cfg.model.name:
            raise ConfigError(f"{setting}: {path} measured model={model}, this study model={cfg.model.name}")
        out.append((setting, path, summary))
    return out


class Prior(NamedTuple):
    """What ``stage.ledger``'s and ``stage.prior``'s files say, read once (:func:`read_prior`)."""

    points: list[dict[str, Any]]  # acceptance points, each marked ``prior: <file name>``, in the files' order
    rows: list[dict[str, Any]]  # decoded rows (a point's drafter's wall-clock speedup), marked alike


def read_prior(cfg: DictConfig) -> Prior:
    """The points and decoded rows of ``stage.ledger``'s file and ``stage.prior``'s files (each a ``scaling.json`` of
    an earlier study, or a file of its shape), each marked ``prior: <file name>``, in the files' order; the files are
    checked by :func:`_checked_files`, and a point or row that lacks a field is refused, naming the file. A ledger
    keeps its rows as a list (``wall_clock``), an earlier report as ``{"rows", "ngram"}``, whose bar each row then
    carries. Each file is read once: the stage calls this once to check the files, once for its key and once to
    run."""
    points, rows = [], []
    for setting, path, summary in _checked_files(cfg):
        points += _prior_points(setting, path, summary)
        rows += _prior_rows(setting, path, summary)
    return Prior(points, rows)


def _prior_points(setting: str, path: Path, summary: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for i, p in enumerate(summary["acceptance"]):
        bad = [k for k in PRIOR_KEYS if not isinstance(p, dict) or p.get(k) is None]
        if bad:
            raise ConfigError(f"{setting}: {path}: point {i} lacks {bad} (each needs {list(PRIOR_KEYS)})")
        size = int(p["data_size"])
        out.append({
            "loss": p.get("loss", p["method"]), "step": p.get("step"), "label_tokens": p.get("label_tokens", size),
            "folder": p.get("folder"), **p, "data_size": size, "seed": int(p["seed"]),
            "prior": p.get("prior") or path.name,
        })  # fmt: skip
    return out


def _prior_rows(setting: str, path: Path, summary: dict[str, Any]) -> list[dict[str, Any]]:
    wall = summary.get("wall_clock") or []
    rows = wall.get("rows") or [] if isinstance(wall, dict) else wall
    bars = wall.get("ngram") or {} if isinstance(wall, dict) else {}
    out = []
    for i, r in enumerate(rows):
        bad = [k for k in ROW_KEYS if not isinstance(r, dict) or k not in r]
        if bad:
            raise ConfigError(f"{setting}: {path}: decoded row {i} lacks {bad} (each needs {list(ROW_KEYS)})")
        bar = bars.get(panel_key(r["benchmark"], r["temperature"]))
        out.append({"ngram": bar, **r, "data_size": int(r["data_size"]), "prior": r.get("prior") or path.name})
    return out


def _read_points_file(setting: str, path: Path) -> dict[str, Any]:
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{setting}: {path} does not exist; give the scaling.json of an earlier study") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{setting}: {path} is not readable JSON ({e}); give an earlier study's scaling.json") from e
    if not isinstance(summary, dict) or not isinstance(summary.get("acceptance"), list):
        raise ConfigError(f"{setting}: {path} has no 'acceptance' list of points: is it a scaling.json?")
    return summary


def with_prior(points: dict[str, list[dict[str, Any]]], prior: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """``points`` and every point of ``prior`` (:func:`read_prior`'s, of ``stage.ledger``'s and ``stage.prior``'s
    files) of a (line, size, seed) this study did not measure: what runs now wins, and the first file that gives a
    point wins over the later ones (the ledger first)."""
    have = {(p["method"], p["data_size"], p["seed"]) for pts in points.values() for p in pts}
    out, grown = {label: list(pts) for label, pts in points.items()}, set()
    for p in prior:
        at = (p["method"], p["data_size"], p["seed"])
        if at not in have:
            have.add(at)
            out.setdefault(p["method"], []).append(p)
            grown.add(p["method"])
    for label in grown:  # a line's points by size, as a study that ran them all would list them
        out[label].sort(key=lambda p: (p["data_size"], p["seed"]))
    return out


def write_ledger(cfg: DictConfig, acceptance: list[dict[str, Any]], rows: list[dict[str, Any]] = ()) -> Path | None:
    """``stage.ledger``: add the measured points among ``acceptance`` (a report's, prior points left out) to the
    ledger file, each replacing the fields of the file's point of the same line, size and seed with what the run's
    folder says of it (:func:`ledger_point`); the file's other points, and fields the run does not give, stay. The
    measured decoded rows among ``rows`` (a report's ``wall_clock`` rows) go to its ``wall_clock`` list alike, one
    per line, size, benchmark and temperature, so the speedup figure spans sittings as the curve does.
    Written atomically, so a killed writer leaves the old file, and under ``locks.update_lock``, so two reports
    writing one ledger at once both land; the same points give the same file, so rewriting it changes nothing.
    Returns the path, or None without a ledger."""
    s = cfg.stage
    if not s.ledger:
        return None
    path = Path(s.ledger)
    path.parent.mkdir(parents=True, exist_ok=True)
    with update_lock(path):  # two reports at once (a Slurm multirun): the second reads the first's points
        _update_ledger(cfg, path, acceptance, rows)
    return path


def _update_ledger(cfg: DictConfig, path: Path, acceptance: list[dict[str, Any]], rows=()) -> None:
    s = cfg.stage
    if path.exists():
        ledger = _read_points_file("stage.ledger", path)
    else:
        ledger = {
            "about": f"The points of experiment={cfg.experiment.name}, each the best held-out {s.metric} of one "
            "distill run, gathered by stage=scaling (stage.ledger) sitting by sitting; read back by the next.",
            "setup": {"experiment": cfg.experiment.name, "model": cfg.model.name},
            "metric": s.metric,
            "acceptance": [],
        }

    def at(p: dict[str, Any]) -> tuple[str, int, int]:
        return p["method"], int(p["data_size"]), int(p["seed"])

    ledger["acceptance"] = _merged(ledger["acceptance"], [ledger_point(p, s.metric) for p in acceptance
                                                          if not p.get("prior")], at, "folder")  # fmt: skip
    measured_rows = [{**r, "evaluate": _relative(r["evaluate"])} if r.get("evaluate") else dict(r)
                     for r in rows if not r.get("prior")]  # fmt: skip
    if measured_rows or ledger.get("wall_clock"):
        ledger["wall_clock"] = _merged(ledger.get("wall_clock") or [], measured_rows, scaling_report.row_at, "evaluate")
    write_text_atomic(path, json.dumps(ledger, indent=2) + "\n")


def _merged(kept: list[dict[str, Any]], measured: list[dict[str, Any]], at, run: str) -> list[dict[str, Any]]:
    """A ledger list with each measured entry in place of the file's entry at the same ``at``. A field the file has
    and the run does not give (a note in words: the machine, the sitting) stays while it describes the same run (the
    same ``run`` folder): an entry that another run (another set, a new key) measures again starts afresh."""
    old = {at(p): p for p in kept}

    def notes(entry: dict[str, Any]) -> dict[str, Any]:
        earlier = old.get(at(entry), {})
        return earlier if earlier.get(run) == entry.get(run) else {}

    new = [{**notes(p), **p} for p in measured]
    measured_at = {at(p) for p in new}
    return sorted([p for p in kept if at(p) not in measured_at] + new, key=at)


def ledger_point(point: dict[str, Any], metric: str) -> dict[str, Any]:
    """A measured point as the ledger keeps it: the report's fields, its folder relative to the current directory
    where it lies under it (a repository's runs/), and from the run's folder (:func:`best_check`): the value on each
    held-out benchmark at the best check (``benchmarks``) and the per-slot acceptance there (``slots``), the
    trajectory set it read (``set``: the set's folder name), and the host, finish time and code version of the run.
    All of it is the run's, so a rerun writes the same point."""
    keep = ("method", "loss", "data_size", "seed", "step", "label_tokens", "value")
    out = {k: point.get(k) for k in keep}
    folder = Path(point["folder"])
    out["folder"] = _relative(folder)
    if not (folder / "manifest.json").is_file():  # a folder gone since the report: the report's fields only
        return out
    manifest = read_manifest(folder)
    out.update(best_check(folder, metric))
    key = set_key(manifest)
    if key:
        out["set"] = key
    out.update(host=manifest.host, finished=manifest.finished_at, git_sha=manifest.git_sha)
    return out
