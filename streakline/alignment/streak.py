"""Simulated accepted streak: how many drafted tokens a verifier would accept, measured without decoding.

For each window of a trajectory ``prompt ∘ completion`` the drafter proposes ``x̂ = argmax q`` for the γ slots from
the true prefix, computed as the decoder's ``DiffusionDrafter`` computes it at temperature 0 (``draft_argmax``):

  prefix_causal  all windows of a trajectory share one packed forward (docs/algorithms.md section 6); the prefix
                 never sees a window, so this gives the decoder's drafts at O(T + K*γ) tokens;
  full           the prefix attends to the mask slots, so a packed forward would change its hidden states: every
                 window gets its own forward over ``[prefix, MASK x γ]`` (C forwards for C completion tokens);
  DFlash         every window is a block ``[token before it, MASK x γ]`` after the verifier's states of the prefix:
                 one verifier forward and one packed drafter forward (``dflash.dflash_draft_argmax``; needs the
                 verifier, and γ = block_size - 1).

Two scores per window:

  exact   ``Σ_m Π_{j≤m} [x̂_j = x_j]`` against the completion's own tokens (a verifier's greedy continuation, so this
          is the streak exact-greedy verification would accept at temperature 0);
  soft    ``Σ_m Π_{j≤m} p_j(x̂_j)`` with ``p`` a verifier's probabilities (section 4's training-time metric), when a
          verifier is given: one verifier forward of the trajectory into a KV cache, then the windows packed after
          it (``_verifier_probs``), O(T + K*γ) tokens rather than K forwards of the prefix.

Per-position acceptance ``α_j`` (Figure 2) = #windows whose streak reaches j / #windows whose streak reaches j-1,
both counted only over windows whose slot j lies inside the completion: a window cut short by the end of the
completion was never tried at slot j, so it is not a rejection there.

    stats = simulated_streak(drafter, [(prompt_ids, completion_ids), ...], gamma=8, mask_id=mask)
"""

from __future__ import annotations

import torch

from streakline.models import KVCache, Transformer
from streakline.models.dflash import DFlashModel

from .dflash import dflash_draft_argmax
from .windows import pack_windows, window_input, window_labels


@torch.no_grad()
def draft_argmax(
    drafter: Transformer, clean: torch.Tensor, offsets: torch.Tensor, gamma: int, mask_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Drafter argmax for every window: ``(draft [K, γ], labels [K, γ], valid [K, γ])`` for one trajectory
    ``clean`` ``[T]`` and window offsets ``[K]``.

    The drafts are the ones ``decoding.drafters.DiffusionDrafter`` proposes at temperature 0 from ``clean[:offset]``:
    one packed forward for a ``prefix_causal`` drafter, one forward per window for a ``full`` one.
    """
    attention = drafter.config.attention
    if attention == "prefix_causal":
        packed = pack_windows(clean[None], offsets[None], gamma, mask_id, shift=drafter.config.shift)
        hidden = drafter.hidden(packed.input_ids, position_ids=packed.position_ids, attn_mask=packed.attn_mask)
        index = packed.logit_index[0].flatten()
        draft = drafter.logits(hidden[0, index]).argmax(-1).view(-1, gamma)
        return draft, packed.labels[0], packed.valid[0]
    if attention != "full":
        raise ValueError(f"a diffusion drafter attends 'full' or 'prefix_causal', this one '{attention}'")
    if drafter.config.shift and int(offsets.min()) < 1:
        raise ValueError("a shifted drafter predicts slot 1 from the token before the offset: offsets must be >= 1")
    # Full attention: the decoder's forward for each window on its own. Batching windows of different lengths would
    # need padding, which changes the floating-point result, so the drafts would no longer be the decoder's exactly.
    drafts, labels, valid = [], [], []
    for offset in offsets.tolist():
        ids, prefix = window_input(clean, offset, gamma, mask_id)
        hidden = drafter.hidden(ids[None], prefix_len=prefix)
        start = offset - 1 if drafter.config.shift else offset  # shifted: slot j is read one position to its left
        drafts.append(drafter.logits(hidden[0, start : start + gamma]).argmax(-1))
        lab, val = window_labels(clean, offset, gamma, mask_id)
        labels.append(lab)
        valid.append(val)
    return torch.stack(drafts), torch.stack(labels), torch.stack(valid)


def _streaks(accept: torch.Tensor) -> torch.Tensor:
    """``[K, γ]`` per-slot acceptance (0/1 or probabilities) -> ``[K]`` expected streak Σ_m Π_{j≤m}."""
    return accept.cumprod(dim=1).sum(dim=1)


def alpha_counts(streaks: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(accepted [γ], tried [γ])`` for ``α_j = accepted_j / tried_j`` from exact streaks ``[K]`` and ``valid``
    ``[K, γ]``: slot j (1-based) was tried by the windows whose streak reached j-1 and whose slot j is valid, and
    accepted by those whose streak reached j. Windows that end before slot j count in neither."""
    gamma = valid.shape[1]
    j = torch.arange(1, gamma + 1, device=streaks.device)
    tried = (streaks[:, None] >= j - 1) & valid
    accepted = streaks[:, None] >= j  # a streak only counts valid slots, so this implies valid
    return accepted.sum(0).cpu().double(), tried.sum(0).cpu().double()


@torch.no_grad()
def simulated_streak(
    drafter: Transformer | DFlashModel,
    trajectories: list[tuple[list[int], list[int]]],
    gamma: int,
    mask_id: int,
    verifier: Transformer | None = None,
    soft: bool = True,
) -> dict[str, float | list[float] | int]:
    """Mean simulated streak over every window of every completion (window offsets at each completion token).

    Returns ``{"mean_streak", "alpha" (γ values), "windows"}`` plus ``"mean_soft_streak"`` when ``verifier`` is
    given and ``soft`` (a DFlash drafter needs the verifier either way: its layer states are the drafter's input; the
    soft streak costs a verifier forward over every window's draft on top, most of the call on a CPU). Slots past a
    completion's end never count (a product stops at an invalid slot, and ``α_j`` leaves out the windows whose slot
    j is past the end; ``α_j`` is 0.0 when no window reached slot j).
    """
    dflash = isinstance(drafter, DFlashModel)
    if dflash and (verifier is None or gamma != drafter.dflash.block_size - 1):
        raise ValueError(
            f"a DFlash drafter's simulated streak needs the verifier (its input; got {type(verifier).__name__}) and "
            f"gamma = block_size - 1 = {drafter.dflash.block_size - 1} (got {gamma})"
        )
    device = drafter.embed.weight.device
    streaks, softs = [], []
    accepted = torch.zeros(gamma, dtype=torch.float64)
    tried = torch.zeros(gamma, dtype=torch.float64)
    for prompt, completion in trajectories:
        if not completion or not prompt:
            continue
        clean = torch.tensor(prompt + completion, device=device)
        offsets = torch.arange(len(prompt), len(prompt) + len(completion), device=device)
        if dflash:
            draft, labels, valid = dflash_draft_argmax(drafter, verifier, clean, offsets, mask_id)
        else:
            draft, labels, valid = draft_argmax(drafter, clean, offsets, gamma, mask_id)
        s = _streaks(((draft == labels) & valid).float())
        streaks.append(s)
        a, t = alpha_counts(s, valid)
        accepted += a
        tried += t
        if verifier is not None and soft:
            softs.append(_streaks(_verifier_probs(verifier, clean, offsets, draft) * valid))
    if not streaks:
        raise ValueError("no trajectory had both a prompt and a completion")
    all_streaks = torch.cat(streaks)
    alpha = [float(accepted[j] / tried[j]) if tried[j] else 0.0 for j in range(gamma)]
    out: dict[str, float | list[float] | int] = {
        "mean_streak": float(all_streaks.mean()),
        "alpha": alpha,
        "windows": int(all_streaks.numel()),
    }
    if softs:
        out["mean_soft_streak"] = float(torch.cat(softs).mean())
    return out


def _verifier_probs(
    verifier: Transformer, clean: torch.Tensor, offsets: torch.Tensor, draft: torch.Tensor, chunk: int = 64
) -> torch.Tensor:
    """``[K, γ]`` verifier probabilities ``p_j(x̂_j)`` of each window's draft given the true prefix and the draft's
    earlier slots.

    The trajectory runs once into a KV cache; then the windows, ``chunk`` at a time, run packed after it: window k's
    slots sit at positions ``offset_k + j`` and attend to ``clean[:offset_k]`` and to their own earlier slots only,
    so each gets what a causal forward over ``clean[:offset_k] ∘ x̂_k`` would give (to float rounding) at
    O(T + K*γ) tokens instead of K forwards of the whole prefix (tests/alignment/test_streak.py checks both)."""
    K, g = draft.shape
    T, dev = clean.shape[0], clean.device
    n = min(K, chunk)
    cache = KVCache.for_model(verifier, 1, capacity=T + n * g)
    try:
        hidden = verifier.hidden(clean[None], cache=cache)
        # slot 0 is predicted by the last prefix token, which is the trajectory's own (offsets >= 1: a prompt exists)
        first = verifier.logits(hidden[0, offsets - 1]).float().log_softmax(-1)
        out = [first.gather(-1, draft[:, :1]).exp()]
        slot = torch.arange(g, device=dev)
        for start in range(0, K, n):
            d, off = draft[start : start + n], offsets[start : start + n]
            m = d.shape[0]
            pos = (off[:, None] + slot).flatten()[None]
            row_window, row_slot = torch.arange(m, device=dev).repeat_interleave(g), slot.repeat(m)
            sees_prefix = torch.arange(T, device=dev)[None, :] < off[row_window][:, None]
            sees_window = (row_window[:, None] == row_window[None, :]) & (row_slot[None, :] <= row_slot[:, None])
            mask = torch.cat([sees_prefix, sees_window], dim=1)[None]
            h = verifier.hidden(d.flatten()[None], position_ids=pos, cache=cache, attn_mask=mask)
            cache.crop(T)
            # slot j >= 1 is predicted by slot j - 1 of the same window
            logp = verifier.logits(h[0].view(m, g, -1)[:, :-1]).float().log_softmax(-1)
            out.append(logp.gather(-1, d[:, 1:, None]).squeeze(-1).exp())
    finally:
        cache.release()
    return torch.cat([out[0], torch.cat(out[1:])], dim=1)  # K >= 1: the loop ran at least once
