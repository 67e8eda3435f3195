"""The block-diffusion pretraining loss equals a per-block computation done the way the decoder sees the sequence
(clean earlier blocks, the noisy current block), for unshifted and shifted targets.
Run: ``python -m pytest tests/alignment/test_pretrain.py``."""

import pytest
import torch
import torch.nn.functional as F

from streakline.alignment.blocks import noise_blocks
from streakline.alignment.pretrain import MDM_EPS, block_diffusion_loss, mdm_window_loss
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


def _drafter_loss(model, ids, gen):
    return mdm_window_loss(model, ids, gen, width=4, windows=3, mask_id=VOCAB - 1, full_share=0.5, ar_weight=0.5)


def _target_loss(model, ids, gen):
    return block_diffusion_loss(model, ids, gen, mask_id=VOCAB - 1)


@pytest.mark.parametrize(
    ("config", "loss"),
    [(tiny_config("llama", attention="prefix_causal"), _drafter_loss), (tiny_config("sdar"), _target_loss)],
    ids=["drafter", "target"],
)
def test_a_model_on_another_device_trains_on_the_cpu_generators_draws(config, loss):
    """A world built on a GPU sees the data a CPU build sees: window offsets and noise come from the CPU generator and
    only the tensors move. ``meta`` stands in for the GPU (any device other than the generator's); the draws the loss
    takes from the generator are the same as on the CPU."""
    ids = torch.randint(0, VOCAB - 1, (2, 24), generator=torch.Generator().manual_seed(0))
    on_cpu, elsewhere = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    loss(Transformer(config).init_weights(seed=3), ids, on_cpu)
    out, accuracy = loss(Transformer(config).init_weights(seed=3).to("meta"), ids.to("meta"), elsewhere)
    assert out.device.type == accuracy.device.type == "meta"
    assert torch.equal(on_cpu.get_state(), elsewhere.get_state())
