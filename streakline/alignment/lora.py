"""LoRA adapters on a drafter (``trainer.lora.enabled=true``), through PEFT, and merging them back for export.

drafter = with_lora(drafter, cfg.trainer.lora)   # the same Transformer, adapters injected, base weights frozen
plain = merged(drafter)                          # a copy with the adapters folded into the weights
model = from_training_state(state, drafter_config, cfg.trainer.lora)   # a consolidated state dict -> Transformer
"""

from __future__ import annotations

import copy
from typing import Any

import torch


def with_lora(drafter, lora_cfg):
    """``drafter`` with LoRA adapters injected in place (PEFT); its base weights frozen."""
    import peft

    config = peft.LoraConfig(
        r=lora_cfg.r, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout, target_modules=list(lora_cfg.targets)
    )
    wrapped = peft.get_peft_model(drafter, config)
    base = wrapped.get_base_model()  # the same Transformer, adapters injected in place, base weights frozen
    base._peft_wrapper = [wrapped]  # a list, so not a submodule: merging on export goes through the wrapper
    return base


def merged(drafter):
    """The drafter itself, or for a LoRA-adapted one a copy with the adapters merged into the weights."""
    if not hasattr(drafter, "_peft_wrapper"):
        return drafter
    return copy.deepcopy(drafter._peft_wrapper[0]).merge_and_unload()


def from_training_state(state: dict[str, torch.Tensor], drafter_config: Any, lora_cfg=None):
    """A plain Transformer from a full training-module state dict (``drafter.`` prefix); LoRA merged when
    ``lora_cfg`` is enabled."""
    from streakline.models import Transformer

    state = {k.removeprefix("drafter."): v for k, v in state.items()}
    model = Transformer(drafter_config)
    if lora_cfg is not None and lora_cfg.enabled:
        model = with_lora(model, lora_cfg)
        model.load_state_dict(state)
        return merged(model)
    model.load_state_dict(state)
    return model
