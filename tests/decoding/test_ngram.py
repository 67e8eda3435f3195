"""decoder=ngram (``decoding/ngram.py``): the lookup itself on hand-made contexts, then the decoder's losslessness
as for every drafter: identical greedy output to vanilla (ragged batches, both engines' widths), and the verifier's
distribution at T=1 (chi-square on the first two tokens, two acceptance rules)."""

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from streakline.decoding.ngram import NgramDrafter, lookup
from streakline.decoding.registry import needs_drafter_model, speculative_setup
from streakline.decoding.speculative import SpecConfig, generate
from tests.decoding.helpers import decoder_settings, sampled_pairs, verifier


def _look(context, n_min=1, n_max=3, k=4) -> list[int]:
    return lookup(np.array(context), n_min=n_min, n_max=n_max, k=k).tolist()


def test_lookup_takes_the_latest_occurrence_of_the_longest_suffix():
    assert _look([5, 6, 7, 9, 5, 6]) == [7, 9, 5, 6]  # "5 6" occurred once before: what followed it
    assert _look([5, 6, 1, 5, 6, 2, 5, 6]) == [2, 5, 6]  # the latest of two earlier occurrences
    # "4 5 6" (n=3) occurred earlier, and "5 6" later; the longer match wins
    assert _look([4, 5, 6, 1, 9, 5, 6, 2, 4, 5, 6]) == [1, 9, 5, 6]
    assert _look([5, 6, 7, 9, 5, 6], k=2) == [7, 9]  # at most k tokens
    assert _look([1, 2, 3, 4]) == []  # nothing repeats
    assert _look([3, 1, 2, 3], n_min=2) == []  # only a 1-token match, below n_min
    assert _look([3, 1, 2, 3], n_min=1) == [1, 2, 3]
    assert _look([7, 7, 7]) == [7]  # the suffix itself is no occurrence: "7 7" at 0 is followed by one 7
    assert _look([7]) == [] and _look([]) == []


def _repetitive_prompts() -> list[list[int]]:
    """Ragged prompts with repeats, so lookups match and some drafts are right."""
    return [[1, 2, 3, 4, 1, 2, 3], [5, 6, 5, 6, 5], [2, 9, 4, 2, 9, 4, 2, 9, 4, 2, 9], [7, 8]]


class Recording(NgramDrafter):
    """Keeps the width of every proposal."""

    def propose(self, *a, **kw):
        out = super().propose(*a, **kw)
        self.widths = [*getattr(self, "widths", []), out.tokens.shape[-1]]
        return out


@pytest.mark.parametrize("engine", ["eager", "static"])
def test_ngram_greedy_output_is_vanillas(engine):
    model = verifier(seed=3)
    prompts = _repetitive_prompts()
    want = generate(model, prompts, SpecConfig(max_new_tokens=40, eos_token_id=5)).tokens
    for rule in ("greedy_acceptance", "exact_greedy", "leviathan"):
        drafter = NgramDrafter(n_max=3, n_min=1, vocab_size=model.config.vocab_size)
        cfg = SpecConfig(max_new_tokens=40, gamma=4, acceptance=rule, eos_token_id=5, engine=engine)
        res = generate(model, prompts, cfg, drafter=drafter)
        assert res.tokens == want, rule
        assert res.metrics.accepted > 0  # drafts were right sometimes: the accepting path ran
        assert res.metrics.drafter_forwards == 0  # no model drafted
    assert drafter.trim is (engine == "eager")


def test_ngram_drafts_fewer_on_eager_and_gamma_on_static():
    """Eager: a cycle is as wide as the batch's longest match, so a prompt without repeats starts with plain verifier
    steps. Static: always gamma wide. The per-slot acceptance counts only slots that were drafted."""
    model = verifier(seed=3)
    widths = {}
    for engine in ("eager", "static"):
        drafter = Recording(vocab_size=model.config.vocab_size)
        cfg = SpecConfig(max_new_tokens=12, gamma=6, engine=engine)
        res = generate(model, [[1, 2, 3, 4]], cfg, drafter=drafter)
        widths[engine] = seen = drafter.widths
        assert sum(res.metrics.reached_at[1:]) <= sum(seen)  # slot j+1 reached only where j+1 tokens were drafted
    assert widths["eager"][0] == 0 and min(widths["eager"]) == 0  # no repeat in the prompt: nothing to draft
    assert set(widths["static"]) == {6}


def test_ngram_q_is_a_point_mass_built_only_on_demand():
    """The proposal carries no [B, G, V] q (the hot path of greedy rules never reads one); distribution() gives the
    one-hot of the chain that the q-reading rules need."""
    drafter = NgramDrafter(n_max=2, n_min=1, vocab_size=10)
    drafter.reset(2, 32)
    prop = drafter.propose(torch.tensor([[1, 2, 3, 1, 2], [4, 5, 4, 5, 4]]), None, gamma=3, K=1, generator=None,
                           iid=False)  # fmt: skip
    assert prop.q is None
    q = prop.distribution()
    assert q.shape == (2, prop.tokens.shape[-1], 10)
    assert torch.equal(q.argmax(-1), prop.tokens[:, 0]) and torch.equal(q.sum(-1), torch.ones(q.shape[:2]))


def test_ngram_sampling_follows_the_verifier():
    model = verifier(seed=11, vocab=6)
    drafter = NgramDrafter(n_max=2, n_min=1, vocab_size=6)
    prompt = [1, 2, 3, 1, 2]  # "1 2" occurred before: the lookup drafts 3 1 2 at the first cycle
    for rule, (res, p) in sampled_pairs(model, drafter, prompt, 4000).items():
        assert res.metrics.accepted > 0, rule
        assert p > 1e-3, rule


def test_ngram_setup_needs_no_drafter_model():
    model = verifier(seed=3)
    decoder = decoder_settings("ngram")
    assert not needs_drafter_model("ngram") and needs_drafter_model("ar_draft") and not needs_drafter_model("vanilla")
    spec, drafter = speculative_setup(decoder, None, gamma_default=5, verifier=model)
    assert isinstance(drafter, NgramDrafter) and spec.gamma == 5 and (drafter.n_min, drafter.n_max) == (2, 3)
    with pytest.raises(ValueError, match="one chain"):
        speculative_setup(OmegaConf.merge(decoder, {"K": 2}), None, gamma_default=5, verifier=model)
    with pytest.raises(ValueError, match="ngram_min <= decoder.ngram_max"):
        NgramDrafter(n_max=1, n_min=2, vocab_size=4)
    with pytest.raises(ValueError, match="one chain"):
        generate(model, [[1, 2]], SpecConfig(max_new_tokens=2, K=2), drafter=NgramDrafter(vocab_size=13))
