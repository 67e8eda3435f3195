"""Simulated streak: drafts equal the decoder's own drafter (packed or one forward per window), streaks equal what
exact-greedy verification accepts, and alpha_j counts only windows long enough to reach slot j."""

import pytest
import torch

from streakline.alignment.streak import _streaks, alpha_counts, draft_argmax, simulated_streak
from streakline.alignment.windows import window_input
from streakline.decoding.drafters import DiffusionDrafter
from streakline.models import Transformer
from tests.models.helpers import VOCAB, tiny_config

MASK = VOCAB - 1

pytestmark = pytest.mark.usefixtures("one_thread")


def _direct(drafter, verifier, trajectories, gamma):
    """One forward per window, streaks and α by plain loops: the definition, without packing."""
    streaks, soft, room = [], [], []
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
            room.append(min(gamma, len(clean) - offset))  # slots inside the completion
    return sum(streaks) / len(streaks), sum(soft) / len(soft), streaks, room


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
    mean, soft, streaks, room = _direct(drafter, verifier, trajectories, 4)
    assert abs(stats["mean_streak"] - mean) < 1e-6 and abs(stats["mean_soft_streak"] - soft) < 1e-5
    assert stats["windows"] == len(streaks) == 11
    assert max(streaks) == 4  # the first window of the second trajectory is fully accepted
    # alpha_j over the windows whose slot j exists: reached j / reached j-1
    tried = [sum(s >= j - 1 and r >= j for s, r in zip(streaks, room, strict=True)) for j in range(1, 5)]
    kept = [sum(s >= j for s in streaks) for j in range(1, 5)]
    expected = [k / t if t else 0.0 for k, t in zip(kept, tried, strict=True)]
    assert stats["alpha"] == pytest.approx(expected, abs=1e-6)
    # soft=False (trainer.eval_soft_streak=false): the exact streak and alpha as they were, no verifier probabilities
    hard = simulated_streak(drafter, trajectories, gamma=4, mask_id=MASK, verifier=verifier, soft=False)
    assert "mean_soft_streak" not in hard and {k: hard[k] for k in ("mean_streak", "alpha", "windows")} == {
        k: stats[k] for k in ("mean_streak", "alpha", "windows")
    }


def _decoder_draft(drafter_model, prefix, gamma):
    """The draft the decoder's own diffusion drafter proposes after ``prefix`` at temperature 0 (a fresh decode)."""
    drafter = DiffusionDrafter(drafter_model, temperature=0.0)
    drafter.reset(1, len(prefix) + gamma + 4)
    proposal = drafter.propose(torch.tensor([prefix]), None, gamma=gamma, K=1, generator=None, iid=False)
    return proposal.tokens[0, 0].tolist()


def _accepted(draft, completion, i, gamma):
    """Tokens exact-greedy verification keeps when the verifier's greedy continuation is ``completion``: the leading
    matches, and never past the completion's end."""
    n = 0
    for j in range(min(gamma, len(completion) - i)):
        if draft[j] != completion[i + j]:
            break
        n += 1
    return n


@pytest.mark.parametrize(
    "mode,shift", [("full", False), ("full", True), ("prefix_causal", False), ("prefix_causal", True)]
)
def test_drafts_and_streaks_equal_the_decoders(mode, shift):
    gamma = 4
    cfg = tiny_config("qwen2", attention=mode, shift=shift, mask_token_id=MASK)
    drafter = Transformer(cfg).init_weights(seed=5, std=0.2).eval()
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, 90, (4,), generator=g).tolist()
    # Half of the completion is the drafter's own draft from the prompt, so several windows have long streaks.
    completion = _decoder_draft(drafter, prompt, gamma) + torch.randint(0, 90, (5,), generator=g).tolist()
    clean = torch.tensor(prompt + completion)
    offsets = torch.arange(len(prompt), len(clean))
    draft, labels, valid = draft_argmax(drafter, clean, offsets, gamma, MASK)
    expected, accepted = [], []
    for offset in offsets.tolist():
        ref = _decoder_draft(drafter, clean[:offset].tolist(), gamma)
        expected.append(ref)
        accepted.append(_accepted(ref, completion, offset - len(prompt), gamma))
    assert draft.tolist() == expected
    streaks = _streaks(((draft == labels) & valid).float())
    assert streaks.tolist() == accepted
    assert accepted[0] == gamma and 0 < sum(accepted) < gamma * len(accepted)  # some drafts right, not all
    stats = simulated_streak(drafter, [(prompt, completion)], gamma=gamma, mask_id=MASK)
    assert stats["mean_streak"] == pytest.approx(sum(accepted) / len(accepted))
    assert stats["windows"] == len(completion)


def test_alpha_leaves_out_windows_cut_short_by_the_completion():
    # Five windows A..E. A, B, C sit at the end of a completion (3, 2, 1 slots inside it) and are right on every
    # one; D and E have all 4 slots and are rejected at slot 2 and slot 1.
    valid = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    streaks = torch.tensor([3.0, 2.0, 1.0, 1.0, 0.0])
    accepted, tried = alpha_counts(streaks, valid)
    assert accepted.tolist() == [4, 2, 1, 0]  # slot 1: A-D; slot 2: A, B; slot 3: A
    # slot 2 is tried by A, B, D (C has no slot 2); slot 3 by A alone; slot 4 by nobody (A ends at 3, D and E
    # stopped early). Counting every window whose streak reaches j-1 would give 5, 4, 2, 1.
    assert tried.tolist() == [5, 3, 1, 0]


@pytest.mark.parametrize("mode", ["full", "prefix_causal"])
def test_alpha_of_a_perfect_drafter_is_one_even_on_short_completions(mode):
    gamma = 4
    drafter = Transformer(tiny_config("qwen2", attention=mode, mask_token_id=MASK)).init_weights(seed=2, std=0.2).eval()
    with torch.no_grad():  # every token embeds alike: the drafter predicts one token t everywhere
        drafter.embed.weight.copy_(drafter.embed.weight[0].expand_as(drafter.embed.weight))
    t = _decoder_draft(drafter, [1, 2], gamma)[0]
    trajectories = [([1, 2, 3], [t] * 6), ([4], [t] * 2), ([5, 6], [t])]  # two completions shorter than gamma
    stats = simulated_streak(drafter, trajectories, gamma=gamma, mask_id=MASK)
    assert stats["alpha"] == [1.0] * gamma
    streaks = [min(gamma, n - i) for n in (6, 2, 1) for i in range(n)]
    assert stats["windows"] == len(streaks) and stats["mean_streak"] == pytest.approx(sum(streaks) / len(streaks))


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_verifier_probs_packed_after_cache_equal_one_forward_per_window(chunk):
    """The soft streak's p_j(x̂_j): windows packed after the cached trajectory, in chunks of any size, give what one
    causal forward over ``clean[:offset] ∘ draft`` gives, windows running past the trajectory's end included."""
    from streakline.alignment.streak import _verifier_probs

    verifier = Transformer(tiny_config("llama")).init_weights(seed=4, std=0.2).eval()
    g = torch.Generator().manual_seed(5)
    clean = torch.randint(0, 90, (12,), generator=g)
    offsets = torch.arange(4, 12)
    draft = torch.randint(0, 90, (len(offsets), 5), generator=g)
    with torch.no_grad():
        got = _verifier_probs(verifier, clean, offsets, draft, chunk=chunk)
        want = torch.stack(
            [
                verifier(torch.cat([clean[:o], draft[k]])[None])[0, o - 1 : o + 4]
                .softmax(-1)
                .gather(-1, draft[k][:, None])[:, 0]
                for k, o in enumerate(offsets.tolist())
            ]
        )
    assert got.shape == (8, 5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
