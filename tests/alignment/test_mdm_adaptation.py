"""``method=mdm`` in stage=distill's train module: the masked-diffusion loss on trajectory windows, the way a drafter
cut from an AR model (model=smol) is adapted to draft a window in one forward.

    python -m pytest tests/alignment/test_mdm_adaptation.py -q
"""

import pytest
import torch
import torch.nn.functional as F

from streakline.alignment.data import unpack_windows, window_logit_index
from streakline.alignment.losses import LossSettings
from streakline.alignment.trainer import DraftTrainModule
from streakline.models import Transformer
from tests.alignment.test_trainer import MASK, _batch
from tests.models.helpers import tiny_config


def _module(shift: bool, full_share: float) -> DraftTrainModule:
    config = tiny_config("qwen2", attention="prefix_causal", mask_token_id=MASK, shift=shift)
    drafter = Transformer(config).init_weights(seed=1, std=0.1)
    return DraftTrainModule(drafter, LossSettings(name="mdm"), mask_id=MASK, mdm_full_share=full_share)


def _loss(module: DraftTrainModule, batch, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)  # the noise comes from the global generator, which checkpoints save
    return module(batch)[0].detach()


@pytest.mark.parametrize("shift", [False, True])
def test_packed_windows_and_one_row_per_window_give_the_same_partly_masked_loss(shift):
    """The packed path shows the unmasked slots through ``pack_windows(fill=)``, the one-row-per-window path (full-
    attention drafters) by writing them into each row: with the same draws both see the same inputs."""
    batch, module = _batch(), _module(shift, full_share=0.0)
    packed = _loss(module, batch, seed=3)
    module.packed = False
    rows = _loss(module, batch, seed=3)
    torch.testing.assert_close(packed, rows, rtol=1e-5, atol=1e-6)


def test_fully_masked_windows_give_the_mean_label_cross_entropy():
    """At ``mdm_full_share=1`` every window is hidden (t = 1): the loss is the mean cross-entropy of the labels over
    the valid slots, computed here from the drafter's plain all-mask forward, one row per window."""
    batch, module = _batch(), _module(False, full_share=1.0)
    got = _loss(module, batch, seed=0)
    ids, attn, prefix_len, labels, valid = unpack_windows(batch, MASK)
    with torch.no_grad():
        logits = module.drafter(ids, attention_mask=attn, prefix_len=prefix_len).float()
    index = window_logit_index(prefix_len, batch.gamma, shift=False)
    picked = logits[torch.arange(len(ids))[:, None], index]
    ce = F.cross_entropy(picked.flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)
    torch.testing.assert_close(got.detach(), ce[valid].mean(), rtol=1e-5, atol=1e-6)


def test_the_noise_is_seeded_by_the_global_generator_and_changes_the_loss():
    batch, module = _batch(), _module(False, full_share=0.0)
    a, b = _loss(module, batch, seed=1), _loss(module, batch, seed=2)
    assert float(a) != float(b)  # another draw hides other slots
    assert float(_loss(module, batch, seed=1)) == float(a)  # the same generator state: the same loss (resume)
    full = _loss(_module(False, full_share=1.0), batch, seed=1)
    assert float(full) != float(a)  # partly shown windows are another task than fully hidden ones
