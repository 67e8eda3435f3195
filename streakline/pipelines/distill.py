"""Stage ``distill``: fine-tune the drafter on verifier trajectories with a registered loss, on DeepSpeed.

    python launch.py stage=distill model=tiny method=streak                      # tiny world, one CPU process
    torchrun --nproc_per_node 2 launch.py stage=distill model=tiny trainer=zero2  # 2 ranks (gloo on CPU)
    python launch.py stage=distill model=diffucoder method=distillspec trainer=zero3 trainer.lora.enabled=true

Order of work (top-down):
1. the trajectories of ``stage=trajectories`` with the same verifier and data settings (refused when missing,
   incomplete, or from another tokenizer), cut into draft windows (``alignment/data.py``);
2. the drafter (``model.drafter``; a ``path`` warm-starts from any checkpoint), optionally with LoRA adapters;
3. the run folder ``<run_root>/<experiment>/distill/<hash>/``; a DeepSpeed checkpoint there means a previous run
   of the same config stopped early, and training resumes from it exactly;
4. training (``alignment/trainer.py``) with metrics to ``metrics.jsonl`` and W&B, an evaluation every
   ``trainer.eval_every`` steps (simulated streak on held-out verifier continuations, and the decoder's accepted
   streak on a few prompts), checkpoints every ``trainer.save_every`` steps;
5. the final drafter as a Hugging Face folder ``drafter/`` (LoRA merged) that ``stage=decode`` loads with
   ``model.drafter.path=<run>/drafter``, then the manifest.

Under ``torchrun`` every rank runs this module; rank 0 writes files and the manifest.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from streakline.artifacts import StageRun, config_hash, find_complete, run_dir
from streakline.config import ConfigError

from .bootstrap import attach_world

STAGE = "distill"
TEACHER_LOSSES = ("distillspec", "ar_distill")


def run(cfg: DictConfig) -> dict[str, Any]:
    from streakline.alignment.data import TrajectoryWindows
    from streakline.alignment.losses import LossSettings
    from streakline.alignment.strategy import DeepSpeedStrategy
    from streakline.alignment.tracking import Tracker, experiment_project
    from streakline.alignment.trainer import DraftTrainModule, Trainer
    from streakline.data.trajectories import TrajectoryError, load_trajectories
    from streakline.models import build
    from streakline.models.tokenizer import tokenizer_hash

    from .decode import role_tokenizer
    from .trajectories import trajectories_dir

    if cfg.method.loss == "mdm":
        raise ConfigError("method=mdm is the pretraining objective (stage=bootstrap); distill with streak, ce_streak, "
                          "expce, distillspec or ar_distill")  # fmt: skip
    attach_world(cfg)
    folder = trajectories_dir(cfg)
    gamma = cfg.method.gamma or cfg.model.drafter.gamma
    key = run_key(cfg, folder, gamma)
    out = run_dir(cfg.run_root, cfg.experiment.name, STAGE, config_hash(key))
    done = find_complete(cfg.run_root, cfg.experiment.name, STAGE, config_hash(key))
    if done is not None:
        print(f"distill: already trained with these settings: {done / 'drafter'}")
        return {"folder": str(done), "drafter": str(done / "drafter"), "metrics": {}, "resumed_from": None}
    strategy = DeepSpeedStrategy(cfg.trainer, seed=cfg.seed)
    tokenizer = role_tokenizer(cfg, "drafter")
    try:
        dataset = load_trajectories(folder, tokenizer_hash=tokenizer_hash(tokenizer) if tokenizer else None)
    except TrajectoryError as e:
        raise ConfigError(f"{e}\n(the trajectories for these settings are made by: python launch.py "
                          f"stage=trajectories with the same model and data options)") from e  # fmt: skip
    if cfg.method.onpolicy_mix > 0 and (cfg.method.loss not in TEACHER_LOSSES or cfg.method.teacher != "online"):
        raise ConfigError(
            "method.onpolicy_mix > 0 drafts labels with the drafter and needs the verifier to score them: use it with "
            "method=distillspec (or ar_distill) and method.teacher=online"
        )
    stored_teacher = cfg.method.loss in TEACHER_LOSSES and cfg.method.teacher == "stored"
    if stored_teacher and "topk_logprobs" not in dataset.column_names:
        raise ConfigError(
            f"method={cfg.method.name} reads the verifier's stored top-k log-probs, which these trajectories lack: "
            "make them with data.topk_logprobs=8 (stage=trajectories and this stage), or use method.teacher=online"
        )
    drafter = build(cfg.model.drafter, "drafter").train()
    mask_id = drafter.config.mask_token_id
    if mask_id is None:
        raise ConfigError("the drafter has no mask token; set model.drafter.mask_token")
    if cfg.trainer.lora.enabled:
        drafter = _with_lora(drafter, cfg.trainer.lora)
    drafter.gradient_checkpointing = cfg.trainer.activation_checkpointing
    verifier = None
    if cfg.method.loss in TEACHER_LOSSES and not stored_teacher:
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
    module = DraftTrainModule(
        drafter,
        LossSettings.from_config(cfg.method),
        mask_id=mask_id,
        temperature=cfg.method.drafter_temperature,
        verifier=verifier,
        onpolicy_mix=cfg.method.onpolicy_mix,
    )
    engine = strategy.setup(module)
    main = strategy.is_main
    tracker = Tracker(
        out / "metrics.jsonl",
        project=experiment_project(cfg.trainer.wandb_project, cfg.experiment.name),
        run_id=f"distill-{config_hash(key)}",
        config=OmegaConf.to_container(cfg, resolve=True),
        enabled=main,
        name=f"{cfg.experiment.name}/{cfg.method.name}",
        group="distill",
        job_type=cfg.method.name,
    )
    evaluator = Evaluator(cfg, tokenizer, gamma, mask_id, strategy.device, verifier=verifier) if main else None

    def export(step: int, state: dict[str, torch.Tensor]) -> Path:
        model = _unwrap(state, cfg, drafter_config=module.drafter.config)
        from streakline.models import save_pretrained

        target = save_pretrained(model, out / "checkpoints" / f"step-{step:06d}", tokenizer=tokenizer)
        if evaluator is not None and cfg.trainer.zero_stage == 3:
            result = evaluator(step, model)
            if result:
                tracker.log(result, step=step)
        return target

    def evaluate(step: int) -> dict[str, Any] | None:
        if evaluator is None or cfg.trainer.zero_stage == 3:  # ZeRO-3 evaluates the exported checkpoints instead
            return None
        return evaluator(step, _plain_drafter(module.drafter))

    trainer = Trainer(strategy, engine, windows, cfg.trainer, out, tracker, evaluate=evaluate, export=export)
    ctx = StageRun(cfg.run_root, cfg.experiment.name, STAGE, key) if main else contextlib.nullcontext()
    try:
        with ctx as stage_run:
            start = trainer.resume()
            last = trainer.fit(start_step=start)
            strategy.barrier()
            if main:
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
    if main:
        print(
            f"distill: drafter written to {out / 'drafter'}\n"
            f"  decode with it: python launch.py stage=decode model={cfg.model.name} decoder=diffusion_draft "
            f"model.drafter.path={out / 'drafter'} 'prompt=\"...\"'"
        )
    return {"folder": str(out), "drafter": str(out / "drafter"), "metrics": last, "resumed_from": start}


def run_key(cfg: DictConfig, trajectories: Path, gamma: int) -> dict[str, Any]:
    """What the trained drafter depends on; logging and evaluation cadence do not move the folder."""
    trainer = OmegaConf.to_container(cfg.trainer, resolve=True)
    for k in ("save_every", "eval_every", "log_every", "wandb_project", "eval_sources", "eval_prompts"):
        trainer.pop(k, None)
    drafter = cfg.model.drafter
    return {
        "drafter": drafter.path or drafter.hub_id,
        "trajectories": str(trajectories),
        "gamma": gamma,
        "method": OmegaConf.to_container(cfg.method, resolve=True),
        "trainer": trainer,
        "seed": cfg.seed,
    }


def _with_lora(drafter, lora_cfg):
    import peft

    config = peft.LoraConfig(
        r=lora_cfg.r, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout, target_modules=list(lora_cfg.targets)
    )
    wrapped = peft.get_peft_model(drafter, config)
    base = wrapped.get_base_model()  # the same Transformer, adapters injected in place, base weights frozen
    base._peft_wrapper = [wrapped]  # a list, so not a submodule: merging on export goes through the wrapper
    return base


def _plain_drafter(drafter):
    """The drafter itself, or for a LoRA-adapted one a copy with the adapters merged into the weights."""
    import copy

    if not hasattr(drafter, "_peft_wrapper"):
        return drafter
    return copy.deepcopy(drafter._peft_wrapper[0]).merge_and_unload()


def _unwrap(state: dict[str, torch.Tensor], cfg: DictConfig, drafter_config):
    """A plain Transformer from a full training-module state dict (``drafter.`` prefix; LoRA merged)."""
    from streakline.models import Transformer

    state = {k.removeprefix("drafter."): v for k, v in state.items()}
    model = Transformer(drafter_config)
    if cfg.trainer.lora.enabled:
        model = _with_lora(model, cfg.trainer.lora)
        model.load_state_dict(state)
        return _plain_drafter(model)
    model.load_state_dict(state)
    return model


class Evaluator:
    """Held-out checks on rank 0: simulated streak against verifier continuations, and the real decoder's streak."""

    def __init__(self, cfg: DictConfig, tokenizer, gamma: int, mask_id: int, device, verifier=None) -> None:
        """``verifier``: the frozen verifier when the run already holds one (online teacher); built otherwise."""
        from streakline.data import load_benchmark
        from streakline.data.benchmarks import BenchmarkError, parse_source, prompt_text
        from streakline.decoding.vanilla import greedy_generate
        from streakline.models import build

        self.gamma, self.mask_id = gamma, mask_id
        self.pairs: dict[str, list[tuple[list[int], list[int]]]] = {}
        if not cfg.trainer.eval_prompts or not cfg.trainer.eval_sources or tokenizer is None:
            return
        self.verifier = (
            verifier if verifier is not None else build(cfg.model.verifier, "verifier", device=device).eval()
        )
        eos = tokenizer.eos_token_id
        for source in cfg.trainer.eval_sources:
            name, path = parse_source(source)
            try:
                records = load_benchmark(name, path=path, limit=cfg.trainer.eval_prompts)
            except BenchmarkError as e:
                print(f"distill: no held-out evaluation on {name}: {e}")
                continue
            prompts = [tokenizer(prompt_text(r), add_special_tokens=False)["input_ids"] for r in records]
            completions = greedy_generate(self.verifier, prompts, 4 * gamma, eos_token_id=eos)
            self.pairs[name] = list(zip(prompts, completions, strict=True))

    @torch.no_grad()
    def __call__(self, step: int, drafter) -> dict[str, Any]:
        from streakline.alignment.streak import simulated_streak
        from streakline.decoding.drafters import DiffusionDrafter
        from streakline.decoding.speculative import SpecConfig, generate

        if not self.pairs:
            return {}
        was_training = drafter.training
        drafter.eval()
        out: dict[str, Any] = {}
        for name, pairs in self.pairs.items():
            s = simulated_streak(drafter, pairs, self.gamma, self.mask_id, verifier=self.verifier)
            out[f"eval/{name}/sim_streak"] = s["mean_streak"]
            out[f"eval/{name}/soft_streak"] = s["mean_soft_streak"]
            out[f"eval/{name}/alpha"] = s["alpha"]
            prompts = [p for p, _ in pairs[:4]]
            res = generate(
                self.verifier,
                prompts,
                SpecConfig(max_new_tokens=2 * self.gamma, gamma=self.gamma),
                drafter=DiffusionDrafter(drafter, temperature=0.0),
            )
            out[f"eval/{name}/decoder_streak"] = res.metrics.accepted_per_cycle
        drafter.train(was_training)
        return out
