"""Training input for block-diffusion targets (SDAR / BD3-LM style; docs/algorithms.md section 7).

Every block of L tokens is noised (some positions replaced by the mask id) and must be denoised while seeing the
*clean* earlier blocks, as at decode time, where finished blocks sit clean in the KV cache. Rather than one
forward per block, the noisy and the clean sequence go side by side in one forward with an explicit mask:

    noisy, masked, rate = noise_blocks(clean, L, mask_id, generator)
    ids, pos, mask = block_diffusion_input(clean, noisy, L)
    logits = model(ids, position_ids=pos, attn_mask=mask)[:, :T]       # denoising logits, [B, T, V]
    loss = (ce(logits, clean) * masked / rate).sum() / masked.numel()  # the 1/t-weighted masked CE

The last block may be partial (T not a multiple of L); it is simply a shorter block.
"""

from __future__ import annotations

import torch


def block_diffusion_input(
    clean: torch.Tensor, noisy: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Side-by-side input ``[noisy ; clean]``: ids ``[B, 2T]``, position ids ``[B, 2T]``, mask ``[B, 2T, 2T]``.

    clean, noisy: ``[B, T]``. Both halves carry position ids ``0 .. T-1``. A noisy token of block b sees every
    noisy token of block b and the clean tokens of blocks < b; a clean token of block b sees the clean tokens of
    blocks <= b (plain block-causal). The denoising logits are the first T positions. Position ids and mask are
    broadcast views over the batch (the mask is the same for every row); clone before writing into them.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if clean.dim() != 2 or clean.shape != noisy.shape:
        raise ValueError(f"clean and noisy must both be [B, T]; got {tuple(clean.shape)} and {tuple(noisy.shape)}")
    B, T = clean.shape
    device = clean.device
    pos = torch.arange(T, device=device)
    block = torch.div(pos, block_size, rounding_mode="floor")
    bq, bk = block[:, None], block[None, :]
    same = bq == bk
    earlier = bk < bq
    never = torch.zeros(T, T, dtype=torch.bool, device=device)
    # Rows are queries: noisy queries see [own noisy block | earlier clean blocks]; clean queries see only clean.
    mask = torch.cat([torch.cat([same, earlier], dim=1), torch.cat([never, bk <= bq], dim=1)], dim=0)
    input_ids = torch.cat([noisy.to(clean.dtype), clean], dim=1)
    position_ids = torch.cat([pos, pos]).expand(B, 2 * T)
    return input_ids, position_ids, mask.expand(B, 2 * T, 2 * T)


def noise_blocks(
    clean: torch.Tensor,
    block_size: int,
    mask_id: int,
    generator: torch.Generator | None = None,
    eps: float = 1e-3,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mask each block at its own rate: noisy ``[B, T]``, masked ``[B, T]`` bool, rate ``[B, T]`` float32.

    clean: ``[B, T]``. Per block a rate ``t ~ U(eps, 1)``; each position is masked with probability t, and the
    position with the smallest draw is always masked, so every block (the partial last one too) contributes to
    the loss. ``rate`` repeats t at every position of its block (for the 1/t loss weight). Deterministic for a
    generator's seed; random numbers are drawn on the generator's device and moved to ``clean``'s.

    Forcing one mask makes a block's expected mask fraction ``t + (1-t)^n / n`` for n positions, slightly above
    t when t is small and blocks are short; the 1/t weight follows the usual practice and ignores this.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if not 0.0 < eps < 1.0:
        raise ValueError(f"eps must be in (0, 1), got {eps}")
    if clean.dim() != 2:
        raise ValueError(f"clean must be [B, T], got shape {tuple(clean.shape)}")
    B, T = clean.shape
    n_blocks = -(-T // block_size)
    gen_device = generator.device if generator is not None else torch.device("cpu")
    t = eps + (1.0 - eps) * torch.rand(B, n_blocks, 1, generator=generator, device=gen_device)
    draw = torch.rand(B, n_blocks, block_size, generator=generator, device=gen_device)
    # Pad the partial last block with draws of 2 so they are never masked and never the block minimum.
    real = torch.arange(n_blocks * block_size, device=gen_device).reshape(n_blocks, block_size) < T
    draw = draw.masked_fill(~real, 2.0)
    masked = (draw < t) | (draw == draw.amin(dim=2, keepdim=True))
    masked = masked.reshape(B, -1)[:, :T].to(clean.device)
    rate = t.expand(B, n_blocks, block_size).reshape(B, -1)[:, :T].to(clean.device)
    noisy = clean.masked_fill(masked, mask_id)
    return noisy, masked, rate
