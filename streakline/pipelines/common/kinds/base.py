"""What one kind of drafter is (``DrafterKind``) and what stage=distill gets from a kind it trains (``Trainee``).

The entries themselves are in ``standalone.py`` and ``dflash.py``; ``__init__.py`` registers them. Tests:
``python -m pytest tests/test_registries.py tests/pipelines/test_distill.py tests/pipelines/test_dflash_pipeline.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from streakline.config import ConfigError


@dataclass
class Trainee:
    """What ``DrafterKind.trainee`` builds for stage=distill: the model it trains, the train module around it and
    how the run exports it."""

    drafter: nn.Module  # the model being trained (a LoRA-adapted Transformer, a DFlashModel shared with the verifier)
    module: nn.Module  # the alignment train module (drafter + loss) that DeepSpeed wraps
    mask_id: int  # fills the windows' draft slots
    verifier: nn.Module | None  # frozen, on the training device, when the kind or the loss reads it; else None
    # (consolidated training state, target folder, step) -> (the exported model, the folder written)
    export: Callable[[dict[str, torch.Tensor], Path, int], tuple[nn.Module, Path]]
    # writes the weights it starts from into a folder, for a drafter that has no folder of its own to start from and
    # whose start stage=evaluate decodes (``DrafterKind.start_rows``); None: nothing to keep
    save_start: Callable[[Path], Path] | None = None


@dataclass(frozen=True)
class DrafterKind:
    """One kind of drafter: how the stages tell its drafters apart, decode them, and (when stage=distill trains it)
    build, train and export them. The hooks below are stage=distill's; their defaults are those of a drafter with
    its own checkpoint folder (or a from-scratch preset) and window width (``standalone.py``)."""

    name: str  # the key of decoding.drafters.DRAFTERS whose drafter class decodes it
    decoder: str  # the speculative decoder that runs it: DECODER_SPECS[decoder].drafter == name
    # How its presets and folders are told apart: the checkpoint kind they build (models.checkpoint_kind: a preset's
    # ``kind``, or its folder's format), the model class's ``kind`` (models.CHECKPOINT_KINDS)
    checkpoint: str
    tokenizer_role: str  # whose tokenizer it drafts in: "drafter", or "verifier" (it shares the verifier's vocabulary)
    row: str  # stage=evaluate's name for the row of the model preset's drafter decoded as this kind
    # the alignment train module stage=distill trains it with; None: distill does not train this kind (of the kinds
    # decoding one checkpoint kind, exactly one trains: that is the kind a preset or an export is)
    train_module: type[nn.Module] | None = None
    # stage=evaluate decodes the weights its distill runs started from as the step 0 of their Fig. 7 lines
    # (``<kind>:base``): a drafter built from scratch starts from a seeded initialisation no preset row decodes
    start_rows: bool = False

    @property
    def trains(self) -> bool:
        return self.train_module is not None

    # ------------------------------------------------------------------------------------------ stage=distill
    def check(self, cfg: DictConfig) -> None:
        """What training this kind cannot do with ``cfg``, refused before any folder is made (ConfigError)."""

    def gamma(self, cfg: DictConfig) -> int:
        """The window width: ``method.gamma``, else the drafter preset's gamma."""
        return cfg.method.gamma or cfg.model.drafter.gamma

    def run_key(self, cfg: DictConfig) -> Any:
        """The run key's ``drafter``: the folder (or hub id) the drafter starts from."""
        return cfg.model.drafter.path or cfg.model.drafter.hub_id

    def trainee(self, cfg: DictConfig, tokenizer, *, device, run: Path, temperature: float) -> Trainee:
        """The drafter built for training (on the CPU; DeepSpeed places it), its train module at the loss
        ``temperature``, and how the run in folder ``run`` exports it. ``tokenizer``: the ``tokenizer_role``'s."""
        raise ConfigError(f"stage=distill does not train {self.name} drafters (decoder={self.decoder} runs them)")

    def decode_overrides(self, cfg: DictConfig) -> str:
        """What the decode command of a run's export adds to ``model.drafter.path=<export>`` (stage=distill prints
        it), each override followed by a space; empty when the model preset's drafter reads the export as is."""
        return ""
