"""The block-diffusion pretraining loss equals a per-block computation done the way the decoder sees the sequence
(clean earlier blocks, the noisy current block), for unshifted and shifted targets.
Run: ``python -m pytest tests/alignment/test_pretrain.py``."""

import pytest
import torch
import torch.nn.functional as F

from streakline.alignment.blocks import noise_blocks
from streakline.alignment.pretrain import MDM_EPS, block_diffusion_loss
from streakline.models import Transformer
from tests.models.helpers import VOCAB, tiny_config


@pytest.mark.parametrize("shift", [False, True])
def test_block_diffusion_loss_matches_per_block_forwards(shift):
    model = Transformer(tiny_config("sdar", shift=shift)).init_weights(seed=3, std=0.1).double()
    L, T = model.config.block_size, 10  # a partial last block
    ids = torch.randint(0, VOCAB - 1, (2, T), generator=torch.Generator().manual_seed(0))
    loss, _ = block_diffusion_loss(model, ids, torch.Generator().manual_seed(1), mask_id=VOCAB - 1)
    noisy, masked, rate = noise_blocks(ids, L, VOCAB - 1, torch.Generator().manual_seed(1), eps=MDM_EPS)
    total = torch.zeros((), dtype=torch.float64)
    for b in range(0, T, L):
        seq = torch.cat([ids[:, :b], noisy[:, b : b + L]], dim=1)
        logits = model(seq, mode="block_causal")
        nb = min(L, T - b)
        if shift:  # the decoder's convention: position i - 1 predicts token i (position 0: a placeholder)
            pred = logits[:, b - 1 : b - 1 + nb] if b else torch.cat([logits[:, :1], logits[:, : nb - 1]], 1)
        else:
            pred = logits[:, b : b + nb]
        n = pred.shape[1]
        ce = F.cross_entropy(pred.flatten(0, 1), ids[:, b : b + n].flatten(), reduction="none").view(2, n)
        weight = masked[:, b : b + n].double() / rate[:, b : b + n]
        if shift and b == 0:
            weight[:, 0] = 0  # the first token has no predecessor
        total += (ce * weight).sum()
    torch.testing.assert_close(loss.double(), total / ids.numel(), rtol=1e-5, atol=1e-7)  # the loss is in fp32
