"""decoder=dflash_lookup (``decoding/mixed.py``): prompt lookup, the DFlash drafter or a plain step, per row and
cycle, whichever is expected to emit the most tokens per cost. Lossless as every drafter: vanilla's greedy tokens on
ragged batches whose rows mix the options in one cycle, the DFlash rows' q equal to the drafter's from-scratch
forward over the verifier's states of every committed token (those of lookup cycles absorbed late, in one forward),
and the verifier's distribution at T=1. The rule itself: on inputs where each option must win, and its costs and
expectations against a hand computation; the decoder's setup and refusals."""

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from streakline.decoding.drafters import DFlashDrafter
from streakline.decoding.mixed import PROBE_EVERY, PROBE_MAX, Acceptance, Costs, MixedDrafter, expected_accepted
from streakline.decoding.ngram import NgramDrafter, lookup
from streakline.decoding.registry import needs_drafter_model, speculative_setup
from streakline.decoding.speculative import SpecConfig, generate
from tests.decoding.helpers import decoder_settings, sampled_pairs, verifier
from tests.decoding.test_dflash import _dflash, scratch_q

# rows with repeats (lookup matches from the start), one without (the DFlash drafter drafts), short ones
PROMPTS = [[1, 2, 3, 4, 1, 2, 3], [6, 7, 8, 9], [2, 9, 4, 2, 9, 4, 2, 9], [3, 1]]


class Checked(MixedDrafter):
    """Records, for every cycle, which option each row took, and checks each DFlash-drafted row's q against the
    drafter's uncached forward over the verifier's states of the row's whole committed sequence."""

    def __init__(self, model_drafter, lookup_drafter, verifier_model, **costs) -> None:
        super().__init__(model_drafter, lookup_drafter, **costs)
        self.verifier = verifier_model
        self.worst, self.checks, self.mixed, self.idled, self.trimmed = 0.0, 0, 0, 0, 0

    def reset(self, batch_size, capacity, engine=None):
        super().reset(batch_size, capacity, engine)
        self.seqs = [[] for _ in range(batch_size)]

    def keep_rows(self, index):
        super().keep_rows(index)
        self.seqs = [self.seqs[i] for i in index.tolist()]

    def propose(self, new_ids, new_valid, *, gamma, K, generator, iid, features=None, feature_valid=None):
        for r in range(new_ids.shape[0]):
            row = new_ids[r] if new_valid is None else new_ids[r][new_valid[r]]
            self.seqs[r] += row.tolist()
        out = super().propose(new_ids, new_valid, gamma=gamma, K=K, generator=generator, iid=iid, features=features,
                              feature_valid=feature_valid)  # fmt: skip
        looked = [len(lookup(np.array(s), n_min=self.lookup.n_min, n_max=self.lookup.n_max, k=gamma)) > 0
                  for s in self.seqs]  # fmt: skip
        assert all(lk for c, lk in zip(self.choice, looked, strict=True) if c == "lookup")  # only with a match
        self.mixed += len(set(self.choice)) > 1
        self.trimmed += "model" in self.choice and out.tokens.shape[-1] < gamma  # the block's first drafts only
        self.idled += "none" in self.choice
        for r, seq in enumerate(self.seqs):
            if self.choice[r] != "model":  # lookup's draft, or nothing (the pending token): q one-hot on it
                q = out.distribution()[r]
                assert torch.equal(q.argmax(-1), out.tokens[r, 0]) and torch.equal(q.sum(-1), torch.ones(len(q)))
                continue
            want = scratch_q(self.model_drafter, self.verifier, seq, gamma)[: out.q.shape[1]]  # the verified drafts
            assert out.q[r].shape == want.shape
            self.worst = max(self.worst, float((want - out.q[r]).abs().max()))
            self.checks += 1
        return out


def _mixed(model, checked=True, **costs):
    inner = DFlashDrafter(_dflash(model, **costs.pop("dflash", {})), temperature=1.0, top_k=None)
    ngram = NgramDrafter(n_max=3, n_min=2, vocab_size=model.config.vocab_size)
    return Checked(inner, ngram, model, **costs) if checked else MixedDrafter(inner, ngram, **costs)


@pytest.mark.parametrize("engine", ["eager", "static"])
@pytest.mark.parametrize("acceptance", ["greedy_acceptance", "exact_greedy", "leviathan"])
def test_greedy_output_is_vanillas_with_the_options_mixed_in_one_batch(acceptance, engine):
    model = verifier(seed=7)
    want = generate(model, PROMPTS, SpecConfig(max_new_tokens=24, eos_token_id=5)).tokens
    drafter = _mixed(model)  # measured costs: which option wins moves with the clock, the tokens must not
    cfg = SpecConfig(max_new_tokens=24, gamma=4, acceptance=acceptance, eos_token_id=5, engine=engine)
    res = generate(model, PROMPTS, cfg, drafter=drafter)
    assert res.tokens == want
    assert drafter.mixed > 0  # cycles whose rows took different options
    assert res.metrics.drafter_forwards == drafter.cycles - drafter.lookup_cycles  # a forward a model cycle
    assert drafter.checks > 0 and drafter.worst < 1e-5  # the DFlash context held every committed token
    assert drafter.costs.timed == drafter.cycles  # every cycle was timed (a CPU decode always times its phases)


def test_a_costly_model_leaves_rows_without_a_match_to_plain_steps_but_is_probed():
    """A DFlash forward at 100 vanilla steps never pays: where lookup finds nothing a row takes a plain verifier step
    (width 0 on the eager engine), but for one model draft every PROBE_EVERY cycles, and the tokens stay vanilla's."""
    model = verifier(seed=7)
    prompts = [[6, 7, 8, 9]]  # no repeats: lookup finds little, so the model would draft most cycles
    want = generate(model, prompts, SpecConfig(max_new_tokens=40)).tokens
    counts = {}
    for cost in (0.0, 100.0):
        drafter = _mixed(model, draft_cost=cost, verify_cost=0.0)
        res = generate(model, prompts, SpecConfig(max_new_tokens=40, gamma=4, engine="eager"), drafter=drafter)
        assert res.tokens == want
        assert drafter.checks > 0 and drafter.worst < 1e-5
        counts[cost] = (res.metrics.drafter_forwards, drafter.cycles, drafter.idled)
    (free, _, idled), (probed, cycles_100, idled_100) = counts[0.0], counts[100.0]
    assert idled == 0 and idled_100 > 0  # a free model always beats a plain step; a costly one never does
    assert free > probed >= 1
    assert probed <= 1 + cycles_100 // PROBE_EVERY  # the first draft (prior), then one probe every PROBE_EVERY


def test_a_batch_that_lookup_drafts_alone_runs_no_drafter_forward_and_absorbs_late():
    model = verifier(seed=7)
    prompt = [[2, 9, 4, 2, 9, 4, 2, 9, 4, 2, 9]]
    drafter = _mixed(model, draft_cost=0.5, verify_cost=0.0)
    res = generate(model, prompt, SpecConfig(max_new_tokens=16, gamma=4), drafter=drafter)
    assert res.tokens == generate(model, prompt, SpecConfig(max_new_tokens=16)).tokens
    assert drafter.lookup_cycles >= 1 and res.metrics.drafter_forwards == drafter.cycles - drafter.lookup_cycles
    assert drafter.checks > 0 and drafter.worst < 1e-5  # model cycles after lookup ones read every state


def test_expected_accepted_and_acceptance_counts_by_hand():
    assert expected_accepted([0.5, 0.5, 0.5], 2) == pytest.approx(0.5 + 0.25)
    assert expected_accepted([1.0, 0.8, 0.5], 3) == pytest.approx(1.0 + 0.8 + 0.4)
    acc = Acceptance(0, decay=1.0, prior=0.5, weight=2.0)
    acc.count(drafted=4, accepted=2)  # offered positions 1-3 (the third was rejected), accepted 1-2
    acc.count(drafted=4, accepted=4)  # all four
    assert acc.offered == [2.0, 2.0, 2.0, 1.0] and acc.accepted == [2.0, 2.0, 1.0, 1.0]
    assert acc.rates() == pytest.approx([(2 + 1) / 4, (2 + 1) / 4, (1 + 1) / 4, (1 + 1) / 3])
    assert acc.rates([1.0] * 4) == pytest.approx([1.0, 1.0, 3 / 4, 3 / 3])  # a pooled base in place of the prior


def test_costs_fit_a_line_from_the_timed_widths_and_take_the_draft_over_a_lookup_cycle():
    costs = Costs()
    assert costs.verify(0) == 1.0 and costs.verify(8) == pytest.approx(1.16)  # the priors, in vanilla steps
    for _ in range(5):
        costs.observe(0, draft_s=0.001, verify_s=0.040, model=False)  # plain steps: 40 ms
        costs.observe(8, draft_s=0.013, verify_s=0.048, model=True)  # a window of 9: 48 ms, its draft 12 ms more
    assert costs.verify(0) == pytest.approx(0.040) and costs.verify(4) == pytest.approx(0.044)
    assert costs.draft() == pytest.approx(0.012, rel=0.2)  # decayed means of 13 ms against 1 ms
    fixed = Costs(verify_slope=0.1, draft_cost=0.25)
    fixed.observe(0, draft_s=0.0, verify_s=0.040, model=False)
    assert fixed.verify(8) == pytest.approx(0.040 * 1.8) and fixed.draft() == pytest.approx(0.010)
    with pytest.raises(ValueError, match="draft_cost must be >= 0"):
        Costs(draft_cost=float("nan"))


def _learned(drafter: MixedDrafter, lookup_rate: float, model_rate: float, cycles: int = 40) -> MixedDrafter:
    """``drafter`` after ``cycles`` cycles of each option, each accepting its drafts at the given per-token rate
    (a deterministic pattern), counted as ``_learn`` counts them: pooled, and row 0's own."""
    drafter._state(1)
    for option, rate in (("lookup", lookup_rate), ("model", model_rate)):
        for c in range(cycles):
            accepted = 0
            while accepted < 4 and ((c * 7 + accepted * 3) % 10) / 10 < rate:
                accepted += 1
            drafter.pooled[option].count(4, accepted)
            drafter.rows[0][option].count(4, accepted)
    return drafter


@pytest.mark.parametrize(
    ("lookup_rate", "model_rate", "match", "draft_cost", "want"),
    [
        (0.9, 0.3, 4, 0.3, "lookup"),  # lookup is right and free: it wins where it matched
        (0.9, 0.3, 0, 0.3, "none"),  # no match, and the model's drafts do not pay for its forward
        (0.9, 0.8, 0, 0.3, "model"),  # no match, and the model's drafts pay
        (0.2, 0.9, 4, 0.3, "model"),  # lookup matched, but its drafts are rarely right and the model's are
        (0.2, 0.9, 4, 5.0, "lookup"),  # the same, but the model's forward costs five steps
    ],
)
def test_each_option_wins_where_it_must(lookup_rate, model_rate, match, draft_cost, want):
    model = verifier(seed=7)
    drafter = _learned(_mixed(model, checked=False, draft_cost=draft_cost, verify_cost=0.02), lookup_rate, model_rate)
    assert drafter.decide(0, match, gamma=4) == want
    rates = {o: drafter.rates(0, o, m) for o, m in (("none", 0), ("lookup", match), ("model", 4)) if m or o == "none"}
    best = max(rates, key=lambda o: rates[o][0] / rates[o][1])
    assert best == want  # decide takes the best tokens per cost


def test_an_option_untried_for_probe_every_cycles_is_tried():
    model = verifier(seed=7)
    drafter = _learned(_mixed(model, checked=False, draft_cost=5.0, verify_cost=0.02), 0.9, 0.1)
    assert drafter.decide(0, 0, gamma=4) == "none"
    drafter.idle[0]["model"] = PROBE_EVERY - 1
    assert drafter.decide(0, 0, gamma=4) == "model"


def test_a_steep_verify_cost_verifies_only_the_first_drafts_of_a_weak_block():
    """Where each verified draft costs half a step and the later positions are rarely accepted, the best window is
    narrower than gamma; where verifying is nearly free and the model is right, the whole block."""
    model = verifier(seed=7)
    weak = _learned(_mixed(model, checked=False, draft_cost=0.0, verify_cost=0.5), 0.9, 0.5)
    width, _ = weak.best_width(0, "model", 4)
    assert 1 <= width < 4
    strong = _learned(_mixed(model, checked=False, draft_cost=0.0, verify_cost=0.01), 0.9, 0.95)
    assert strong.best_width(0, "model", 4)[0] == 4
    # by hand: the weak model's rate at its width is the best over every width
    rates = weak.rows[0]["model"].rates(weak.pooled["model"].rates())
    by_hand = [(1 + expected_accepted(rates, m)) / weak.costs.verify(m) for m in range(1, 5)]
    assert max(range(4), key=lambda i: by_hand[i]) + 1 == width


def test_trimmed_model_windows_decode_vanillas_tokens():
    model = verifier(seed=7)
    prompts = [[6, 7, 8, 9], [3, 1]]
    want = generate(model, prompts, SpecConfig(max_new_tokens=30, eos_token_id=5)).tokens
    drafter = _mixed(model, draft_cost=0.0, verify_cost=0.6)  # each verified draft costs 0.6 steps
    res = generate(model, prompts, SpecConfig(max_new_tokens=30, gamma=4, eos_token_id=5), drafter=drafter)
    assert res.tokens == want
    assert drafter.trimmed > 0 and drafter.checks > 0 and drafter.worst < 1e-5


def test_a_probe_that_finds_the_option_still_losing_doubles_the_wait():
    model = verifier(seed=7)
    drafter = _learned(_mixed(model, checked=False, draft_cost=5.0, verify_cost=0.02), 0.9, 0.1)
    waits = []
    for _ in range(6):  # each probe of the costly model is followed by a cycle where it loses on its merits
        drafter.idle[0]["model"] = drafter.wait[0]["model"] - 1
        assert drafter.decide(0, 0, gamma=4) == "model"  # probed
        drafter.choice[0] = "model"
        drafter.idle[0]["model"] = 0
        assert drafter.decide(0, 0, gamma=4) == "none"
        drafter.choice[0] = "none"
        waits.append(drafter.wait[0]["model"])
    assert waits == [min(PROBE_MAX, PROBE_EVERY * 2**k) for k in range(1, 7)]
    cheap = _learned(_mixed(model, checked=False, draft_cost=0.0, verify_cost=0.02), 0.9, 0.8)
    cheap.wait[0]["model"] = PROBE_MAX
    assert cheap.decide(0, 0, gamma=4) == "model" and cheap.wait[0]["model"] == PROBE_EVERY  # it wins: back


@pytest.mark.parametrize("draft_cost", [0.0, None])
def test_sampling_follows_the_verifier(draft_cost):
    """A free model (0) never loses to a plain step, so rows part between lookup and the model; measured costs
    (None) may send rows to any option, plain steps included."""
    model = verifier(seed=11, vocab=6)
    drafter = _mixed(model, checked=False, draft_cost=draft_cost, verify_cost=draft_cost, dflash={"std": 0.3})
    drafter.lookup.n_min = 1  # a 6-token vocabulary: 1-token matches, so rows part between the options
    for rule, (res, p) in sampled_pairs(model, drafter, [1, 2, 3, 1, 2], 4000).items():
        assert p > 1e-3, rule
        if draft_cost == 0.0:
            assert res.metrics.accepted > 0, rule
    if draft_cost == 0.0:
        assert 0 < drafter.lookup_cycles < drafter.cycles
        assert drafter.chosen["lookup"] > 0 and drafter.chosen["model"] > 0


def test_setup_shares_the_verifier_and_refuses_what_it_cannot_run():
    model = verifier(seed=3)
    decoder = decoder_settings("dflash_lookup", drafter_temperature=0.0, draft_cost=0.4)
    assert needs_drafter_model("dflash_lookup")
    dflash = _dflash(model, block=5)
    spec, drafter = speculative_setup(decoder, dflash, gamma_default=2, verifier=model)
    assert isinstance(drafter, MixedDrafter) and spec.gamma == 4  # the block size - 1, not gamma_default
    assert (drafter.lookup.n_min, drafter.lookup.n_max, drafter.lookup.vocab_size) == (2, 3, model.config.vocab_size)
    assert (drafter.costs.draft_cost, drafter.costs.verify_slope) == (0.4, None)
    with pytest.raises(ValueError, match="one chain"):
        speculative_setup(OmegaConf.merge(decoder, {"K": 2}), dflash, verifier=model)
    with pytest.raises(ValueError, match="plain transformer"):
        speculative_setup(decoder, model, verifier=model)
    with pytest.raises(ValueError, match="at most 4 tokens"):
        generate(model, [[1, 2]], SpecConfig(max_new_tokens=4, gamma=5), drafter=drafter)
    with pytest.raises(ValueError, match="one chain"):
        generate(model, [[1, 2]], SpecConfig(max_new_tokens=4, gamma=2, K=2), drafter=drafter)
