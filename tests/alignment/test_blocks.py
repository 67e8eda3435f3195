"""Block-diffusion input: one side-by-side forward equals a direct forward per block; block noising."""

import pytest
import torch

from streakline.alignment.blocks import block_diffusion_input, noise_blocks
from streakline.models import Transformer
from tests.models.helpers import VOCAB, tiny_config

B, T, L = 2, 13, 4  # 13 = 3 full blocks + a partial block of one token
MASK = VOCAB - 1


def _model() -> Transformer:
    # std 0.2 so a wrong mask moves logits far past the 1e-5 tolerance.
    return Transformer(tiny_config("sdar", block_size=L)).init_weights(seed=7, std=0.2).eval()


def _clean(B_=B, T_=T, seed=0) -> torch.Tensor:
    return torch.randint(0, VOCAB - 1, (B_, T_), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_denoising_logits_match_direct_forward_per_block():
    model, clean = _model(), _clean()
    noisy, masked, _ = noise_blocks(clean, L, MASK, torch.Generator().manual_seed(1))
    ids, pos, mask = block_diffusion_input(clean, noisy, L)
    assert ids.shape == pos.shape == (B, 2 * T) and mask.shape == (B, 2 * T, 2 * T)
    logits = model(ids, position_ids=pos, attn_mask=mask)
    n_blocks = -(-T // L)
    assert n_blocks == 4
    for b in range(n_blocks):
        lo, hi = b * L, min((b + 1) * L, T)
        direct = model(torch.cat([clean[:, :lo], noisy[:, lo:hi]], dim=1), mode="block_causal")
        torch.testing.assert_close(logits[:, lo:hi], direct[:, lo:hi], atol=1e-5, rtol=0)
        # Teeth: the same positions read against noisy (not clean) earlier blocks differ, except for block 0.
        if b:
            wrong = model(noisy[:, :hi], mode="block_causal")
            assert (wrong[:, lo:hi] - direct[:, lo:hi]).abs().max() > 1e-3


@torch.no_grad()
def test_clean_half_is_plain_block_causal():
    model, clean = _model(), _clean(seed=2)
    noisy, _, _ = noise_blocks(clean, L, MASK, torch.Generator().manual_seed(3))
    ids, pos, mask = block_diffusion_input(clean, noisy, L)
    logits = model(ids, position_ids=pos, attn_mask=mask)
    torch.testing.assert_close(logits[:, T:], model(clean, mode="block_causal"), atol=1e-5, rtol=0)
    torch.testing.assert_close(pos[0], torch.cat([torch.arange(T), torch.arange(T)]))
    assert not mask[:, T:, :T].any()  # clean never sees noisy


def test_block_diffusion_input_rejects_bad_shapes():
    clean = _clean()
    with pytest.raises(ValueError, match="both be"):
        block_diffusion_input(clean, clean[:, :-1], L)
    with pytest.raises(ValueError, match="block_size"):
        block_diffusion_input(clean, clean, 0)


def test_noise_blocks_is_deterministic_per_seed():
    clean = _clean(B_=8, T_=29)
    a = noise_blocks(clean, L, MASK, torch.Generator().manual_seed(9))
    b = noise_blocks(clean, L, MASK, torch.Generator().manual_seed(9))
    c = noise_blocks(clean, L, MASK, torch.Generator().manual_seed(10))
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, atol=0, rtol=0)
    assert not torch.equal(a[1], c[1])


def test_noise_blocks_masks_every_block_and_repeats_the_rate():
    T_ = 29  # partial last block of one position: it must be masked every time
    clean = _clean(B_=64, T_=T_)
    noisy, masked, rate = noise_blocks(clean, L, MASK, torch.Generator().manual_seed(0), eps=1e-3)
    assert noisy.shape == masked.shape == rate.shape == (64, T_) and masked.dtype == torch.bool
    assert rate.dtype == torch.float32
    n_blocks = -(-T_ // L)
    padded = torch.nn.functional.pad(masked, (0, n_blocks * L - T_))
    assert padded.reshape(64, n_blocks, L).any(dim=2).all()
    assert masked[:, -1].all()
    torch.testing.assert_close(noisy, torch.where(masked, MASK, clean), atol=0, rtol=0)
    per_block = torch.nn.functional.pad(rate, (0, n_blocks * L - T_), value=float("nan")).reshape(64, n_blocks, L)
    for j in range(L):
        col = per_block[:, :, j]
        ok = ~col.isnan()
        torch.testing.assert_close(col[ok], per_block[:, :, 0][ok], atol=0, rtol=0)
    assert (rate >= 1e-3).all() and (rate < 1).all()


def test_mask_fraction_tracks_the_rate():
    L_ = 32
    clean = _clean(B_=2000, T_=2 * L_)
    _, masked, rate = noise_blocks(clean, L_, MASK, torch.Generator().manual_seed(4))
    frac = masked.float().reshape(-1, L_).mean(dim=1)
    t = rate.reshape(-1, L_)[:, 0]
    # Forcing one masked position adds (1-t)^n / n to the expectation; exact for n = L_ positions.
    expected = t + (1 - t) ** L_ / L_
    assert abs(float((frac - expected).mean())) < 0.005
    for lo in (0.1, 0.4, 0.7):
        sel = (t >= lo) & (t < lo + 0.2)
        assert abs(float(frac[sel].mean() - expected[sel].mean())) < 0.02
    assert torch.corrcoef(torch.stack([frac, t]))[0, 1] > 0.95
