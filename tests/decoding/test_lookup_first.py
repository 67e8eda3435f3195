"""decoder=dflash_lookup (``decoding/lookup_first.py``): prompt lookup where it matches, the DFlash drafter
elsewhere. Lossless as every drafter: vanilla's greedy tokens on ragged batches whose rows mix both drafters in one
cycle, the DFlash rows' q equal to the drafter's from-scratch forward over the verifier's states of every committed
token (lookup cycles included), and the verifier's distribution at T=1; the decoder's setup and refusals."""

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from streakline.decoding.drafters import DFlashDrafter
from streakline.decoding.lookup_first import PROBE_EVERY, LookupFirstDrafter
from streakline.decoding.ngram import NgramDrafter, lookup
from streakline.decoding.registry import needs_drafter_model, speculative_setup
from streakline.decoding.speculative import SpecConfig, generate
from tests.decoding.helpers import decoder_settings, sampled_pairs, verifier
from tests.decoding.test_dflash import _dflash, scratch_q

# rows with repeats (lookup matches from the start), one without (the DFlash drafter drafts), short ones
PROMPTS = [[1, 2, 3, 4, 1, 2, 3], [6, 7, 8, 9], [2, 9, 4, 2, 9, 4, 2, 9], [3, 1]]


class Checked(LookupFirstDrafter):
    """Records, for every cycle, which rows lookup drafted, and checks each DFlash-drafted row's q against the
    drafter's uncached forward over the verifier's states of the row's whole committed sequence."""

    def __init__(self, model_drafter, lookup_drafter, verifier_model, floor=0.0) -> None:
        super().__init__(model_drafter, lookup_drafter, floor=floor)
        self.verifier = verifier_model
        self.worst, self.checks, self.mixed, self.idled = 0.0, 0, 0, 0

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
        assert not any(m and lk for m, lk in zip(self.used_model, looked, strict=True))  # lookup first, always
        self.mixed += any(looked) and any(self.used_model)
        self.idled += any(not m and not lk for m, lk in zip(self.used_model, looked, strict=True))
        for r, seq in enumerate(self.seqs):
            if not self.used_model[r]:  # lookup's draft, or nothing (the pending token): q one-hot on it
                q = out.distribution()[r]
                assert torch.equal(q.argmax(-1), out.tokens[r, 0]) and torch.equal(q.sum(-1), torch.ones(len(q)))
                continue
            want = scratch_q(self.model_drafter, self.verifier, seq, gamma)
            self.worst = max(self.worst, float((want - out.q[r]).abs().max()))
            self.checks += 1
        return out


def _hybrid(model, checked=True, floor=0.0, **dflash):
    inner = DFlashDrafter(_dflash(model, **dflash), temperature=1.0, top_k=None)
    ngram = NgramDrafter(n_max=3, n_min=2, vocab_size=model.config.vocab_size)
    return Checked(inner, ngram, model, floor) if checked else LookupFirstDrafter(inner, ngram, floor=floor)


@pytest.mark.parametrize("engine", ["eager", "static"])
@pytest.mark.parametrize("acceptance", ["greedy_acceptance", "exact_greedy", "leviathan"])
def test_greedy_output_is_vanillas_with_both_drafters_in_one_batch(acceptance, engine):
    model = verifier(seed=7)
    want = generate(model, PROMPTS, SpecConfig(max_new_tokens=24, eos_token_id=5)).tokens
    drafter = _hybrid(model)
    cfg = SpecConfig(max_new_tokens=24, gamma=4, acceptance=acceptance, eos_token_id=5, engine=engine)
    res = generate(model, PROMPTS, cfg, drafter=drafter)
    assert res.tokens == want
    assert drafter.mixed > 0  # cycles where some rows drafted by lookup and others by the DFlash drafter
    assert res.metrics.drafter_forwards == drafter.cycles - drafter.lookup_cycles  # a forward a model cycle
    assert drafter.checks > 0 and drafter.worst < 1e-5  # the DFlash context held every committed token


def test_below_the_floor_a_row_drafts_nothing_but_probes_the_model_every_few_cycles():
    """floor: after a row's DFlash drafts earn fewer accepted tokens a cycle than it, cycles where lookup finds
    nothing are plain verifier steps (width 0 on the eager engine), but for one model draft every PROBE_EVERY."""
    model = verifier(seed=7)
    prompts = [[6, 7, 8, 9]]  # no repeats: lookup finds little, so the model would draft most cycles
    want = generate(model, prompts, SpecConfig(max_new_tokens=40)).tokens
    counts = {}
    for floor in (0.0, 100.0):  # 100: no drafter gets there, so every model draft after the first is a probe
        drafter = _hybrid(model, floor=floor)
        res = generate(model, prompts, SpecConfig(max_new_tokens=40, gamma=4, engine="eager"), drafter=drafter)
        assert res.tokens == want
        assert drafter.checks > 0 and drafter.worst < 1e-5
        counts[floor] = (res.metrics.drafter_forwards, drafter.cycles, drafter.idled)
    (always, _, idled), (probed, cycles_100, idled_100) = counts[0.0], counts[100.0]
    assert idled == 0 and idled_100 > 0  # rows drafted nothing only under the floor
    assert always > probed >= 1
    assert probed <= 1 + cycles_100 // PROBE_EVERY  # the first model draft, then one probe every PROBE_EVERY cycles


def test_a_batch_that_lookup_drafts_alone_runs_no_drafter_forward():
    model = verifier(seed=7)
    prompt = [[2, 9, 4, 2, 9, 4, 2, 9, 4, 2, 9]]
    drafter = _hybrid(model)
    res = generate(model, prompt, SpecConfig(max_new_tokens=16, gamma=4), drafter=drafter)
    assert res.tokens == generate(model, prompt, SpecConfig(max_new_tokens=16)).tokens
    assert drafter.lookup_cycles >= 1 and res.metrics.drafter_forwards == drafter.cycles - drafter.lookup_cycles
    assert drafter.checks > 0 and drafter.worst < 1e-5  # model cycles after lookup ones read every state


@pytest.mark.parametrize("floor", [0.0, 1.0])
def test_sampling_follows_the_verifier(floor):
    model = verifier(seed=11, vocab=6)
    drafter = _hybrid(model, checked=False, floor=floor, std=0.3)
    drafter.lookup.n_min = 1  # a 6-token vocabulary: 1-token matches, so rows part between the two drafters
    for rule, (res, p) in sampled_pairs(model, drafter, [1, 2, 3, 1, 2], 4000).items():
        assert res.metrics.accepted > 0, rule
        assert p > 1e-3, rule
    assert 0 < drafter.lookup_cycles < drafter.cycles


def test_setup_shares_the_verifier_and_refuses_what_it_cannot_run():
    model = verifier(seed=3)
    decoder = decoder_settings("dflash_lookup", drafter_temperature=0.0)
    assert needs_drafter_model("dflash_lookup")
    dflash = _dflash(model, block=5)
    spec, drafter = speculative_setup(decoder, dflash, gamma_default=2, verifier=model)
    assert isinstance(drafter, LookupFirstDrafter) and spec.gamma == 4  # the block size - 1, not gamma_default
    assert (drafter.lookup.n_min, drafter.lookup.n_max, drafter.lookup.vocab_size) == (2, 3, model.config.vocab_size)
    with pytest.raises(ValueError, match="one chain"):
        speculative_setup(OmegaConf.merge(decoder, {"K": 2}), dflash, verifier=model)
    with pytest.raises(ValueError, match="plain transformer"):
        speculative_setup(decoder, model, verifier=model)
    with pytest.raises(ValueError, match="at most 4 tokens"):
        generate(model, [[1, 2]], SpecConfig(max_new_tokens=4, gamma=5), drafter=drafter)
    with pytest.raises(ValueError, match="one chain"):
        generate(model, [[1, 2]], SpecConfig(max_new_tokens=4, gamma=2, K=2), drafter=drafter)
