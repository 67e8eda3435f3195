"""Simulated streak: the packed drafter forward scores every window as a one-window forward would."""

import pytest
import torch

from streakline.alignment.streak import simulated_streak
from streakline.alignment.windows import window_input
from streakline.models import Transformer
from tests.models.helpers import VOCAB, tiny_config

MASK = VOCAB - 1


def _direct(drafter, verifier, trajectories, gamma):
    """One forward per window, streaks and α by plain loops: the definition, without packing."""
    streaks, soft = [], []
    for prompt, completion in trajectories:
        clean = torch.tensor(prompt + completion)
        for i in range(len(completion)):
            offset = len(prompt) + i
            ids, prefix = window_input(clean, offset, gamma, MASK)
            with torch.no_grad():
                draft = drafter(ids[None], prefix_len=prefix)[0, offset:].argmax(-1)
            s, p_run, soft_s = 0, 1.0, 0.0
            alive = True
            for j in range(gamma):
                if offset + j >= len(clean):
                    break
                alive = alive and int(draft[j]) == int(clean[offset + j])
                s += int(alive)
                seq = torch.cat([clean[:offset], draft[: j + 1]])[None]
                with torch.no_grad():
                    p = verifier(seq)[0, offset + j - 1].softmax(-1)[draft[j]]
                p_run *= float(p)
                soft_s += p_run
            streaks.append(s)
            soft.append(soft_s)
    return sum(streaks) / len(streaks), sum(soft) / len(soft), streaks


def test_packed_streak_equals_direct_definition():
    drafter = Transformer(tiny_config("qwen2", attention="prefix_causal")).init_weights(seed=1, std=0.2).eval()
    verifier = Transformer(tiny_config("qwen2")).init_weights(seed=2, std=0.2).eval()
    g = torch.Generator().manual_seed(3)
    trajectories = [
        (torch.randint(0, 90, (5,), generator=g).tolist(), torch.randint(0, 90, (7,), generator=g).tolist())
    ]
    # Make some drafts right: use the drafter's own argmax continuation as the "completion" of a second trajectory.
    prompt = [3, 4, 5]
    ids, prefix = window_input(torch.tensor(prompt + [0] * 4), 3, 4, MASK)
    with torch.no_grad():
        own = drafter(ids[None], prefix_len=prefix)[0, 3:].argmax(-1).tolist()
    trajectories.append((prompt, own))
    stats = simulated_streak(drafter, trajectories, gamma=4, mask_id=MASK, verifier=verifier)
    mean, soft, streaks = _direct(drafter, verifier, trajectories, 4)
    assert abs(stats["mean_streak"] - mean) < 1e-6 and abs(stats["mean_soft_streak"] - soft) < 1e-5
    assert stats["windows"] == len(streaks) == 11
    assert max(streaks) == 4  # the first window of the second trajectory is fully accepted
    reach = [sum(s >= j for s in streaks) for j in range(5)]
    expected = [reach[j] / reach[j - 1] if reach[j - 1] else 0.0 for j in range(1, 5)]
    assert stats["alpha"] == pytest.approx(expected, abs=1e-6)
