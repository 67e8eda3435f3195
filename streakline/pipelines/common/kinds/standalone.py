"""The standalone drafters: one ``Transformer`` with its own embedding, head and tokenizer, decoded two ways.

- ``diffusion`` (``decoder=diffusion_draft``): a window of masks after the context, drafted in one forward.
  stage=distill trains it on those windows (``alignment.trainer.DraftTrainModule``, LoRA optional, the verifier
  built only for an online teacher) and exports every checkpoint as a drop-in copy of the drafter's own checkpoint
  folder with the weights replaced (``models.export_like``: its config.json, dtype, shard layout, tokenizer and
  remote-code files kept, provenance in ``streakline.json``), so ``transformers`` loads it like the original; one
  built from scratch (no folder) is written by ``save_pretrained``.
- ``ar`` (``decoder=ar_draft``): the same model run causally, one token a forward (a ``prefix_causal`` drafter's
  clean prefix is a causal LM). Not trained on its own: distilling a transformer drafter trains it as ``diffusion``,
  and stage=evaluate decodes the model preset's drafter both ways (``ar_draft``, ``base``).
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from streakline.alignment.trainer import DraftTrainModule
from streakline.config import ConfigError

from .base import DrafterKind, Trainee


class StandaloneKind(DrafterKind):
    """A ``Transformer`` drafter that stage=distill trains on its own windows: ``DrafterKind``'s default gamma, run
    key and (empty) checks, and the training and export above."""

    def trainee(self, cfg: DictConfig, tokenizer, *, device, run: Path, temperature: float) -> Trainee:
        from streakline import __version__
        from streakline.alignment.lora import from_training_state, with_lora
        from streakline.alignment.losses import TEACHER_LOSSES, LossSettings
        from streakline.models import build, export_like, locate, save_pretrained

        method = cfg.method
        source = locate(cfg.model.drafter, "drafter")  # the folder exports copy; None: built from scratch
        drafter = build(cfg.model.drafter, "drafter").train()
        mask_id = drafter.config.mask_token_id
        if mask_id is None:
            mask_id = _add_mask_token(cfg, drafter, tokenizer)
        if cfg.trainer.freeze_embeddings:  # the layers train; the embedding and head stay the ones it started with
            drafter.embed.weight.requires_grad_(False)
            if drafter.lm_head is not None:
                drafter.lm_head.weight.requires_grad_(False)
        if cfg.trainer.lora.enabled:
            drafter = with_lora(drafter, cfg.trainer.lora)
        drafter.gradient_checkpointing = cfg.trainer.activation_checkpointing
        verifier = None
        if method.loss in TEACHER_LOSSES and method.teacher != "stored":  # the online teacher
            verifier = build(cfg.model.verifier, "verifier", device=device).eval().requires_grad_(False)
        module = self.train_module(
            drafter,
            LossSettings.from_config(method),
            mask_id=mask_id,
            temperature=temperature,
            verifier=verifier,
            onpolicy_mix=method.onpolicy_mix,
            mdm_full_share=method.mdm_full_share,
        )
        method_record = OmegaConf.to_container(method, resolve=True)

        def export(state, target: Path, step: int):
            model = from_training_state(state, module.drafter.config, cfg.trainer.lora)  # LoRA merged
            if source is None:
                return model, save_pretrained(model, target, tokenizer=tokenizer)
            provenance = {
                "source": str(source),
                "step": step,
                "run": str(run),
                "method": method_record,
                "streakline_version": __version__,
            }
            return model, export_like(model, target, source, tokenizer=tokenizer, provenance=provenance)

        return Trainee(drafter, module, mask_id, verifier, export)


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


AR = DrafterKind("ar", decoder="ar_draft", checkpoint="transformer", tokenizer_role="drafter", row="ar_draft")
DIFFUSION = StandaloneKind(
    "diffusion",
    decoder="diffusion_draft",
    checkpoint="transformer",
    tokenizer_role="drafter",
    row="base",  # the undistilled drafter: the step 0 of every plain Fig. 7 line, whose runs start from it
    train_module=DraftTrainModule,
)
