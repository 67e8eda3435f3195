"""Simulated accepted streak: how many drafted tokens a verifier would accept, measured without decoding.

For each window of a trajectory ``prompt ∘ completion`` the drafter proposes ``x̂ = argmax q`` for the γ slots in
one forward, all windows of a trajectory packed together (docs/algorithms.md section 6). Two scores:

  exact   ``Σ_m Π_{j≤m} [x̂_j = x_j]`` against the completion's own tokens (a verifier's greedy continuation, so this
          is the streak exact-greedy verification would accept at temperature 0);
  soft    ``Σ_m Π_{j≤m} p_j(x̂_j)`` with ``p`` a verifier's probabilities (section 4's training-time metric), when a
          verifier is given.

Per-position acceptance ``α_j`` (Figure 2) = #windows whose streak reaches j / #windows whose streak reaches j-1.

    stats = simulated_streak(drafter, [(prompt_ids, completion_ids), ...], gamma=8, mask_id=mask)
"""

from __future__ import annotations

import torch

from streakline.models import Transformer

from .windows import pack_windows


@torch.no_grad()
def draft_argmax(
    drafter: Transformer, clean: torch.Tensor, offsets: torch.Tensor, gamma: int, mask_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Drafter argmax for every window: ``(draft [K, γ], labels [K, γ], valid [K, γ])`` for one trajectory
    ``clean`` ``[T]`` and window offsets ``[K]`` (all windows in one packed forward)."""
    packed = pack_windows(clean[None], offsets[None], gamma, mask_id, shift=drafter.config.shift)
    hidden = drafter.hidden(packed.input_ids, position_ids=packed.position_ids, attn_mask=packed.attn_mask)
    index = packed.logit_index[0].flatten()
    draft = drafter.logits(hidden[0, index]).argmax(-1).view(-1, gamma)
    return draft, packed.labels[0], packed.valid[0]


def _streaks(accept: torch.Tensor) -> torch.Tensor:
    """``[K, γ]`` per-slot acceptance (0/1 or probabilities) -> ``[K]`` expected streak Σ_m Π_{j≤m}."""
    return accept.cumprod(dim=1).sum(dim=1)


@torch.no_grad()
def simulated_streak(
    drafter: Transformer,
    trajectories: list[tuple[list[int], list[int]]],
    gamma: int,
    mask_id: int,
    verifier: Transformer | None = None,
) -> dict[str, float | list[float] | int]:
    """Mean simulated streak over every window of every completion (window offsets at each completion token).

    Returns ``{"mean_streak", "alpha" (γ values), "windows"}`` plus ``"mean_soft_streak"`` when ``verifier`` is
    given. Slots past a completion's end never count (a product stops at an invalid slot).
    """
    device = drafter.embed.weight.device
    streaks, soft, reach = [], [], torch.zeros(gamma + 1)
    for prompt, completion in trajectories:
        if not completion or not prompt:
            continue
        clean = torch.tensor(prompt + completion, device=device)
        offsets = torch.arange(len(prompt), len(prompt) + len(completion), device=device)
        draft, labels, valid = draft_argmax(drafter, clean, offsets, gamma, mask_id)
        s = _streaks(((draft == labels) & valid).float())
        streaks.append(s)
        for j in range(gamma + 1):
            reach[j] += float((s >= j).sum())
        if verifier is not None:
            soft.append(_streaks(_verifier_probs(verifier, clean, offsets, draft) * valid))
    if not streaks:
        raise ValueError("no trajectory had both a prompt and a completion")
    all_streaks = torch.cat(streaks)
    alpha = [float(reach[j] / reach[j - 1]) if reach[j - 1] else 0.0 for j in range(1, gamma + 1)]
    out: dict[str, float | list[float] | int] = {
        "mean_streak": float(all_streaks.mean()),
        "alpha": alpha,
        "windows": int(all_streaks.numel()),
    }
    if soft:
        out["mean_soft_streak"] = float(torch.cat(soft).mean())
    return out


def _verifier_probs(
    verifier: Transformer, clean: torch.Tensor, offsets: torch.Tensor, draft: torch.Tensor
) -> torch.Tensor:
    """``[K, γ]`` verifier probabilities ``p_j(x̂_j)`` of each window's draft given the true prefix and the draft's
    earlier slots (one causal forward per window)."""
    out = []
    for k, offset in enumerate(offsets.tolist()):
        seq = torch.cat([clean[:offset], draft[k]])[None]
        logp = verifier(seq).float().log_softmax(-1)[0, offset - 1 : offset - 1 + draft.shape[1]]
        out.append(logp.gather(-1, draft[k][:, None]).squeeze(-1).exp())
    return torch.stack(out)
