"""Sampling is lossless: the decoder's output distribution is the verifier's, whatever the drafter proposes.

A small-vocabulary verifier (V = 6) at temperature 1; the exact joint distribution of the first two emitted tokens
is computed by enumeration (6 + 1 forwards). Each decoder draws N samples (one batch of N copies of the prompt, so
every row is an independent sample) and a chi-square test compares the histogram with the exact distribution.
Seeds are fixed, so each test is deterministic; the threshold p > 1e-3 is what a correct sampler passes and the
biased rule (best of K after independent leviathan checks) fails by many orders of magnitude.

Drafters are deliberately misaligned: the verifier drafting for itself (leviathan accepts everything), a constant
token the verifier rarely picks (almost never accepted), unrelated random models (sometimes).
"""

import pytest
import torch

from streakline.decoding.acceptance import ACCEPTANCE_RULES, AcceptanceRule
from streakline.decoding.drafters import ARDrafter, DiffusionDrafter, Proposal
from streakline.decoding.kernels import VerifyOut, verify_chains
from streakline.decoding.speculative import SpecConfig, generate
from tests.decoding.helpers import causal_copy, chi2_pvalue, random_drafter, shifted_copy, verifier

V, T, N, PROMPT = 6, 1.0, 4000, [1, 2, 3]


@pytest.fixture(scope="module")
def model():
    return verifier(seed=11, vocab=V)


@pytest.fixture(scope="module")
def exact(model) -> torch.Tensor:
    """``[V, V]`` P(first token = a, second = b) under the verifier at temperature T."""
    with torch.no_grad():
        p1 = torch.softmax(model(torch.tensor([PROMPT]))[0, -1] / T, -1)
        seqs = torch.tensor([PROMPT + [a] for a in range(V)])
        p2 = torch.softmax(model(seqs)[:, -1] / T, -1)
    return p1[:, None] * p2


def _chi2_pvalue(tokens: list[list[int]], exact: torch.Tensor) -> float:
    counts = torch.zeros(V * V, dtype=torch.float64)
    for t in tokens:
        counts[t[0] * V + t[1]] += 1
    return chi2_pvalue(counts, exact)


class ConstantDrafter:
    """Proposes one fixed token at every slot of every chain, q one-hot on it (the drafts really come from q)."""

    kind = "constant"

    def __init__(self, token: int) -> None:
        self.token = token

    def reset(self, batch_size, capacity, engine=None):
        pass

    def keep_rows(self, index):
        pass

    def release(self):
        pass

    def propose(self, new_ids, new_valid, *, gamma, K, generator, iid):
        B = new_ids.shape[0]
        q = torch.zeros(B, gamma, V)
        q[..., self.token] = 1.0
        return Proposal(tokens=torch.full((B, K, gamma), self.token), q=q, forwards=1)


def _sample(model, drafter, acceptance, K=1, gamma=3, seed=0):
    cfg = SpecConfig(max_new_tokens=2, gamma=gamma, K=K, temperature=T, acceptance=acceptance, seed=seed)
    return generate(model, [PROMPT] * N, cfg, drafter=drafter)


def _rare_token(exact) -> int:
    return int(exact.sum(1).argmin())


def test_vanilla_sampling_follows_the_verifier(model, exact):
    assert _chi2_pvalue(_sample(model, None, "greedy_acceptance").tokens, exact) > 1e-3


def test_leviathan_is_lossless_for_aligned_misaligned_and_unrelated_drafters(model, exact):
    always = _sample(model, ARDrafter(causal_copy(model), temperature=T), "leviathan")
    assert always.metrics.alpha[0] > 0.99  # q == p: every draft token accepted
    assert _chi2_pvalue(always.tokens, exact) > 1e-3
    never = _sample(model, ConstantDrafter(_rare_token(exact)), "leviathan")
    assert never.metrics.alpha[0] < 0.2
    assert _chi2_pvalue(never.tokens, exact) > 1e-3
    unrelated = _sample(model, ARDrafter(causal_copy(model, seed=3), temperature=1.3), "leviathan", seed=1)
    assert 0.1 < unrelated.metrics.alpha[0] < 0.95
    assert _chi2_pvalue(unrelated.tokens, exact) > 1e-3


def test_greedy_acceptance_with_self_selection_is_lossless(model, exact):
    for drafter in (
        DiffusionDrafter(shifted_copy(model), temperature=1.0, top_k=None),
        DiffusionDrafter(random_drafter(seed=4, vocab=V), temperature=1.5, top_k=None),
    ):
        res = _sample(model, drafter, "greedy_acceptance", K=4)
        assert sum(res.metrics.chosen[1:]) > 0  # selection really looked at the verifier and picked other chains
        assert _chi2_pvalue(res.tokens, exact) > 1e-3
    rare = _sample(model, ConstantDrafter(_rare_token(exact)), "greedy_acceptance")
    assert _chi2_pvalue(rare.tokens, exact) > 1e-3


@pytest.mark.parametrize("K", [1, 4])
def test_iid_drafts_without_an_argmax_chain_stay_lossless(model, exact, K):
    """``argmax_chain=False`` (all K drafts sampled from q, SpecDiff-2's self-selection): at verifier temperature 0
    the output is vanilla's token for token; at temperature 1 greedy acceptance still follows the verifier."""
    prompts = [[1, 2, 3], [4], [5, 0, 2, 1]]
    want = generate(model, prompts, SpecConfig(max_new_tokens=12)).tokens
    for drafter in (
        DiffusionDrafter(shifted_copy(model), temperature=1.0, top_k=None),
        DiffusionDrafter(random_drafter(seed=4, vocab=V), temperature=2.0, top_k=None),
    ):
        cfg = SpecConfig(max_new_tokens=12, gamma=3, K=K, temperature=0.0, argmax_chain=False, seed=K)
        res = generate(model, prompts, cfg, drafter=drafter)
        assert res.tokens == want
    assert res.metrics.alpha[0] > 0  # sampled drafts were accepted, not just replaced
    if K == 1:
        return  # one sampled check (with self-selection over K i.i.d. drafts) keeps the runtime down
    cfg = SpecConfig(max_new_tokens=2, gamma=3, K=K, temperature=T, argmax_chain=False, seed=1)
    drafter = DiffusionDrafter(shifted_copy(model), temperature=1.0, top_k=None)
    assert _chi2_pvalue(generate(model, [PROMPT] * N, cfg, drafter=drafter).tokens, exact) > 1e-3


def test_multidraft_leviathan_is_lossless(model, exact):
    drafter = DiffusionDrafter(random_drafter(seed=4, vocab=V), temperature=1.0, top_k=None)
    res = _sample(model, drafter, "multidraft_leviathan", K=4, gamma=2)
    assert res.metrics.alpha[0] > 0
    assert _chi2_pvalue(res.tokens, exact) > 1e-3


def _best_of_k_after_leviathan(logits, drafts, q, *, temperature, selection, generator) -> VerifyOut:
    """The tempting mistake: verify each chain independently with leviathan, keep the longest. Not lossless."""
    B, K, G = drafts.shape
    outs = []
    for k in range(K):
        u = torch.rand(B, G + 1, generator=generator)
        outs.append(
            verify_chains(
                logits[:, k : k + 1],
                drafts[:, k : k + 1],
                rule="leviathan",
                temperature=temperature,
                u_accept=u[:, :G].contiguous(),
                u_sample=u[:, G].contiguous(),
                q=q,
            )
        )
    accepted = torch.stack([o.accepted for o in outs], 1)
    chosen = accepted.argmax(1)
    rows = torch.arange(B)
    next_token = torch.stack([o.next_token for o in outs], 1)[rows, chosen]
    return VerifyOut(chosen=chosen, accepted=accepted[rows, chosen], next_token=next_token, scores=accepted.float())


def test_best_of_k_after_independent_leviathan_is_detected_as_biased(model, exact, monkeypatch):
    rule = AcceptanceRule("best_of_k_leviathan", True, True, None, _best_of_k_after_leviathan)
    monkeypatch.setitem(ACCEPTANCE_RULES, rule.name, rule)
    drafter = DiffusionDrafter(random_drafter(seed=4, vocab=V), temperature=1.0, top_k=None)
    res = _sample(model, drafter, rule.name, K=4, gamma=2)
    assert _chi2_pvalue(res.tokens, exact) < 1e-6


def test_top_p_sampling_follows_the_truncated_distribution(model, exact):
    """With top_p the target is the nucleus-truncated verifier distribution, renormalised, for every decoder."""
    top_p = 0.6
    with torch.no_grad():
        logits1 = model(torch.tensor([PROMPT]))[0, -1]
        seqs = torch.tensor([PROMPT + [a] for a in range(V)])
        logits2 = model(seqs)[:, -1]

    def nucleus(logits):
        p = torch.softmax(logits / T, -1)
        order = p.argsort(descending=True)
        before = p[order].cumsum(0) - p[order]
        keep = torch.zeros_like(p, dtype=torch.bool)
        keep[order] = before < top_p
        return p * keep / (p * keep).sum()

    truncated = nucleus(logits1)[:, None] * torch.stack([nucleus(row) for row in logits2])
    assert (truncated == 0).any()  # the test means something only if some tokens are cut
    for drafter, acceptance, K in (
        (None, "greedy_acceptance", 1),
        (DiffusionDrafter(shifted_copy(model), temperature=1.0, top_k=None), "greedy_acceptance", 4),
        (ARDrafter(causal_copy(model, seed=3), temperature=1.3), "leviathan", 1),
    ):
        cfg = SpecConfig(max_new_tokens=2, gamma=3, K=K, temperature=T, top_p=top_p, acceptance=acceptance)
        tokens = generate(model, [PROMPT] * N, cfg, drafter=drafter).tokens
        assert all(truncated[t[0], t[1]] > 0 for t in tokens)
        assert _chi2_pvalue(tokens, truncated) > 1e-3
