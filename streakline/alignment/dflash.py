"""Training DFlash drafters on the distillation windows: a ``WindowBatch`` in, a registered loss out.

A window at offset ``i`` of width G is exactly a DFlash block anchored at ``p = i - 1`` when G = block_size - 1:
the block ``[seq[p], MASK x G]`` drafts slots 1..G for positions ``i .. i + G - 1``, which are the window's labels,
and the drafter's context is the verifier's layer states of ``seq[:p]`` (every token strictly before the anchor,
as at decode time, where the anchor is the pending token). So DFlash training reads the same batches as the
diffusion drafters, stored top-k teachers included (``alignment/data.py``):

    drafter = DFlashModel(cfg).init_weights(seed=0).share(verifier)      # the verifier's embedding and head
    module = DFlashTrainModule(drafter, verifier, LossSettings(name="dflash_ce"), temperature=1.0)
    loss, metrics = module(batch)    # one verifier forward (no grad), one packed drafter forward, compute_loss

Per batch: the frozen verifier runs once over the clean rows and returns the layer states the drafter reads
(``target_layer_ids``) and, when the loss needs a teacher and the batch stores none, its logits at the slots; every
window of the batch is one block of a single packed drafter forward (``models.dflash.packed_blocks``); the hidden
states of slots 1..G of the real windows go to ``compute_loss`` with the verifier's head as the output matrix (the
drafter owns none), so no ``[N, G, V]`` drafter logits are ever built.

Offline (``method.features=stored``; docs/dflash.md, Offline features): the batch carries the verifier's layer
states that stage=trajectories stored (``WindowBatch.features``, written by ``verifier_features``), and the module
runs no verifier forward at all; the loss, the packing and the drafter forward are the same, so online and offline
training give the same loss and gradients up to the stored dtype's rounding (exactly with float32 features).

``slot_hidden`` is that forward on its own (the held-out simulated streak of ``stage=distill`` reads it through
``dflash_draft_argmax``), and ``dflash_from_state`` turns a training state dict back into a drafter to export.

Tests: ``python -m pytest tests/alignment/test_dflash_training.py -q``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from streakline.models import Transformer
from streakline.models.dflash import DFlashConfig, DFlashModel, packed_blocks
from streakline.models.draft_vocab import DraftVocab

from .data import WindowBatch
from .losses import STREAK_PRODUCT_LOSSES, TEACHER_LOSSES, LossInput, LossSettings, compute_loss
from .windows import slot_rows, window_labels


def slot_hidden(
    drafter: DFlashModel,
    verifier: Transformer,
    clean: torch.Tensor,
    offsets: torch.Tensor,
    pad_valid: torch.Tensor | None = None,
    features: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The drafter's final hidden states ``[B, W, G, H]`` (G = block_size - 1) of every window's slots, and the
    verifier's final states ``[B, T, H]``, for right-padded rows ``clean`` ``[B, T]`` (``pad_valid`` marks real
    tokens; None: all) and window offsets ``[B, W]`` (each >= 1). Window ``w`` is the block anchored at
    ``offsets[w] - 1``; its slot ``k`` drafts position ``offsets[w] + k - 1``. One verifier forward (no grad) and one
    packed drafter forward: what training reads (``DFlashTrainModule``) and the held-out simulated streak too.
    ``features`` ``[B, T, L*H]``: the verifier's layer states at ``target_layer_ids``, stored beforehand; then no
    verifier forward runs and the final states come back as None."""
    cfg = drafter.dflash
    B, T = clean.shape
    W, L = offsets.shape[1], cfg.block_size
    # Right-padded rows: the real tokens sit at positions 0 .. n-1, the positions the drafter's context rows and
    # blocks use (packed_blocks); padding is masked out of the verifier's keys and never seen by a block.
    pos = torch.arange(T, device=clean.device).expand(B, T)
    final = None
    if features is None:
        with torch.no_grad():
            final, features = verifier.hidden(
                clean,
                position_ids=pos,
                attention_mask=None if pad_valid is None else pad_valid.long(),
                aux_layers=cfg.target_layer_ids,
            )
    block_ids, block_pos, mask = packed_blocks(clean, offsets - 1, L, cfg.mask_token_id, context_valid=pad_valid)
    h = drafter.hidden(block_ids, block_pos, features=features, feature_pos=pos, attn_mask=mask)
    # slot 0 of each block holds the anchor token itself; slots 1 .. L-1 draft the window's G labels
    return final, h.view(B, W, L, -1)[:, :, 1:]


@torch.no_grad()
def dflash_draft_argmax(
    drafter: DFlashModel, verifier: Transformer, clean: torch.Tensor, offsets: torch.Tensor, mask_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(draft [K, G], labels [K, G], valid [K, G])`` for one trajectory ``clean`` ``[T]`` and window offsets
    ``[K]`` (each >= 1): the argmax of every window's block in one packed forward, as ``streak.draft_argmax`` gives
    for a diffusion drafter (what ``DFlashDrafter`` proposes at temperature 0, up to rounding: it caches the context).
    ``mask_id``: the windows' filler for labels past the end."""
    _, slots = slot_hidden(drafter, verifier, clean[None], offsets[None])
    draft = drafter.logits(slots[0]).argmax(-1)
    if drafter.draft_vocab is not None:  # draft ids -> the target ids they stand for
        draft = drafter.draft_vocab.to_target(draft)
    G = draft.shape[1]
    labels, valid = zip(*(window_labels(clean, o, G, mask_id) for o in offsets.tolist()), strict=True)
    return draft, torch.stack(labels), torch.stack(valid)


def draft_labels(
    vocab: DraftVocab, labels: torch.Tensor, valid: torch.Tensor, loss: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Window labels ``[N, G]`` (target ids) and ``valid`` as a loss over a draft vocabulary reads them
    (docs/algorithms.md, section 4): labels become draft ids, and a slot whose label lies outside the vocabulary,
    where the drafter's probability is 0, carries no term. For the losses whose weights are streak products
    (``STREAK_PRODUCT_LOSSES``) it also ends the window there, since no streak passes a token the drafter cannot
    draft: every later slot weighs 0, as a product through q = 0 gives. The other losses drop that slot alone."""
    ids = vocab.to_draft(labels)
    inside = ids >= 0
    if loss in STREAK_PRODUCT_LOSSES:
        inside = inside.long().cumprod(1).bool()
    return torch.where(inside, ids, 0), valid & inside


class DFlashTrainModule(nn.Module):
    """A DFlash drafter (the only trained part, a registered submodule) and the frozen verifier it reads (held in a
    list: not a submodule, so never trained, saved, moved or partitioned with this module) plus the loss."""

    def __init__(
        self, drafter: DFlashModel, verifier: Transformer, settings: LossSettings, *, temperature: float = 1.0
    ) -> None:
        super().__init__()
        if not isinstance(drafter, DFlashModel):
            raise ValueError("DFlashTrainModule trains a DFlash drafter (streakline.models.dflash.DFlashModel)")
        try:
            shared = (drafter.embed, drafter.output_weight)
        except RuntimeError as e:
            raise ValueError(
                "the DFlash drafter drafts with the verifier's embedding and head: call drafter.share(verifier) "
                "before building DFlashTrainModule"
            ) from e
        if shared[0] is not verifier.embed or shared[1] is not verifier.output_weight:
            raise ValueError(
                "the DFlash drafter shares another model's embedding and head than this verifier's: call "
                "drafter.share(verifier) with the verifier it is trained against"
            )
        # Frozen here, not only by the caller: the drafter embeds its blocks with the verifier's embedding, so a
        # verifier left trainable would collect gradients (and, with an optimizer over it, change) through it.
        verifier.requires_grad_(False)
        self.drafter = drafter
        self.settings, self.temperature = settings, temperature
        self._verifier = [verifier]

    def external_parameters(self) -> list:
        """What DeepSpeed must register: ``strategy.setup`` registers, under ZeRO-3, parameters this module reads
        outside their owner's forward so that the partitioned ones get gathered. The verifier's embedding and head
        are read so, but they are not this module's parameters at all (the verifier is held in a list), so DeepSpeed
        never partitions them: every rank keeps the whole verifier, like the online teacher of
        ``DraftTrainModule``, and they are never trained. A draft vocabulary's head is the drafter's own (frozen)
        and the loss reads it outside any forward of its owner: that one."""
        return [] if self.drafter.lm_head is None else [self.drafter.lm_head.weight]

    @property
    def verifier(self) -> Transformer:
        return self._verifier[0]

    def forward(self, batch: WindowBatch) -> tuple[torch.Tensor, dict[str, Any]]:
        drafter, verifier = self.drafter, self.verifier
        cfg = drafter.dflash
        G = batch.gamma
        if G != cfg.block_size - 1:
            raise ValueError(
                f"the windows are {G} slots wide but the DFlash drafter drafts block_size - 1 = {cfg.block_size - 1} "
                f"tokens a block: cut the windows with gamma={cfg.block_size - 1} (method.gamma)"
            )
        if int(batch.offsets.min()) < 1:
            raise ValueError(
                f"window offset {int(batch.offsets.min())} < 1: a DFlash block is anchored at the token before the "
                "window (offset - 1), so every window needs at least one token before it"
            )
        batch = batch.to(drafter.fc.weight.device)
        keep = batch.window_valid.flatten()
        stored = None
        if batch.features is not None:
            width = drafter.fc.weight.shape[1]  # fc maps the L*H concatenated states to one row of H
            if batch.features.shape[-1] != width:
                raise ValueError(
                    f"the stored features are {batch.features.shape[-1]} wide, the drafter reads {width} (its "
                    f"layers {list(cfg.target_layer_ids)}): store those layers (data.feature_layers)"
                )
            if self.settings.name in TEACHER_LOSSES and batch.teacher_ids is None:
                raise ValueError(
                    f"loss {self.settings.name} needs the verifier's logits, which stored features do not give: "
                    "store its top-k too (data.topk_logprobs, method.teacher=stored) or train with online features"
                )
            # the drafter's dtype: fp16 features meet fp32 (or bf16) layers, as the verifier's own states would
            stored = batch.features.to(drafter.fc.weight.dtype)
        final, slots = slot_hidden(drafter, verifier, batch.clean, batch.offsets, batch.pad_valid, stored)
        picked = slots.flatten(0, 1)[keep]
        teacher = {}
        if batch.teacher_ids is not None:
            teacher = {
                "teacher_ids": batch.teacher_ids.flatten(0, 1)[keep],
                "teacher_logprobs": batch.teacher_logprobs.flatten(0, 1)[keep].float(),
            }
        elif self.settings.name in TEACHER_LOSSES:
            teacher = {"teacher_logits": self._teacher_logits(final, batch, keep)}
        labels, valid = batch.labels.flatten(0, 1)[keep], batch.valid.flatten(0, 1)[keep]
        weight = drafter.output_weight
        if drafter.draft_vocab is not None:  # draft ids, and no term for a token the head cannot draft
            labels, valid = draft_labels(drafter.draft_vocab, labels, valid, self.settings.name)
            weight = drafter.lm_head.weight
        out = compute_loss(
            LossInput(
                hidden=picked, weight=weight, labels=labels, valid=valid, temperature=self.temperature, **teacher
            ),
            self.settings,
        )
        return out.loss, out.metrics

    @torch.no_grad()
    def _teacher_logits(self, final: torch.Tensor, batch: WindowBatch, keep: torch.Tensor) -> torch.Tensor:
        """``[N, G, V]`` fp32 verifier logits of the real windows' slots from its final states ``final`` ``[B, T, H]``
        over the clean rows: position ``i`` is predicted from ``i - 1``. Slots past a row's end (invalid, never
        counted) read the last column."""
        rows = slot_rows(final, batch.offsets, batch.labels.shape[-1])
        # only the real windows' rows go through the head: filler windows would cost V columns each for nothing
        return self.verifier.logits(rows[keep]).float()


@torch.no_grad()
def verifier_features(
    verifier: Transformer,
    seqs: list[list[int]],
    layers: tuple[int, ...],
    *,
    batch_size: int = 16,
    dtype: torch.dtype = torch.float16,
) -> list[np.ndarray]:
    """The verifier's layer states at ``layers`` for every token of each sequence: one ``[len(seq), L*H]`` numpy
    array (``dtype``) per sequence, from no-grad forwards over ``batch_size`` right-padded sequences at a time,
    positions 0 .. n-1 and padding masked, as ``slot_hidden`` runs the verifier online (causal attention: what
    follows a token, padding or the rest of the row, changes nothing of its state). What stage=trajectories stores
    with ``data.feature_layers`` (``data.features.write_features``)."""
    dev = verifier.embed.weight.device
    out = []
    for start in range(0, len(seqs), batch_size):
        chunk = seqs[start : start + batch_size]
        T = max(1, max(len(s) for s in chunk))
        ids = torch.zeros(len(chunk), T, dtype=torch.long)
        valid = torch.zeros(len(chunk), T, dtype=torch.long)
        for b, s in enumerate(chunk):
            ids[b, : len(s)] = torch.as_tensor(s, dtype=torch.long)
            valid[b, : len(s)] = 1
        ids, valid = ids.to(dev), valid.to(dev)
        pos = torch.arange(T, device=dev).expand(len(chunk), T)
        _, feats = verifier.hidden(ids, position_ids=pos, attention_mask=valid, aux_layers=tuple(layers))
        feats = feats.to(dtype).cpu().numpy()
        out.extend(feats[b, : len(s)] for b, s in enumerate(chunk))
    return out


def dflash_from_state(
    state: dict[str, torch.Tensor], cfg: DFlashConfig, vocab: DraftVocab | None = None
) -> DFlashModel:
    """A DFlash drafter from the full state dict of a ``DFlashTrainModule`` (``drafter.`` prefix; the verifier is no
    submodule, so nothing else is in it), not shared with any verifier yet (``save_dflash`` needs no sharing).
    ``vocab``: the trained drafter's draft vocabulary (its head is in ``state``; the maps are not)."""
    model = DFlashModel(cfg)
    model.load_state_dict({k.removeprefix("drafter."): v for k, v in state.items()})
    model.draft_vocab = vocab
    return model
