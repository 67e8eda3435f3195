"""Drafters: cached drafting equals recomputation, sampling follows q, bad drafters are refused."""

import pytest
import torch

from streakline.decoding.drafters import ARDrafter, DiffusionDrafter, draft_distribution, sample_chains
from streakline.decoding.vanilla import greedy_generate, left_pad
from tests.decoding.helpers import MASK, V, causal_copy, random_drafter, verifier


def _uncached_marginals(model, context: list[int], gamma: int) -> torch.Tensor:
    ids = torch.tensor([context + [MASK] * gamma])
    with torch.no_grad():
        logits = model(ids, prefix_len=len(context))[0]
    start = len(context) - 1 if model.config.shift else len(context)
    return logits[start : start + gamma]


@pytest.mark.parametrize("mode,shift", [("prefix_causal", False), ("prefix_causal", True), ("full", False)])
def test_diffusion_marginals_equal_uncached_forward_over_cycles(mode, shift):
    model = random_drafter(seed=3, mode=mode, shift=shift)
    drafter = DiffusionDrafter(model)
    contexts = [[1, 2, 3, 4], [5]]
    drafter.reset(2, 32)
    segments = contexts
    for cycle_new in ([[6, 7], [8]], [[9], [10, 11, 2]], [[3], [4]]):
        ids, mask = left_pad(segments)
        valid = mask.bool() if len({len(s) for s in segments}) > 1 else None
        with torch.no_grad():
            got = drafter.marginals(ids, valid, 5)
        for b in range(2):
            torch.testing.assert_close(got[b], _uncached_marginals(model, contexts[b], 5), rtol=1e-5, atol=1e-5)
        contexts = [c + n for c, n in zip(contexts, cycle_new, strict=True)]
        segments = cycle_new


def test_ar_drafter_drafts_its_own_greedy_continuation_and_keeps_rows():
    model = causal_copy(verifier(), seed=9)
    drafter = ARDrafter(model)
    drafter.reset(3, 32)
    prompts = [[1, 2, 3], [4], [5, 6]]
    ids, mask = left_pad(prompts)
    prop = drafter.propose(ids, mask.bool(), gamma=4, K=1, generator=None, iid=False)
    assert prop.forwards == 4 and prop.tokens.shape == (3, 1, 4)
    assert prop.tokens[:, 0].tolist() == greedy_generate(model, prompts, 4)
    drafter.keep_rows(torch.tensor([2, 0]))  # rows 1 finished; the others go on with their new tokens
    ids, mask = left_pad([[7], [8, 9]])
    prop = drafter.propose(ids, mask.bool(), gamma=3, K=1, generator=None, iid=False)
    assert prop.tokens[:, 0].tolist() == greedy_generate(model, [[5, 6, 7], [1, 2, 3, 8, 9]], 3)


def test_draft_distribution_and_chain_sampling():
    logits = torch.randn(2, 3, V, generator=torch.Generator().manual_seed(0))
    one_hot = draft_distribution(logits, 0.0, None)
    assert torch.equal(one_hot.argmax(-1), logits.argmax(-1)) and torch.equal(one_hot.sum(-1), torch.ones(2, 3))
    q = draft_distribution(logits, 1.5, 4)
    assert ((q > 0).sum(-1) == 4).all()  # top-k keeps exactly k tokens (no ties in random logits)
    torch.testing.assert_close(q.sum(-1), torch.ones(2, 3))
    g = torch.Generator().manual_seed(1)
    chains = sample_chains(q, 2000, g, argmax_first=True)
    assert torch.equal(chains[:, 0], q.argmax(-1))
    freq = torch.nn.functional.one_hot(chains[:, 1:], V).float().mean(1)  # [2, 3, V]
    assert (freq - q).abs().max() < 0.05  # 2000 draws: a wrong distribution would be far off
    assert ((freq > 0) <= (q > 0)).all()  # never a token outside the top-k
    iid = sample_chains(q, 5, g, argmax_first=False)
    assert iid.shape == (2, 5, 3)


def test_drafter_without_mask_token_is_refused():
    model = random_drafter()
    model.config.mask_token_id = None
    with pytest.raises(ValueError, match="mask token"):
        DiffusionDrafter(model)
