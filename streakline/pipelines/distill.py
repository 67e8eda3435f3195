"""Stage ``distill``: fine-tune the drafter on verifier trajectories with a registered loss, on DeepSpeed.

    python launch.py stage=distill model=tiny method=streak                      # tiny world, one CPU process
    torchrun --nproc_per_node 2 launch.py stage=distill model=tiny trainer=zero2  # 2 ranks (gloo on CPU)
    python launch.py stage=distill model=diffucoder method=distillspec trainer=zero3 trainer.lora.enabled=true

Recipe (``Distill.run``, top-down; the runner has attached the world, checked the method and looked for a
complete run with the same key: drafter, trajectories folder, gamma, method, trainer settings, seed):
1. the trajectories of ``stage=trajectories`` with the same verifier and data settings (refused when missing,
   incomplete, or from another tokenizer), cut into draft windows (``alignment/data.py``);
2. the drafter (``model.drafter``; a ``path`` warm-starts from any checkpoint), optionally with LoRA adapters;
3. the run folder ``<run_root>/<experiment>/distill/<hash>/``; a DeepSpeed checkpoint there means a previous run
   of the same config stopped early, and training resumes from it exactly (``alignment/trainer.py``); without
   one, ``trainer.resume_from`` (another run's checkpoint, part of the key) starts it where that run stopped;
4. training (``alignment/trainer.py``) with metrics to ``metrics.jsonl`` and W&B, an evaluation every
   ``trainer.eval_every`` steps (simulated streak on held-out verifier continuations, and the decoder's accepted
   streak on a few prompts), checkpoints every ``trainer.save_every`` steps (the last ``trainer.keep_last``
   DeepSpeed ones kept, and ``trainer.keep_exports`` of the exports, default all);
5. the final drafter as a Hugging Face folder ``drafter/`` (LoRA merged, ``alignment/lora.py``) that
   ``stage=decode`` loads with ``model.drafter.path=<run>/drafter``: a copy of the best or last export, written
   beside it and renamed into place, so it is whole or absent; the runner writes the manifest last. Every
   export is a copy of the drafter's checkpoint folder with only the weights replaced (``export_like``: its
   config.json, dtype, shard layout and extra files kept, provenance in ``streakline.json``), so ``transformers``
   loads it like the original.

What differs between kinds of drafter is the drafter's entry in ``common.kinds.DRAFTER_KINDS``, which this recipe
dispatches on (``drafter_kind``): its refusals, window width, run key, tokenizer, how it is built and trained (steps
2 and 4) and how a checkpoint is exported. A standalone diffusion drafter trains with ``DraftTrainModule`` and exports
as above; a DFlash drafter (``model.drafter=micro-dflash``, or a path to a DFlash export; docs/dflash.md) trains on
the same windows, ``block_size - 1`` wide, through ``DFlashTrainModule`` beside the verifier whose layer states it
reads, exports ``speculators`` folders (what ``vllm serve`` reads; ``stage=decode decoder=dflash_draft``) and, built
from scratch, keeps the weights it started from in ``init/`` (the start of its Fig. 7 lines in ``stage=evaluate``).

    python launch.py stage=distill model=micro model.drafter=micro-dflash method=dflash_ce

Under ``torchrun`` every rank runs this module; rank 0 writes files and the manifest. On a GPU each rank first
compares the plan's peak with the free memory it finds and warns with the plan's fix (``trainer.plan_check``,
docs/planning.md).
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from streakline.alignment.losses import TEACHER_LOSSES
from streakline.alignment.stopping import epoch_steps, pass_steps, step_examples
from streakline.artifacts import MANIFEST_NAME, ArtifactError, StageRun, config_hash, find_complete, read_manifest
from streakline.config import ConfigError, compose_config
from streakline.faults import kill_point
from streakline.models.checkpoint import copy_folder
from streakline.world import attach_world

from .common.kinds import drafter_kind
from .common.lookup import autocast_part, training_autocast, trajectories_dir
from .common.roles import role_tokenizer
from .runner import Stage, StageResult

# trainer.train_tokens reads the set's first rows that hold that many tokens; runs before it read a seeded sample.
SUBSET_ORDER = "prefix"
LATER_TRAINER_DROPPED = ("train_tokens", "max_epochs", "max_minutes", "checks_per_epoch", "patience")  # when set
# Cadence settings: when to log, evaluate, save and prune does not change the trained drafter, so it does not move
# the run.
CADENCE = (
    "save_every", "eval_every", "log_every", "wandb_project", "eval_sources", "eval_prompts", "keep_last",
    "keep_exports", "profile", "plan_check", "eval_soft_streak",
)  # fmt: skip
# Shapes only: padding is never attended nor labelled, so it moves the drafter by float rounding alone
SHAPES = ("pad_multiple",)


class Distill(Stage):
    name = "distill"
    settings = ("method", "trainer")
    ranked = True  # under torchrun every rank runs it; rank 0 writes files and the manifest

    def uses(self, cfg: DictConfig) -> tuple[str, ...]:
        return ("verifier", "drafter")

    def prepare(self, cfg: DictConfig) -> None:
        """``trainer.init_from`` becomes the drafter's ``path`` (before the world is attached, so a role with a path
        keeps it): the key then holds that folder, as for ``model.drafter.path=<folder>``."""
        if cfg.trainer.init_from:
            folder = init_folder(cfg)
            cfg.model.drafter.path, cfg.model.drafter.hub_id = str(folder), None
            if "source" in cfg.model.drafter:
                cfg.model.drafter.source = None

    def check(self, cfg: DictConfig) -> None:
        method = cfg.method
        if method.loss == "mdm" and drafter_kind(cfg).name != "diffusion":
            raise ConfigError(
                f"method=mdm adapts a standalone diffusion drafter to masked diffusion; the {drafter_kind(cfg).name} "
                "drafter trains with dflash_ce, dpace, streak or ce_streak"
            )
        if method.gamma is not None and method.gamma > cfg.data.max_new_tokens:
            # refused before a mask of gamma^2 entries per window is allocated (method.gamma=100000 asked for TBs)
            raise ConfigError(
                f"method.gamma={method.gamma} is wider than any completion (data.max_new_tokens="
                f"{cfg.data.max_new_tokens}): the slots past that never hold a label; choose method.gamma <= "
                f"{cfg.data.max_new_tokens}, or drop it for the drafter preset's"
            )
        if cfg.trainer.init_from and cfg.trainer.resume_from:
            raise ConfigError(
                "trainer.resume_from continues a run from its checkpoint (weights included) and trainer.init_from "
                "only sets the starting weights: set one of them"
            )
        if method.features == "stored" and not hasattr(drafter_kind(cfg), "stored_features"):
            raise ConfigError(
                "method.features=stored feeds a DFlash drafter the verifier states stored with the trajectories; "
                f"the {drafter_kind(cfg).name} drafter reads none: use method.features=online"
            )
        if method.get("draft_vocab") is not None and drafter_kind(cfg).name != "dflash":
            raise ConfigError(
                f"method.draft_vocab={method.draft_vocab}: a draft vocabulary is a DFlash drafter's head of its own; "
                f"the {drafter_kind(cfg).name} drafter predicts over its whole vocabulary: drop method.draft_vocab"
            )
        drafter_kind(cfg).check(cfg)
        if method.onpolicy_mix > 0 and (method.loss not in TEACHER_LOSSES or method.teacher != "online"):
            raise ConfigError(
                "method.onpolicy_mix > 0 drafts labels with the drafter and needs the verifier to score them: use it "
                "with method=distillspec (or ar_distill) and method.teacher=online"
            )
        # Before any folder is made: a refused run must leave nothing behind (the shards themselves are checked
        # against the drafter's tokenizer when the run loads them).
        if cfg.trainer.resume_from:
            _resume_source(cfg)
        folder = trajectories_dir(cfg).parent
        make = f"python launch.py stage=trajectories model={cfg.model.name} and the same model and data options"
        if (folder / MANIFEST_NAME).is_file():
            try:
                done = read_manifest(folder)
            except ArtifactError as e:  # "not there" would send the user looking for the wrong problem
                raise ConfigError(f"the trajectories cannot be used: {e} (they are made by {make})") from e
        else:
            done = None
        if done is None or done.status != "complete":
            why = "unfinished" if done is not None else "none"
            raise ConfigError(
                f"no complete trajectories for these verifier and data settings ({why} in {folder}); make them with "
                f"{make}{_self_chat_hint(cfg)}"
            )
        if method.features == "stored":  # the trajectories are there: do they hold the drafter's layer states?
            drafter_kind(cfg).stored_features(cfg)

    def key(self, cfg: DictConfig) -> dict[str, Any]:
        """What the trained drafter depends on; logging and evaluation cadence do not move the folder."""
        from .common.fingerprints import drafter_parts

        trainer = OmegaConf.to_container(cfg.trainer, resolve=True)
        # With a plateau stop, when and on what the held-out check runs decides which weights are the drafter
        stopping = ("eval_every", "eval_sources", "eval_prompts") if trainer.get("patience") else ()
        if trainer.get("checks_per_epoch") is not None:
            stopping = tuple(k for k in stopping if k != "eval_every")  # set from checks_per_epoch, which is kept
        for k in CADENCE:
            if k not in stopping:
                trainer.pop(k, None)
        for k in LATER_TRAINER_DROPPED:  # added later: unset, earlier runs keep their folders
            if trainer.get(k) is None:
                trainer.pop(k, None)
        if trainer.get("train_tokens") is not None:  # the subset is the set's first rows (alignment/stopping.py),
            trainer["subset"] = SUBSET_ORDER  # no longer a seeded sample of them: runs of the sample keep their folders
        if trainer.get("patience") is None:
            trainer.pop("stop_metric", None)
        if not trainer.get("freeze_embeddings", True):  # added later: unset, earlier runs keep their folders
            del trainer["freeze_embeddings"]
        if not trainer.get("length_grouping"):  # added later: off (0), earlier runs keep their folders
            trainer.pop("length_grouping", None)
        # A run extended from another starts from that checkpoint, so the checkpoint (resolved: a run folder's
        # `latest` tag) is part of the key; unset, the key leaves it out and folders of earlier runs keep their hash.
        if trainer.pop("resume_from", None):
            trainer["resume_from"] = _resume_source(cfg)
        trainer.pop("init_from", None)  # prepare() made it the drafter's path, which the key holds
        for k in SHAPES:
            trainer.pop(k, None)
        trainer.pop("autocast", None)  # the setting: what it resolves to here is the key's "autocast" (below)
        kind = drafter_kind(cfg)
        return {
            "drafter": kind.run_key(cfg),
            "trajectories": str(trajectories_dir(cfg)),
            "gamma": kind.gamma(cfg),
            "method": {**method_key(cfg.method), "drafter_temperature": train_temperature(cfg)},
            "trainer": trainer,
            **autocast_part(cfg),  # bf16 autocast where the hardware has it (absent in fp32: older runs keep folders)
            "seed": cfg.seed,
            # the drafter's weights (a hub commit, a user folder's fingerprint) and a tokenizer other than the
            # trajectories': absent for presets and folders a finished stage wrote, so those keys did not move
            **drafter_parts(cfg, kind),
        }

    def run(self, cfg: DictConfig, stage_run: StageRun) -> StageResult:
        from streakline.alignment.data import TrajectoryWindows
        from streakline.alignment.lora import merged
        from streakline.alignment.strategy import DeepSpeedStrategy
        from streakline.alignment.trainer import Trainer

        kind = drafter_kind(cfg)
        out, gamma, method = stage_run.dir, kind.gamma(cfg), cfg.method
        strategy = DeepSpeedStrategy(cfg.trainer, seed=cfg.seed, autocast=training_autocast(cfg))
        planned = _plan_check(cfg, strategy) if strategy.cuda and cfg.trainer.plan_check else None
        tokenizer = role_tokenizer(cfg, kind.tokenizer_role)  # a DFlash drafter drafts in the verifier's vocabulary
        stored_teacher = method.loss in TEACHER_LOSSES and method.teacher == "stored"
        dataset = _trajectories(cfg, tokenizer, stored_teacher)

        # the drafter, the verifier when the kind or the loss reads it, the train module and how exports are written
        trainee = kind.trainee(cfg, tokenizer, device=strategy.device, run=out, temperature=train_temperature(cfg))
        if trainee.save_start is not None and strategy.is_main and not (out / "init").is_dir():
            # Built from scratch, the drafter has no folder of its own: keep the weights it starts from, which
            # stage=evaluate decodes as the step 0 of its Fig. 7 lines (DrafterKind.start_rows: "dflash:base").
            trainee.save_start(out / "init")
            stage_run.add_output("init")
        module, mask_id, verifier = trainee.module, trainee.mask_id, trainee.verifier
        # offline: the verifier's layer states come with each batch instead of from a verifier forward per step
        features = kind.stored_features(cfg) if method.features == "stored" else None
        dataset, features = _subset(cfg, dataset, features)  # trainer.train_tokens: a nested subset of the rows
        windows = TrajectoryWindows(
            dataset,
            gamma=gamma,
            mask_id=mask_id,
            stride=cfg.trainer.stride,
            windows_per_seq=cfg.trainer.windows_per_seq,
            seed=cfg.seed,
            teacher=stored_teacher,
            features=features,
            pad_multiple=cfg.trainer.pad_multiple,
            length_grouping=cfg.trainer.length_grouping,
        )
        if cfg.trainer.length_grouping and strategy.is_main:
            batch = cfg.trainer.micro_batch_size
            share, drawn = windows.real_share(batch), windows.real_share(batch, grouped=False)
            print(f"distill: trainer.length_grouping={cfg.trainer.length_grouping}: {share:.0%} of the positions a "
                  f"batch computes are real tokens ({drawn:.0%} in batches as drawn)")  # fmt: skip
        per_step = step_examples(cfg.trainer, strategy.world_size)
        steps = epoch_steps(max_steps=cfg.trainer.max_steps, max_epochs=cfg.trainer.max_epochs, examples=len(windows),
                            per_step=per_step)  # fmt: skip
        if steps != cfg.trainer.max_steps:  # the schedule and the loop follow it; the key keeps the settings
            print(f"distill: trainer.max_epochs={cfg.trainer.max_epochs:g} over {len(windows)} examples at {per_step} "
                  f"a step: {steps} steps (trainer.max_steps={cfg.trainer.max_steps} is the cap)")  # fmt: skip
            cfg.trainer.max_steps = steps
        if cfg.trainer.checks_per_epoch is not None:  # a check every 1/checks_per_epoch of a pass, whatever the size
            cfg.trainer.eval_every = max(1, pass_steps(len(windows), per_step) // cfg.trainer.checks_per_epoch)
            print(f"distill: trainer.checks_per_epoch={cfg.trainer.checks_per_epoch}: a held-out check every "
                  f"{cfg.trainer.eval_every} steps")  # fmt: skip
        engine = strategy.setup(module)
        tracker = _tracker(cfg, stage_run, enabled=strategy.is_main)
        evaluator = _evaluator(cfg, tokenizer, gamma, mask_id, strategy.device, verifier) if strategy.is_main else None

        def export(step: int, state: dict[str, torch.Tensor]) -> Path:
            model, folder = trainee.export(state, out / "checkpoints" / f"step-{step:06d}", step)
            if evaluator is not None and not strategy.live_weights_are_whole:  # ZeRO-3: evaluate the export
                # gathered on the CPU in fp32: check it where and as the live drafter runs, beside the verifier (a
                # DFlash drafter drafts through the verifier's own embedding and head)
                ref = next(evaluator.verifier.parameters())
                result = evaluator(step, model.to(device=ref.device, dtype=ref.dtype))
                if result:
                    tracker.log(result, step=step)
            return folder

        def evaluate(step: int) -> dict[str, Any] | None:
            if evaluator is None or not strategy.live_weights_are_whole:
                return None
            return evaluator(step, merged(module.drafter))

        trainer = Trainer(strategy, engine, windows, cfg.trainer, out, tracker, evaluate=evaluate, export=export)
        try:
            start = trainer.resume()
            last = trainer.fit(start_step=start)
            strategy.barrier()
            if strategy.is_main:
                kill_point("distill:trained")  # the kill harness: trained and exported, drafter/ not yet written
                # with trainer.patience the best held-out check's weights, else the last; copied beside drafter/
                # and renamed into place, so drafter/ is whole or absent (a full disk names the file and keeps
                # the export, from which a rerun copies it again)
                chosen = trainer.best_export or trainer.last_export
                copy_folder(chosen, out / "drafter", kept=f"the export it copies, {chosen}, is kept")
                stage_run.add_output("drafter")
                stage_run.add_output("metrics.jsonl")
                steps = trainer.stopped_at or cfg.trainer.max_steps
                stage_run.metrics.update({k: v for k, v in last.items() if not isinstance(v, dict)}, steps=steps)
                if planned is not None:  # the planner measured on every GPU run (docs/planning.md)
                    stage_run.metrics.update(_peak_against_plan(planned, strategy))
        finally:  # a preempted run too: W&B must close its run, or the resumed run cannot reopen the same id
            tracker.close()
            strategy.close()
        return StageResult(self.name, out, out / "drafter", last, details={"resumed_from": start, **_decode_hint(cfg)})

    def reuse(self, cfg: DictConfig, folder: Path) -> StageResult:
        return StageResult(self.name, folder, folder / "drafter", details={"resumed_from": None, **_decode_hint(cfg)})

    def report(self, result: StageResult) -> None:
        print(
            f"distill: drafter in {result.artifact}\n"
            f"  decode with it: python launch.py stage=decode model={result.details['model']} "
            f"{result.details['drafter_preset']}decoder={result.details['decoder']} "
            f"model.drafter.path={result.artifact} 'prompt=\"...\"'"
        )


# MethodConfig knobs added or redefined after distill runs existed, with the value earlier run keys recorded. A loss
# that does not read a knob keeps that value in its key, so its older runs keep their folders; the loss that reads it
# is keyed by what it now means (dflash_ce with decay_gamma unset takes the paper's value for its block, a new rule).
LATER_METHOD_DEFAULTS = {
    "decay_gamma": ("dflash_ce", 7.0),
    "dpace_alpha": ("dpace", None),
    "mdm_full_share": ("mdm", None),
}
# Knobs added later that every loss's key leaves out while they hold the value every earlier run trained with:
# online verifier features, ce_streak's unsmoothed streak weights, and the whole vocabulary.
LATER_METHOD_DROPPED_AT = {"features": "online", "streak_smoothing": 0.0, "draft_vocab": None}


def method_key(method) -> dict[str, Any]:
    """``cfg.method`` as distill's run key holds it (``LATER_METHOD_DROPPED_AT``, ``LATER_METHOD_DEFAULTS``)."""
    out = OmegaConf.to_container(method, resolve=True)
    for knob, earlier in LATER_METHOD_DROPPED_AT.items():
        if knob in out and out[knob] == earlier:
            del out[knob]
    for knob, (reader, earlier) in LATER_METHOD_DEFAULTS.items():
        if out.get("loss") == reader or knob not in out:
            continue
        if earlier is None:
            del out[knob]  # did not exist: runs of other losses never had it
        elif out[knob] is None:
            out[knob] = earlier
    return out


STAGE = Distill()


def _self_chat_hint(cfg: DictConfig) -> str:
    """What else keys trajectories with self-chat prompts: the evaluation prompts the requests keep out, which a
    stage=trajectories run without this run's held-out or evaluate settings counted differently."""
    from streakline.data.benchmarks import parse_source
    from streakline.data.self_chat import SELF_CHAT

    if not any(parse_source(s)[0] == SELF_CHAT for s in cfg.data.prompt_sources):
        return ""
    return (
        " (self-chat requests keep out every evaluation prompt, so the set also depends on trainer.eval_sources, "
        "trainer.eval_prompts and stage=evaluate's benchmarks and prompts: give stage=trajectories the same)"
    )


def train_temperature(cfg: DictConfig) -> float:
    """The drafter temperature the losses train q at: ``method.drafter_temperature``, or when it is None (the
    default) ``decoder.drafter_temperature``, the temperature the decoder drafts at. The run key holds the value."""
    tau = cfg.method.drafter_temperature
    return float(cfg.decoder.drafter_temperature if tau is None else tau)


def _resume_source(cfg: DictConfig) -> str:
    """The DeepSpeed checkpoint ``trainer.resume_from`` names, as ``<folder>/<tag>``; ConfigError naming the path
    and the fix when there is none, or when its step leaves nothing to train."""
    from streakline.alignment.trainer import find_checkpoint, tag_step

    folder, tag = find_checkpoint(cfg.trainer.resume_from)
    step = tag_step(tag)
    if step is not None and step >= cfg.trainer.max_steps:
        raise ConfigError(
            f"trainer.resume_from={cfg.trainer.resume_from} holds step {step} and trainer.max_steps="
            f"{cfg.trainer.max_steps} leaves nothing to train; set trainer.max_steps above {step}"
        )
    return str(folder / tag)


INIT_RUN = "distill:"  # trainer.init_from=distill:<overrides>: the run those overrides make


def init_folder(cfg: DictConfig) -> Path:
    """The drafter folder ``trainer.init_from`` names: a path (a distill run folder means its final ``drafter/``),
    or ``distill:<overrides>``, the final drafter of the complete distill run composed from this command's overrides
    with those in place of its own (same run root and experiment). ConfigError naming the command that makes it when
    there is no such folder or run."""
    value = str(cfg.trainer.init_from)
    if not value.startswith(INIT_RUN):
        folder = Path(value).expanduser()
        if (folder / "drafter").is_dir() and not (folder / "config.json").is_file():
            folder = folder / "drafter"  # a run folder: its final drafter
        if not (folder / "config.json").is_file():
            raise ConfigError(
                f"trainer.init_from={value} is not a drafter checkpoint folder (no config.json there): name a distill "
                "run folder, one of its checkpoints/step-* exports, or distill:<overrides> for a run of this experiment"
            )
        return folder.resolve()
    wanted = shlex.split(value[len(INIT_RUN) :])
    if not wanted:
        raise ConfigError(f"trainer.init_from={value} names no run: give its overrides, e.g. distill:method=mdm")
    overrides = _init_overrides(cfg, wanted)
    ref = compose_config(overrides)
    STAGE.prepare(ref)  # a chain: that run may start from another
    attach_world(ref, roles=STAGE.uses(ref), device="cpu")
    done = find_complete(ref.run_root, ref.experiment.name, STAGE.name, config_hash(STAGE.key(ref)))
    if done is None or not (done / "drafter").is_dir():
        make = " ".join(shlex.quote(o) for o in overrides)
        raise ConfigError(
            f"trainer.init_from={value}: that distill run has not finished; make it first with python launch.py {make}"
        )
    return (done / "drafter").resolve()


def _init_overrides(cfg: DictConfig, wanted: list[str]) -> list[str]:
    """This command's overrides with ``wanted`` in place of those it sets (and without ``trainer.init_from``)."""
    names = {o.split("=", 1)[0].lstrip("+~") for o in wanted}
    names |= {"stage", "trainer.init_from"}
    base = [o for o in cfg.overrides if o.split("=", 1)[0].lstrip("+~") not in names]
    return [*base, "stage=distill", *wanted]


def _decode_hint(cfg: DictConfig) -> dict[str, str]:
    """What ``report`` prints to decode with the drafter: its kind's decoder and what else the command needs."""
    kind = drafter_kind(cfg)
    return {"model": cfg.model.name, "decoder": kind.decoder, "drafter_preset": kind.decode_overrides(cfg)}


def _trajectories(cfg: DictConfig, tokenizer, stored_teacher: bool):
    """The trajectories of ``stage=trajectories`` with the same verifier and data settings, refused with the fix
    when missing, incomplete, from another tokenizer, or without the teacher log-probs the method reads."""
    from streakline.data.trajectories import TokenizerMismatchError, TrajectoryError, load_trajectories
    from streakline.models.tokenizer import tokenizer_hash

    try:
        dataset = load_trajectories(
            trajectories_dir(cfg), tokenizer_hash=tokenizer_hash(tokenizer) if tokenizer else None
        )
    except TokenizerMismatchError as e:  # the models disagree: no stage=trajectories run fixes that
        raise ConfigError(str(e)) from e
    except TrajectoryError as e:
        raise ConfigError(f"{e}\n(the trajectories for these settings are made by: python launch.py "
                          f"stage=trajectories with the same model and data options)") from e  # fmt: skip
    if stored_teacher and "topk_logprobs" not in dataset.column_names:
        raise ConfigError(
            f"method={cfg.method.name} reads the verifier's stored top-k log-probs, which these trajectories lack: "
            "make them with data.topk_logprobs=8 (stage=trajectories and this stage), or use method.teacher=online"
        )
    return dataset


def _subset(cfg: DictConfig, dataset, features):
    """The rows ``trainer.train_tokens`` asks for (``alignment.stopping.nested_rows``) and their stored features;
    refused with the fix when the set holds fewer completion tokens: a point would claim data it never saw."""
    want = cfg.trainer.get("train_tokens")
    if want is None:
        return dataset, features
    import pyarrow.compute as pc

    from streakline.alignment.stopping import nested_rows
    from streakline.data.features import FeatureRows

    column = dataset.select_columns(["completion_ids"]).with_format("arrow")[:]["completion_ids"]
    lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
    rows, held = nested_rows(lengths, want)
    if held < want:
        raise ConfigError(
            f"trainer.train_tokens={want} but these trajectories hold {held} completion tokens in {len(lengths)} "
            "rows: make a larger set (a higher data.max_prompts, in stage=trajectories and here) or ask for fewer"
        )
    print(f"distill: trainer.train_tokens={want}: {len(rows)} of {len(lengths)} trajectories ({held} completion "
          "tokens)")  # fmt: skip
    return dataset.select(rows), (None if features is None else FeatureRows(features, rows))


def _plan_check(cfg: DictConfig, strategy) -> int | None:
    """The plan's peak for this rank against the free memory CUDA reports on its GPU: a warning line naming the
    plan's fix on every rank that does not fit, the figures on rank 0 otherwise; training goes on either way. Returns
    the planned peak (None when the planner could not plan the run) for :func:`_peak_against_plan`."""
    from streakline.planning.free_memory import distill_start_check

    free, _ = torch.cuda.mem_get_info(strategy.device)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", torch.cuda.device_count()))  # torchrun's ranks on this node
    fits, line, planned = distill_start_check(cfg, free=free, rank=strategy.rank, world=strategy.world_size,
                                              gpus_per_node=local, device=str(strategy.device))  # fmt: skip
    if not fits or strategy.is_main:
        print(line, flush=True)
    return planned


def _peak_against_plan(planned: int, strategy) -> dict[str, float]:
    """Rank 0's measured CUDA peak beside the plan it was given at the start: printed, and returned for the run's
    metrics (``plan_peak_gib``, ``peak_allocated_gib``, ``peak_reserved_gib``, ``peak_over_plan``)."""
    from streakline.planning.free_memory import peak_against_plan

    metrics, line = peak_against_plan(planned=planned, allocated=torch.cuda.max_memory_allocated(strategy.device),
                                      reserved=torch.cuda.max_memory_reserved(strategy.device),
                                      device=str(strategy.device), rank=strategy.rank)  # fmt: skip
    print(line, flush=True)
    return metrics


def _tracker(cfg: DictConfig, stage_run: StageRun, enabled: bool):
    from streakline.alignment.tracking import stage_tracker

    # the run name carries the method: one experiment's distill runs sit together in its group
    return stage_tracker(cfg, stage_run, "distill", config=OmegaConf.to_container(cfg, resolve=True),
                         name=f"{cfg.experiment.name}/{cfg.method.name}", enabled=enabled)  # fmt: skip


def _evaluator(cfg: DictConfig, tokenizer, gamma: int, mask_id: int, device, verifier):
    """The held-out evaluator on rank 0, or None when ``trainer.eval_*`` asks for none (or there is no tokenizer to
    encode prompts with). Reuses the online teacher's verifier when the run holds one."""
    from streakline.alignment.heldout import HeldoutEvaluator
    from streakline.models import build

    t = cfg.trainer
    if not t.eval_prompts or not t.eval_sources or tokenizer is None:
        return None
    if verifier is None:
        verifier = build(cfg.model.verifier, "verifier", device=device, inference=True)
    return HeldoutEvaluator(
        verifier, tokenizer, list(t.eval_sources), t.eval_prompts, gamma, mask_id, chat_template=cfg.data.chat_template,
        soft=t.eval_soft_streak,
    )  # fmt: skip
