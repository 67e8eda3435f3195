"""Stage ``trajectories``: sample verifier completions for a prompt mix and store them as resumable parquet shards.

    python launch.py stage=trajectories model=tiny                       # single process
    python launch.py stage=trajectories model=tiny launcher=ray          # local Ray, 2 CPU worker slots
    python launch.py stage=trajectories model=qwen2.5-72b data=... launcher=ray launcher.ray_address=auto \\
        data.backend=vllm data.topk_logprobs=20

Order of work (top-down):
1. the prompt mix: ``data.prompt_sources`` (benchmarks or ``name@file``) weighted by ``data.mix_weights`` up to
   ``data.max_prompts``, each prompt ``data.samples_per_prompt`` times, encoded raw or through the chat template;
   a prompt too long for the verifier's positions is refused, skipped or truncated (``data.long_prompts``);
2. deterministic shards: the (prompt, sample) items cut into ``data.num_shards`` contiguous pieces, shard i sampled
   with a seed derived from ``(seed, i)``, so a shard's rows never depend on how many workers there are;
3. the run folder ``<run_root>/<experiment>/trajectories/<hash of verifier, tokenizer, data settings, seed>/``:
   shards already there and valid are kept, missing or damaged ones are (re)generated, an estimate of rows and
   bytes is printed first (with ``data.feature_layers``, the verifier features' size too, refused in ``check`` past
   ``data.max_feature_gb``);
4. generation, in process (``launcher=local``) or on Ray actors (``launcher=ray``; one per GPU, or
   ``launcher.workers`` CPU slots), each shard written atomically as it finishes, a progress bar with tokens/s;
   with ``data.feature_layers`` each finished row also goes through one no-grad verifier forward whose layer states
   are written beside the shard (``features-*.safetensors``, float16; what ``method.features=stored`` trains on);
5. every shard validated together (``data.trajectories.load_trajectories``); the runner writes the manifest last.
   A complete run is reused as is unless a shard has been damaged since (then only that shard is regenerated).

``stage=distill`` finds the folder with ``common.lookup.trajectories_dir(cfg)``. Fault injection for the tests
(environment): ``STREAKLINE_FAULT_WORKER_EXIT=<marker file>`` makes the first worker to finish a shard die before
writing it (once: it creates the marker); ``STREAKLINE_FAULT_EXIT_AFTER_SHARDS=n`` ends the whole process after n
shards.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from streakline.artifacts import StageRun, config_hash
from streakline.config import ConfigError
from streakline.data.benchmarks import parse_source
from streakline.data.features import FeatureMeta, check_features, feature_bytes, feature_name, write_features
from streakline.data.files import bad_lines
from streakline.data.mix import interleave, mix_counts
from streakline.data.self_chat import SELF_CHAT
from streakline.data.sources import load_source, prompt_for, source_label
from streakline.data.trajectories import (
    ShardMeta,
    check_shard,
    estimate,
    format_bytes,
    load_trajectories,
    shard_name,
    write_shard,
)

from .common.lookup import data_seed, frozen_dtype, trajectories_key
from .common.prompts import evaluation_sources
from .common.roles import device, required_tokenizer, role_eos, role_tokenizer
from .common.self_chat import self_chat_records
from .runner import Stage, StageResult

FAULT_WORKER_EXIT = "STREAKLINE_FAULT_WORKER_EXIT"
FIXED_BATCH = 16  # data.batching=fixed with data.batch_size unset: the rows of one batch, as before auto sizes
FAULT_EXIT_AFTER = "STREAKLINE_FAULT_EXIT_AFTER_SHARDS"


class Trajectories(Stage):
    name = "trajectories"
    settings = ("data",)

    def uses(self, cfg: DictConfig) -> tuple[str, ...]:
        return ("verifier",)

    def check(self, cfg: DictConfig) -> None:
        from streakline.decoding.backends import check_backend

        check_backend(cfg.data.backend)
        if cfg.data.feature_layers:
            check_features_fit(cfg)

    def key(self, cfg: DictConfig) -> dict[str, Any]:
        from streakline.models.tokenizer import tokenizer_hash

        return trajectories_key(cfg, tokenizer_hash(required_tokenizer(cfg, "verifier", self.name)))

    def damage(self, cfg: DictConfig, folder: Path) -> str | None:
        # Shards are checked on every use: a complete run with a damaged shard regenerates just that shard.
        plan = _Plan(cfg, stage_key=self.key(cfg), folder=folder / "shards")
        return "; ".join(f"shard {s} is {p}" for s, p in plan.problems().items() if p) or None

    def run(self, cfg: DictConfig, stage_run: StageRun) -> StageResult:
        plan = _Plan(cfg, stage_key=stage_run.config, folder=stage_run.dir / "shards")
        todo = []
        for shard, problem in plan.problems().items():
            if problem is not None:
                if problem != "missing":
                    print(f"trajectories: shard {shard} is {problem}; regenerating it")
                todo.append(shard)
        print(plan.describe(todo))
        started = time.perf_counter()
        if todo:
            _generate(cfg, _job(cfg, plan.key), plan.pieces, plan.metas, todo, plan.folder)
        dataset = load_trajectories(plan.folder, tokenizer_hash=plan.key["tokenizer"])
        stage_run.add_output("shards")
        reasons = dataset["finish_reason"]
        stage_run.metrics.update(
            rows=len(dataset),
            completion_tokens=sum(len(c) for c in dataset["completion_ids"]),
            generated_shards=len(todo),
            seconds=time.perf_counter() - started,
            finish_reasons={r: reasons.count(r) for r in sorted(set(reasons))},
            **plan.fitted,
        )
        metrics = dict(stage_run.metrics)
        return StageResult(self.name, stage_run.dir, plan.folder, metrics, details={"generated_shards": todo})

    def reuse(self, cfg: DictConfig, folder: Path) -> StageResult:
        from streakline.artifacts import read_manifest

        metrics = read_manifest(folder).metrics
        return StageResult(self.name, folder, folder / "shards", metrics, details={"generated_shards": []})

    def report(self, result: StageResult) -> None:
        m = result.metrics
        print(f"trajectories: {m['rows']} rows, {m['completion_tokens']:,} completion tokens in {result.artifact}")


STAGE = Trajectories()


class _Plan:
    """The run's work: the prompt mix, its (prompt, sample) items cut into ``data.num_shards`` contiguous pieces,
    and the metadata each shard must carry; ``problems()`` says which shards in ``folder`` are not yet right."""

    def __init__(self, cfg: DictConfig, *, stage_key: dict[str, Any], folder: Path) -> None:
        self.cfg, self.key, self.folder = cfg, stage_key, folder
        tokenizer = required_tokenizer(cfg, "verifier", "trajectories")
        with bad_lines(cfg.data.skip_bad_lines) as tally:
            records = prompt_mix(cfg)
        check_overlap(cfg, records)
        self.records, self.prompts, self.fitted = fit_positions(cfg, records, encode_prompts(cfg, tokenizer, records))
        if tally.skipped:  # data.skip_bad_lines=true: the manifest says how many lines were left out
            self.fitted = {**self.fitted, "skipped_bad_lines": tally.skipped}
        samples = cfg.data.samples_per_prompt
        items = [(r["id"], s, p) for r, p in zip(self.records, self.prompts, strict=True) for s in range(samples)]
        n = min(cfg.data.num_shards, len(items))
        self.pieces = [items[i * len(items) // n : (i + 1) * len(items) // n] for i in range(n)]
        self.metas = [_meta(cfg, stage_key, i, n, len(piece)) for i, piece in enumerate(self.pieces)]
        self.hidden = verifier_hidden(cfg) if cfg.data.feature_layers else None

    def problems(self) -> dict[int, str | None]:
        """Per shard, None when it is done (its parquet shard and, with ``data.feature_layers``, its feature file),
        else the reason it is not; a shard is regenerated whole (rows and features) when either is not right."""
        out = {}
        for m in self.metas:
            problem = check_shard(self.folder / shard_name(m.shard, m.num_shards), m)
            if problem is None and self.cfg.data.feature_layers:
                wanted = _feature_meta(self.cfg, m, self.hidden)
                problem = check_features(self.folder / feature_name(m.shard, m.num_shards), wanted)
                problem = None if problem is None else f"{problem} (its verifier features)"
            out[m.shard] = problem
        return out

    def describe(self, todo: list[int]) -> str:
        cfg, n = self.cfg, len(self.pieces)
        mean_prompt = sum(len(p) for p in self.prompts) / max(1, len(self.prompts))
        est = estimate(sum(map(len, self.pieces)), mean_prompt, cfg.data.max_new_tokens, cfg.data.topk_logprobs)
        features = ""
        if cfg.data.feature_layers:
            layers, hidden = len(cfg.data.feature_layers), self.hidden
            size = format_bytes(feature_bytes(est["tokens"], layers, hidden))
            features = f" + verifier features of {layers} layers x {hidden} in float16, at most {size}"
        return (
            f"trajectories: {len(self.records)} prompts x {cfg.data.samples_per_prompt} samples = {est['rows']} rows "
            f"in {n} shards, at most {est['tokens']:,} tokens / {format_bytes(est['bytes'])}{features}; "
            f"{n - len(todo)} shards already done, generating {len(todo)} -> {self.folder}"
        )


def verifier_hidden(cfg: DictConfig) -> int:
    """The verifier's hidden size, from its config (nothing is built)."""
    from streakline.models import locate
    from streakline.models.checkpoint import read_config

    node = cfg.model.verifier
    return int(read_config(locate(node, "verifier"), node.family).hidden_size)


def check_features_fit(cfg: DictConfig) -> None:
    """Refuse ``data.feature_layers`` that cannot be stored, before any work: another backend than ``native`` (the
    features come from the project's own verifier forward), a layer id past the verifier's last, or an estimated
    size (every row at ``data.max_new_tokens``) past ``data.max_feature_gb``."""
    from streakline.models import locate
    from streakline.models.checkpoint import read_config

    data, node = cfg.data, cfg.model.verifier
    if data.backend != "native":
        raise ConfigError(
            f"data.feature_layers needs the native backend (the features come from its verifier forward), not "
            f"data.backend={data.backend}; set data.backend=native or data.feature_layers=[]"
        )
    config = read_config(locate(node, "verifier"), node.family)
    if max(data.feature_layers) > config.num_layers:
        raise ConfigError(
            f"data.feature_layers={list(data.feature_layers)}: the verifier has {config.num_layers} layers, so ids "
            f"run from 0 (the embeddings) to {config.num_layers} (the last layer's output); pick ids in that range"
        )
    records = prompt_mix(cfg)
    prompts = encode_prompts(cfg, required_tokenizer(cfg, "verifier", "trajectories"), records)
    rows = len(prompts) * data.samples_per_prompt
    tokens = data.samples_per_prompt * sum(len(p) for p in prompts) + rows * data.max_new_tokens
    size = feature_bytes(tokens, len(data.feature_layers), config.hidden_size)
    if size > data.max_feature_gb * 1e9:
        raise ConfigError(
            f"the verifier features would take up to {format_bytes(size)} ({rows} rows, {tokens:,} tokens x "
            f"{len(data.feature_layers)} layers x {config.hidden_size} x 2 B), past data.max_feature_gb="
            f"{data.max_feature_gb}; raise data.max_feature_gb, or store fewer rows (data.max_prompts) or tokens "
            "(data.max_new_tokens)"
        )


def prompt_mix(cfg: DictConfig) -> list[dict[str, str]]:
    """Records from every source, ``max_prompts`` split by ``mix_weights`` and interleaved (``data/mix.py``): each
    source read from its start, the sources in the mix's one fixed slot order, so the mix at a smaller
    ``max_prompts`` is the first records of this one and every prefix mixes the sources by their weights."""
    sources = list(cfg.data.prompt_sources)
    for source in sources:
        parse_source(source)  # a malformed entry fails before any source is read
    weights = list(cfg.data.mix_weights) or [1.0] * len(sources)
    limits: list[int | None] = [None] * len(sources)
    if cfg.data.max_prompts is not None:
        limits = mix_counts(weights, cfg.data.max_prompts)
    lists = []
    for source, limit in zip(sources, limits, strict=True):
        if parse_source(source)[0] == SELF_CHAT:  # written by the verifier, cached by content (common/self_chat.py)
            evaluation = evaluation_sources(cfg)
            lists.append(self_chat_records(cfg, limit, build=lambda: build_verifier(cfg), evaluation=evaluation))
            continue
        with bad_lines(cfg.data.skip_bad_lines):  # malformed lines refused, named, or (skip_bad_lines) left out
            got = load_source(source, limit=limit, fields=cfg.data.fields)
        if limit is not None and len(got) < limit:
            have = f"{len(got)} prompts of the {limit} its weight asks for"
            print(f"trajectories: {source_label(source)} has only {have}")
        lists.append(got)
    records = interleave(lists, weights)
    if not records:
        raise ConfigError("the prompt sources gave no prompts; check data.prompt_sources")
    return records


def check_overlap(cfg: DictConfig, records: list[dict]) -> None:
    """Refuse (before any sampling) a prompt mix that holds prompts of an evaluation set, by exact prompt hash,
    unless ``data.allow_eval_overlap``: a drafter trained on them would be measured on its training data."""
    from streakline.data.benchmarks import BenchmarkError
    from streakline.data.conversations import overlap

    if cfg.data.allow_eval_overlap:
        return
    for source, n in evaluation_sources(cfg).items():
        try:
            evaluation = load_source(source, limit=n)
        except BenchmarkError as e:  # stage=evaluate will say so; nothing to compare here
            print(f"trajectories: cannot check for overlap with evaluation set {source} here ({e})")
            continue
        shared = overlap(records, evaluation)
        if shared:
            raise ConfigError(
                f"{len(shared)} training prompts (first: {shared[0]}) are also prompts of the evaluation set "
                f"{source}: a drafter trained on them would be measured on its own training data; drop that source "
                "from data.prompt_sources, or set data.allow_eval_overlap=true to train on it anyway"
            )


def encode_prompts(cfg: DictConfig, tokenizer, records: list[dict[str, str]]) -> list[list[int]]:
    """Token ids of each record as ``data.sources.prompt_for`` renders it (the chat template when
    ``data.chat_template`` is on), the rendering evaluate and distill's held-out check use too."""
    return [
        tokenizer(prompt_for(r, tokenizer, cfg.data.chat_template), add_special_tokens=False)["input_ids"]
        for r in records
    ]


def fit_positions(cfg: DictConfig, records: list[dict], prompts: list[list[int]]) -> tuple[list, list, dict[str, int]]:
    """``(records, prompts, counts)`` with every prompt fitting the verifier's positions together with
    ``data.max_new_tokens``: a prompt that does not is refused (``data.long_prompts=error``, before any work),
    dropped (``skip``) or cut to its last tokens (``truncate``: the question and the turn to answer are at the end).
    ``counts`` says how many were skipped or truncated, for the manifest."""
    from streakline.models import locate
    from streakline.models.checkpoint import read_config

    node = cfg.model.verifier
    limit = int(read_config(locate(node, "verifier"), node.family).max_position_embeddings or 0)
    # the whole row counts, the last new token too: the feature forward and distill's teacher forward run over
    # prompt + completion (a decode alone would need one position less)
    room = limit - cfg.data.max_new_tokens
    long = [i for i, p in enumerate(prompts) if limit and len(p) > room]
    if not long:
        return records, prompts, {}
    mode, first = cfg.data.long_prompts, long[0]
    if room < 1 or mode == "error":
        raise ConfigError(
            f"{len(long)} of {len(prompts)} prompts (first: {records[first]['id']}, {len(prompts[first])} tokens) "
            f"do not fit the verifier's max_position_embeddings={limit} with data.max_new_tokens="
            f"{cfg.data.max_new_tokens}; set data.long_prompts=skip (drop them) or data.long_prompts=truncate (keep "
            f"each one's last {max(room, 0)} tokens), or lower data.max_new_tokens"
        )
    if mode == "skip":
        drop = set(long)
        kept = [i for i in range(len(prompts)) if i not in drop]
        print(f"trajectories: skipped {len(long)} of {len(prompts)} prompts longer than {room} tokens")
        return [records[i] for i in kept], [prompts[i] for i in kept], {"skipped_long_prompts": len(long)}
    print(f"trajectories: kept the last {room} tokens of {len(long)} of {len(prompts)} prompts")
    return records, [p[-room:] if len(p) > room else p for p in prompts], {"truncated_prompts": len(long)}


def shard_seed(seed: int, shard: int) -> int:
    """The seed of shard ``shard`` under ``data.batching=fixed`` (its batch i samples with this + i)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{shard}".encode()).digest()[:4], "little")


def row_seed(seed: int, prompt_id: str, sample_index: int) -> int:
    """The seed of one row under ``data.batching=continuous``: of the run's seed, the prompt and the sample only,
    so the row is the same whatever shard or batch it lands in (up to float rounding)."""
    digest = hashlib.sha256(f"{seed}:{prompt_id}:{sample_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def build_verifier(cfg: DictConfig):
    """The verifier for sampling, in the precision ``cfg.precision`` resolves to on this device (``models/
    precision.py``: bf16 where the hardware multiplies it natively, unless ``precision=fp32``)."""
    from streakline.models import build

    return build(cfg.model.verifier, "verifier", device=device(), inference=True, dtype=frozen_dtype(cfg))


def _meta(cfg: DictConfig, key: dict, shard: int, n_shards: int, rows: int) -> ShardMeta:
    return ShardMeta(
        shard=shard,
        num_shards=n_shards,
        rows=rows,
        tokenizer_hash=key["tokenizer"],
        verifier=str(key["verifier"]),
        topk=cfg.data.topk_logprobs,
        config_hash=config_hash(key),
    )


def _feature_meta(cfg: DictConfig, shard: ShardMeta, hidden: int | None = None) -> FeatureMeta:
    """What the feature file beside ``shard`` must say: its rows, the layers, the verifier's width, its config."""
    return FeatureMeta(
        shard=shard.shard,
        num_shards=shard.num_shards,
        rows=shard.rows,
        layers=tuple(cfg.data.feature_layers),
        hidden=verifier_hidden(cfg) if hidden is None else hidden,
        config_hash=shard.config_hash,
    )


def _job(cfg: DictConfig, key: dict) -> dict[str, Any]:
    """Everything a worker needs, as plain data (it crosses a process boundary)."""
    return {
        "cfg": OmegaConf.to_container(cfg, resolve=True),
        "key": key,
        "fault_worker_exit": os.environ.get(FAULT_WORKER_EXIT),
    }


def verifier_gpus(cfg) -> int:
    """GPUs one copy of the verifier takes: the devices ``model.verifier.devices`` names, else one."""
    from streakline.models.placement import resolve_devices

    devices = cfg.model.verifier.devices
    return len(resolve_devices(devices)) if devices is not None else 1


def _generate(cfg, job, pieces, metas, todo, folder) -> None:
    rows_total = sum(metas[i].rows for i in todo)
    bar = tqdm(total=rows_total, desc="trajectories", unit="row", dynamic_ncols=True)
    counts = {"tokens": 0, "shards": 0}
    started = time.perf_counter()
    exit_after = int(os.environ.get(FAULT_EXIT_AFTER, "0") or 0)

    def done(shard: int, result: dict) -> None:
        counts["tokens"] += result["tokens"]
        counts["shards"] += 1
        bar.update(result["rows"])
        bar.set_postfix(tok_s=f"{counts['tokens'] / (time.perf_counter() - started):.0f}", shards=counts["shards"])
        if exit_after and counts["shards"] >= exit_after:
            bar.close()
            print(f"trajectories: {FAULT_EXIT_AFTER}={exit_after} reached; exiting without cleanup", flush=True)
            os._exit(3)

    work = {i: (pieces[i], metas[i], str(folder)) for i in todo}
    if cfg.launcher.name == "ray":
        from streakline.launch.ray_pool import run_on_ray

        gpus = cfg.launcher.nodes * cfg.launcher.gpus_per_node
        # a verifier spread over n GPUs (model.verifier.devices; vLLM's tensor parallelism) takes n per worker
        per_worker = verifier_gpus(cfg) if gpus else 0
        workers = cfg.launcher.workers or (max(1, gpus // per_worker) if gpus else 2)
        run_on_ray(
            ShardWorker,
            (job, work),
            todo,
            workers,
            done,
            address=cfg.launcher.ray_address,
            gpus_per_worker=per_worker,
        )
    else:
        worker = ShardWorker(job, work)
        for shard in todo:
            done(shard, worker.run(shard))
    bar.close()


class ShardWorker:
    """Loads the verifier once; ``run(shard)`` samples one shard and writes it. Runs in-process or as a Ray actor."""

    def __init__(self, job: dict[str, Any], work: dict[int, tuple]) -> None:
        from streakline.decoding.backends import BACKENDS, SampleSettings
        from streakline.models import locate

        cfg = OmegaConf.create(job["cfg"])
        self.job, self.work, self.cfg, self.verifier = job, work, cfg, None
        tokenizer = role_tokenizer(cfg, "verifier")
        data = cfg.data
        settings = SampleSettings(
            max_new_tokens=data.max_new_tokens,
            temperature=data.temperature,
            top_p=data.top_p,
            topk_logprobs=data.topk_logprobs,
            batch_size=data.batch_size or FIXED_BATCH,
            eos_token_id=role_eos(cfg, "verifier", tokenizer),
        )
        self.continuous = data.backend == "native" and data.batching == "continuous"
        if data.backend == "vllm":
            # the checkpoint folder of any preset (a hub one from the local cache), its tokenizer folder, and one
            # tensor-parallel rank per GPU the verifier is given
            node = cfg.model.verifier
            folder = str(locate(node, "verifier"))
            self.backend = BACKENDS["vllm"](
                folder, settings, tokenizer, tokenizer_folder=node.tokenizer or folder,
                tensor_parallel_size=verifier_gpus(cfg),
            )  # fmt: skip
        else:
            verifier = build_verifier(cfg)
            self.verifier = verifier  # its layer states are the stored features (data.feature_layers)
            if self.continuous:
                from streakline.config.schema import AUTO_BATCH_CAP
                from streakline.decoding.batching import ContinuousSampler

                self.backend = ContinuousSampler(
                    verifier, settings, tokenizer, rows=data.batch_size, feature_layers=tuple(data.feature_layers),
                    row_cap=AUTO_BATCH_CAP.get(verifier.embed.weight.device.type, AUTO_BATCH_CAP["cpu"]),
                )  # fmt: skip
            else:
                self.backend = BACKENDS["native"](verifier, settings, tokenizer)
        self.seed = data_seed(cfg)  # data.seed, else the run's seed

    def run(self, shard: int) -> dict[str, Any]:
        items, meta, folder = self.work[shard]
        if self.continuous:  # each row its own seed: a row does not depend on its shard or its batch mates
            seeds = [row_seed(self.seed, prompt_id, sample) for prompt_id, sample, _ in items]
            samples = self.backend.sample([p for _, _, p in items], seeds)
        else:  # batch i of the shard samples with shard_seed + i
            seeds = [shard_seed(self.seed, shard)] * len(items)
            samples = self.backend.sample([p for _, _, p in items], seed=seeds[0])
        marker = self.job.get("fault_worker_exit")
        if marker and not os.path.exists(marker):
            Path(marker).write_text(f"worker died on shard {shard}\n")
            os._exit(1)  # a crash: no exception, no cleanup, the shard is not written
        rows = []
        for (prompt_id, sample_index, prompt), s, seed in zip(items, samples, seeds, strict=True):
            row = {
                "prompt_id": prompt_id,
                "sample_index": sample_index,
                "prompt_ids": prompt,
                "completion_ids": s.completion_ids,
                "finish_reason": s.finish_reason,
                "seed": seed,
            }
            if meta.topk:
                row["topk_ids"], row["topk_logprobs"] = s.topk_ids, s.topk_logprobs
            rows.append(row)
        if self.cfg.data.feature_layers:
            # before the shard: a shard on disk without its features is regenerated whole anyway (problems())
            from streakline.alignment.dflash import verifier_features

            if self.continuous:  # taken in the forwards that made the tokens
                feats = [s.extra["features"] for s in samples]
            else:  # a second pass over every finished row
                seqs = [list(r["prompt_ids"]) + list(r["completion_ids"]) for r in rows]
                layers = tuple(self.cfg.data.feature_layers)
                feats = verifier_features(
                    self.verifier, seqs, layers, batch_size=self.cfg.data.batch_size or FIXED_BATCH
                )
            write_features(folder, feats, _feature_meta(self.cfg, meta, self.verifier.config.hidden_size))
        write_shard(folder, rows, meta)
        return {"rows": len(rows), "tokens": sum(len(s.completion_ids) for s in samples)}
