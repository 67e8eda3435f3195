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
   ``stage=decode`` loads with ``model.drafter.path=<run>/drafter``; the runner writes the manifest last. Every
   export is a copy of the drafter's checkpoint folder with only the weights replaced (``export_like``: its
   config.json, dtype, shard layout and extra files kept, provenance in ``streakline.json``), so ``transformers``
   loads it like the original.

A DFlash drafter (``model.drafter=micro-dflash``, or a path to a DFlash export; docs/dflash.md) trains on the same
windows, cut ``block_size - 1`` wide with its own mask token (``method.gamma`` may only repeat that width), through
``DFlashTrainModule``: the verifier is always built on the training device, since its layer states are the drafter's
input and its embedding and head the drafter's own. Exports are ``speculators`` DFlash folders (``save_dflash``,
what ``vllm serve`` reads); ``stage=decode decoder=dflash_draft`` decodes with them. One built from scratch (a preset
without a path) also keeps the weights it started from in ``init/``, which ``stage=evaluate`` decodes as the start of
the DFlash lines of Fig. 7. LoRA and on-policy labels are refused for it in ``check``.

    python launch.py stage=distill model=micro model.drafter=micro-dflash method=dflash_ce

Under ``torchrun`` every rank runs this module; rank 0 writes files and the manifest.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from streakline.alignment.losses import TEACHER_LOSSES
from streakline.artifacts import MANIFEST_NAME, ArtifactError, StageRun, read_manifest
from streakline.config import ConfigError

from .common.lookup import trajectories_dir
from .common.roles import role_tokenizer
from .runner import Stage, StageResult

# Cadence settings: when to log, evaluate, save and prune does not change the trained drafter, so it does not move
# the run.
CADENCE = (
    "save_every", "eval_every", "log_every", "wandb_project", "eval_sources", "eval_prompts", "keep_last",
    "keep_exports",
)  # fmt: skip


class Distill(Stage):
    name = "distill"
    settings = ("method", "trainer")
    ranked = True  # under torchrun every rank runs it; rank 0 writes files and the manifest

    def uses(self, cfg: DictConfig) -> tuple[str, ...]:
        return ("verifier", "drafter")

    def check(self, cfg: DictConfig) -> None:
        method = cfg.method
        if method.loss == "mdm":
            raise ConfigError("method=mdm is the pretraining objective (stage=bootstrap); distill with streak, "
                              "ce_streak, expce, dflash_ce, distillspec or ar_distill")  # fmt: skip
        dflash = _dflash(cfg)
        if dflash is not None:
            _check_dflash(cfg, dflash)
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
                f"{make}"
            )

    def key(self, cfg: DictConfig) -> dict[str, Any]:
        """What the trained drafter depends on; logging and evaluation cadence do not move the folder."""
        trainer = OmegaConf.to_container(cfg.trainer, resolve=True)
        for k in CADENCE:
            trainer.pop(k, None)
        # A run extended from another starts from that checkpoint, so the checkpoint (resolved: a run folder's
        # `latest` tag) is part of the key; unset, the key leaves it out and folders of earlier runs keep their hash.
        if trainer.pop("resume_from", None):
            trainer["resume_from"] = _resume_source(cfg)
        drafter = cfg.model.drafter
        return {
            "drafter": _dflash_key(cfg) or drafter.path or drafter.hub_id,
            "trajectories": str(trajectories_dir(cfg)),
            "gamma": _gamma(cfg),
            "method": {
                **OmegaConf.to_container(cfg.method, resolve=True),
                "drafter_temperature": train_temperature(cfg),
            },
            "trainer": trainer,
            "seed": cfg.seed,
        }

    def run(self, cfg: DictConfig, stage_run: StageRun) -> StageResult:
        from streakline import __version__
        from streakline.alignment.data import TrajectoryWindows
        from streakline.alignment.dflash import DFlashTrainModule, dflash_from_state
        from streakline.alignment.lora import from_training_state, merged, with_lora
        from streakline.alignment.losses import LossSettings
        from streakline.alignment.strategy import DeepSpeedStrategy
        from streakline.alignment.trainer import DraftTrainModule, Trainer
        from streakline.models import build, export_like, locate, save_pretrained
        from streakline.models.dflash_checkpoint import save_dflash

        out, gamma, method = stage_run.dir, _gamma(cfg), cfg.method
        dflash = _is_dflash(cfg)
        strategy = DeepSpeedStrategy(cfg.trainer, seed=cfg.seed)
        # a DFlash drafter has no tokenizer of its own: it drafts in the verifier's vocabulary
        tokenizer = role_tokenizer(cfg, "verifier" if dflash else "drafter")
        stored_teacher = method.loss in TEACHER_LOSSES and method.teacher == "stored"
        dataset = _trajectories(cfg, tokenizer, stored_teacher)

        # Exports are drop-in copies of the drafter's own checkpoint folder with the weights replaced (its config.json,
        # dtype, shard layout, tokenizer and remote-code files kept), so transformers loads them like the original;
        # a from-scratch drafter (no folder) is written by save_pretrained.
        source = locate(cfg.model.drafter, "drafter")
        verifier_identity = _verifier_identity(cfg) if dflash else {}
        verifier = None
        if dflash:  # the verifier's layer states are its input, its embedding and head its own (shared, frozen)
            # in the dtype DeepSpeed trains the drafter in: the drafter embeds its blocks with the verifier's
            # embedding and reads its head, so under bf16 an fp32 verifier would meet bf16 layers
            dtype = "bfloat16" if cfg.trainer.precision == "bf16" else None
            verifier = build(cfg.model.verifier, "verifier", dtype=dtype, device=strategy.device)
            verifier.eval().requires_grad_(False)
            drafter = build(cfg.model.drafter, "drafter", seed=cfg.seed).share(verifier).train()
            mask_id = drafter.dflash.mask_token_id
            if source is None and strategy.is_main and not (out / "init").is_dir():
                # Built from scratch, the drafter has no folder of its own: keep the weights it starts from, which
                # stage=evaluate decodes as the step 0 of the DFlash lines of Fig. 7 ("dflash:base").
                save_dflash(drafter, out / "init", **verifier_identity)
                stage_run.add_output("init")
        else:
            drafter = build(cfg.model.drafter, "drafter").train()
            mask_id = drafter.config.mask_token_id
            if mask_id is None:
                mask_id = _add_mask_token(cfg, drafter, tokenizer)
            if cfg.trainer.lora.enabled:
                drafter = with_lora(drafter, cfg.trainer.lora)
            drafter.gradient_checkpointing = cfg.trainer.activation_checkpointing
            if method.loss in TEACHER_LOSSES and not stored_teacher:
                verifier = build(cfg.model.verifier, "verifier", device=strategy.device).eval().requires_grad_(False)
        windows = TrajectoryWindows(
            dataset,
            gamma=gamma,
            mask_id=mask_id,
            stride=cfg.trainer.stride,
            windows_per_seq=cfg.trainer.windows_per_seq,
            seed=cfg.seed,
            teacher=stored_teacher,
        )
        if dflash:
            module = DFlashTrainModule(
                drafter, verifier, LossSettings.from_config(method), temperature=train_temperature(cfg)
            )
        else:
            module = DraftTrainModule(
                drafter,
                LossSettings.from_config(method),
                mask_id=mask_id,
                temperature=train_temperature(cfg),
                verifier=verifier,
                onpolicy_mix=method.onpolicy_mix,
            )
        engine = strategy.setup(module)
        tracker = _tracker(cfg, stage_run, enabled=strategy.is_main)
        evaluator = _evaluator(cfg, tokenizer, gamma, mask_id, strategy.device, verifier) if strategy.is_main else None

        method_record = OmegaConf.to_container(cfg.method, resolve=True)

        def export(step: int, state: dict[str, torch.Tensor]) -> Path:
            target = out / "checkpoints" / f"step-{step:06d}"
            if dflash:  # the speculators format (vllm serve <folder>), naming the verifier it drafts for
                model = dflash_from_state(state, module.drafter.dflash)
                folder = save_dflash(model, target, **verifier_identity)
            else:
                model = from_training_state(state, module.drafter.config, cfg.trainer.lora)
                if source is None:
                    folder = save_pretrained(model, target, tokenizer=tokenizer)
                else:
                    provenance = {
                        "source": str(source),
                        "step": step,
                        "run": str(out),
                        "method": method_record,
                        "streakline_version": __version__,
                    }
                    folder = export_like(model, target, source, tokenizer=tokenizer, provenance=provenance)
            if evaluator is not None and not strategy.live_weights_are_whole:  # ZeRO-3: evaluate the export
                result = evaluator(step, model)
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
                final = out / "drafter"
                if final.exists():
                    shutil.rmtree(final)
                shutil.copytree(trainer.last_export, final)
                stage_run.add_output("drafter")
                stage_run.add_output("metrics.jsonl")
                stage_run.metrics.update(
                    {k: v for k, v in last.items() if not isinstance(v, dict)}, steps=cfg.trainer.max_steps
                )
        finally:  # a preempted run too: W&B must close its run, or the resumed run cannot reopen the same id
            tracker.close()
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


STAGE = Distill()


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


def _add_mask_token(cfg: DictConfig, drafter, tokenizer) -> int:
    """A drafter whose tokenizer lacks the preset's mask token (an AR checkpoint turned into a diffusion drafter):
    add it, mean-initialised (``models.tokenizer.add_mask_token``); every export then carries the token and the
    grown vocabulary. ConfigError when the preset names no mask token or there is no tokenizer to add it to."""
    from streakline.models.tokenizer import add_mask_token

    token = cfg.model.drafter.mask_token
    if token is None or tokenizer is None:
        raise ConfigError(
            "the drafter has no mask token: set model.drafter.mask_token (it is added to the drafter's tokenizer "
            "when missing)" + ("" if tokenizer is not None else " and model.drafter.tokenizer")
        )
    mask_id = add_mask_token(drafter, tokenizer, token)
    print(f"distill: the drafter's tokenizer had no {token!r}; added it as id {mask_id} with a mean embedding")
    return mask_id


def _gamma(cfg: DictConfig) -> int:
    """The window width: a DFlash drafter's block size - 1 (``check`` refuses another ``method.gamma``), else
    ``method.gamma`` or the drafter preset's gamma."""
    dflash = _dflash(cfg)
    if dflash is not None:
        return dflash.block_size - 1
    return cfg.method.gamma or cfg.model.drafter.gamma


# --------------------------------------------------------------------------------------------- DFlash drafters
def _is_dflash(cfg: DictConfig) -> bool:
    """Whether the drafter is a DFlash drafter (its preset's kind, or its weights folder); reads no tokenizer."""
    from streakline.models import is_dflash

    return is_dflash(cfg.model.drafter, "drafter")


def _dflash(cfg: DictConfig):
    """The drafter's ``DFlashConfig`` (from its folder, or its preset and the verifier's tokenizer) when it is a
    DFlash drafter, else None."""
    from streakline.models import dflash_config

    return dflash_config(cfg.model.drafter, "drafter") if _is_dflash(cfg) else None


def _check_dflash(cfg: DictConfig, dflash) -> None:
    """What DFlash training cannot do, refused before any folder is made."""
    width = dflash.block_size - 1
    if cfg.method.gamma is not None and cfg.method.gamma != width:
        raise ConfigError(
            f"method.gamma={cfg.method.gamma}, but the DFlash drafter drafts blocks of {dflash.block_size} (the newest "
            f"token and {width} masks), so its windows are {width} wide: drop method.gamma or set method.gamma={width}"
        )
    if cfg.method.onpolicy_mix > 0:
        raise ConfigError(
            f"method.onpolicy_mix={cfg.method.onpolicy_mix}: on-policy labels are drafted by the diffusion drafters' "
            "training module, which DFlash training does not use; set method.onpolicy_mix=0"
        )
    if cfg.trainer.lora.enabled:
        raise ConfigError(
            "trainer.lora.enabled=true: a DFlash drafter is a few layers and trains whole (its export holds only its "
            "own layers); set trainer.lora.enabled=false"
        )


def _dflash_key(cfg: DictConfig) -> dict[str, Any] | None:
    """The run key's ``drafter`` for a DFlash drafter: its weights folder, or for one built from scratch its preset
    (shapes, layer ids, block, mask token), which a path-less plain drafter's key never needed. None otherwise."""
    node = cfg.model.drafter
    if not _is_dflash(cfg):
        return None
    if node.path or node.hub_id:
        return {"kind": "dflash", "weights": node.path or node.hub_id}
    preset = OmegaConf.to_container(node, resolve=True)
    for k in ("path", "tokenizer", "devices"):  # where it runs and reads from, not what it is
        preset.pop(k, None)
    return preset


def _verifier_identity(cfg: DictConfig) -> dict[str, str | None]:
    """``save_dflash``'s ``verifier_name`` (the verifier's hub id, else its folder) and ``verifier_architecture``
    (its config.json's, else its family's): what ``vllm serve <export>`` loads as the target."""
    import json

    from streakline.models import FAMILIES, locate

    node = cfg.model.verifier
    folder = locate(node, "verifier")
    arch = None
    if folder is not None:
        try:
            arch = (json.loads((folder / "config.json").read_text()).get("architectures") or [None])[0]
        except (OSError, ValueError):
            arch = None
    if arch is None and node.family in FAMILIES:
        arch = FAMILIES[node.family].architecture
    return {"verifier_name": node.hub_id or (str(folder) if folder else node.name), "verifier_architecture": arch}


def _decode_hint(cfg: DictConfig) -> dict[str, str]:
    """What ``report`` prints to decode with the drafter: the decoder and, for DFlash, the drafter preset."""
    if not _is_dflash(cfg):
        return {"model": cfg.model.name, "decoder": "diffusion_draft", "drafter_preset": ""}
    preset = f"model.drafter={cfg.model.drafter.name} "
    return {"model": cfg.model.name, "decoder": "dflash_draft", "drafter_preset": preset}


def _trajectories(cfg: DictConfig, tokenizer, stored_teacher: bool):
    """The trajectories of ``stage=trajectories`` with the same verifier and data settings, refused with the fix
    when missing, incomplete, from another tokenizer, or without the teacher log-probs the method reads."""
    from streakline.data.trajectories import TrajectoryError, load_trajectories
    from streakline.models.tokenizer import tokenizer_hash

    try:
        dataset = load_trajectories(
            trajectories_dir(cfg), tokenizer_hash=tokenizer_hash(tokenizer) if tokenizer else None
        )
    except TrajectoryError as e:
        raise ConfigError(f"{e}\n(the trajectories for these settings are made by: python launch.py "
                          f"stage=trajectories with the same model and data options)") from e  # fmt: skip
    if stored_teacher and "topk_logprobs" not in dataset.column_names:
        raise ConfigError(
            f"method={cfg.method.name} reads the verifier's stored top-k log-probs, which these trajectories lack: "
            "make them with data.topk_logprobs=8 (stage=trajectories and this stage), or use method.teacher=online"
        )
    return dataset


def _tracker(cfg: DictConfig, stage_run: StageRun, enabled: bool):
    from streakline.alignment.tracking import Tracker, experiment_project

    return Tracker(
        stage_run.dir / "metrics.jsonl",
        project=experiment_project(cfg.trainer.wandb_project, cfg.experiment.name),
        run_id=f"distill-{stage_run.cfg_hash}",
        config=OmegaConf.to_container(cfg, resolve=True),
        enabled=enabled,
        name=f"{cfg.experiment.name}/{cfg.method.name}",
        group="distill",
        job_type=cfg.method.name,
    )


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
        verifier, tokenizer, list(t.eval_sources), t.eval_prompts, gamma, mask_id, chat_template=cfg.data.chat_template
    )
