"""Drafters: cached drafting equals recomputation, sampling follows q, bad drafters are refused."""

import pytest
import torch

from streakline.config.schema import DecoderConfig
from streakline.decoding.drafters import ARDrafter, DiffusionDrafter, draft_distribution, sample_chains
from streakline.decoding.registry import speculative_setup
from streakline.decoding.speculative import generate
from streakline.decoding.vanilla import greedy_generate, left_pad
from tests.decoding.helpers import MASK, V, causal_copy, chi2_pvalue, random_drafter, verifier


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


class _RecordingDrafter(DiffusionDrafter):
    """The real diffusion drafter, keeping every proposal the decoding loop asked it for."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.proposals = []

    def propose(self, *args, **kwargs):
        proposal = super().propose(*args, **kwargs)
        self.proposals.append(proposal)
        return proposal


def _chi2_pvalue(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square p-value of the token histogram against ``probs``."""
    return chi2_pvalue(torch.bincount(tokens, minlength=probs.numel()), probs)


@pytest.mark.parametrize(
    "argmax_chain,acceptance,temperature,iid",
    [
        (False, "greedy_acceptance", 0.0, True),  # the setting: the one draft is a sample from q
        (True, "greedy_acceptance", 0.0, False),  # the default: the one draft is q's argmax
        (True, "leviathan", 1.0, True),  # a rule that needs i.i.d. drafts gets them whatever the setting
    ],
)
def test_argmax_chain_setting_decides_how_the_k1_draft_is_drawn(argmax_chain, acceptance, temperature, iid):
    """decoder config -> speculative_setup -> generate -> drafter: at K = 1 and tau_d = 1 the drafted first token
    follows q (chi-square) when drafts are i.i.d., and is always q's argmax otherwise."""
    n = 3000  # one prompt repeated: each row is an independent draw of the first cycle's draft
    decoder = DecoderConfig(
        name="diffusion_draft", K=1, gamma=1, temperature=temperature, drafter_temperature=1.0, top_k=None,
        acceptance=acceptance, argmax_chain=argmax_chain, max_new_tokens=1,
    )  # fmt: skip
    spec, built = speculative_setup(decoder, random_drafter(seed=2), seed=5)
    assert spec.argmax_chain is argmax_chain and spec.K == 1
    drafter = _RecordingDrafter(built.model, temperature=built.temperature, top_k=built.top_k)
    generate(verifier(seed=0), [[1, 2, 3]] * n, spec, drafter=drafter)
    (proposal,) = drafter.proposals  # max_new_tokens=1: a single cycle
    drafted = proposal.tokens[:, 0, 0]
    q = proposal.q[0, 0]
    torch.testing.assert_close(proposal.q[:, 0], q.expand(n, -1))  # the same q in every row
    assert q.max() < 0.5  # a spread-out q, so sampled and argmax drafts look nothing alike
    if iid:
        assert _chi2_pvalue(drafted, q) > 1e-3
        assert _chi2_pvalue(drafted, torch.full_like(q, 1 / q.numel())) < 1e-6  # the test can tell q from uniform
        assert (drafted != q.argmax()).float().mean() > 0.5
    else:
        assert bool((drafted == q.argmax()).all())


def test_drafter_without_mask_token_is_refused():
    model = random_drafter()
    model.config.mask_token_id = None
    with pytest.raises(ValueError, match="mask token"):
        DiffusionDrafter(model)
