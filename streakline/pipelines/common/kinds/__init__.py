"""The drafter kinds, one registry entry each (``DRAFTER_KINDS``): what stage=distill, decode, evaluate and sweep
dispatch on, instead of asking a model or a preset what it is.

| kind | decoder | checkpoint kind | drafts in the tokenizer of | stage=distill trains it with | exports |
|---|---|---|---|---|---|
| ``ar`` | ``ar_draft`` | ``transformer`` | the drafter | (trained as ``diffusion``) | |
| ``diffusion`` | ``diffusion_draft`` | ``transformer`` | the drafter | ``DraftTrainModule`` | ``export_like`` copies |
| ``dflash`` | ``dflash_draft`` | ``dflash`` | the verifier | ``DFlashTrainModule`` | ``speculators`` folders |

An entry (``base.DrafterKind``) says how its drafters are told apart (the checkpoint kind their presets and folders
build, ``models.checkpoint_kind``), whose tokenizer they draft in, which decoder runs them, what stage=evaluate
calls the model preset's drafter decoded as it, and for a kind stage=distill trains: its refusals, window width, run
key, how the drafter is built for training (shared with the verifier where it reads it), its train module and how a
checkpoint is exported. A checkpoint kind is decoded by every kind of it and trained as exactly one of them, which
is the kind a preset or a distill run's export "is" (``drafter_kind``). Adding a kind is one entry here (and its
drafter class and decoder in ``decoding/``); ``tests/test_registries.py`` keeps the entries and the decoders equal.

    kind = drafter_kind(cfg)                     # the model preset's drafter: diffusion or dflash
    kind = drafter_kind(cfg, "<run>/drafter")    # a distill run's export; kind.decoder decodes it
    rows = preset_rows(cfg)                      # stage=evaluate's ar_draft / base rows of the preset's drafter
"""

from __future__ import annotations

from omegaconf import DictConfig

from streakline.evaluation.methods import EvalMethod

from .base import DrafterKind, Trainee
from .dflash import DFLASH
from .standalone import AR, DIFFUSION

# In this order stage=evaluate lists the preset's rows (ar_draft, then base), and its run key holds that list.
DRAFTER_KINDS: dict[str, DrafterKind] = {k.name: k for k in (AR, DIFFUSION, DFLASH)}

__all__ = ["DRAFTER_KINDS", "DrafterKind", "Trainee", "drafter_kind", "preset_rows"]


def drafter_kind(cfg: DictConfig, drafter: str | None = None) -> DrafterKind:
    """The kind the model preset's drafter is (``drafter`` None), or a drafter checkpoint folder is (a distill run's
    export): the one kind that trains its checkpoint kind. Reads at most a folder's config.json."""
    from streakline.models import checkpoint_kind

    node = cfg.model.drafter if drafter is None else {"path": drafter}
    checkpoint = checkpoint_kind(node, "drafter")
    return next(k for k in DRAFTER_KINDS.values() if k.checkpoint == checkpoint and k.trains)


def preset_rows(cfg: DictConfig) -> list[EvalMethod]:
    """stage=evaluate's rows of the model preset's drafter, one per kind its checkpoint kind decodes as: for a
    transformer drafter ``ar_draft`` and ``base`` (step 0 of the Fig. 7 lines of the kind that trains it), for a
    DFlash one ``dflash:base`` only."""
    checkpoint = drafter_kind(cfg).checkpoint
    return [
        EvalMethod(k.row, k.decoder, steps=0 if k.trains else None)
        for k in DRAFTER_KINDS.values()
        if k.checkpoint == checkpoint
    ]
