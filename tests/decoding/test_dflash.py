"""Speculative decoding with a DFlash drafter (``decoding.drafters.DFlashDrafter``): lossless at temperature 0 and
1, and every proposal drafted from exactly the verifier states of the committed tokens (checked against a fresh
uncached forward over the whole sequence at every cycle, with K > 1 trees and rows leaving the batch)."""

from __future__ import annotations

import pytest
import torch

from streakline.decoding.drafters import DFlashDrafter
from streakline.decoding.speculative import SpecConfig, generate
from streakline.models import Transformer, TransformerConfig
from streakline.models.dflash import DFlashConfig, DFlashModel, block_inputs
from tests.decoding.helpers import V, sampled_pairs, verifier


def _dflash(model: Transformer, layers=(1, 2), block: int = 6, seed: int = 2, std: float = 0.1) -> DFlashModel:
    v = model.config
    shapes = TransformerConfig(
        vocab_size=v.vocab_size, hidden_size=v.hidden_size, intermediate_size=2 * v.hidden_size, num_layers=2,
        num_heads=v.num_heads, num_kv_heads=v.num_kv_heads, family="qwen3", qk_norm=True, attention="full",
    )  # fmt: skip
    cfg = DFlashConfig(layers=shapes, target_layer_ids=layers, block_size=block, mask_token_id=v.vocab_size - 1)
    return DFlashModel(cfg).init_weights(seed=seed, std=std).share(model).eval()


class CheckedDFlash(DFlashDrafter):
    """Checks every proposal against the uncached drafter forward over the verifier's states of each row's whole
    committed sequence, recomputed from scratch (so the features ``generate`` passes must be the right ones)."""

    def __init__(self, model, verifier_model, **kw) -> None:
        super().__init__(model, **kw)
        self.verifier = verifier_model
        self.worst, self.checks = 0.0, 0

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
        out = super().propose(
            new_ids, new_valid, gamma=gamma, K=K, generator=generator, iid=iid, features=features,
            feature_valid=feature_valid,
        )  # fmt: skip
        for r, seq in enumerate(self.seqs):
            want = scratch_q(self, self.verifier, seq, gamma)
            self.worst = max(self.worst, float((want - out.q[r]).abs().max()))
            self.checks += 1
        return out


@torch.no_grad()
def scratch_q(drafter: DFlashDrafter, verifier_model: Transformer, seq: list[int], gamma: int) -> torch.Tensor:
    """``[gamma, V]``: what ``drafter`` should propose after committed sequence ``seq`` (its last token pending),
    from an uncached drafter forward over the verifier's states of the whole sequence, recomputed from scratch."""
    n = len(seq) - 1
    context = torch.tensor([seq[:-1]], dtype=torch.long)
    feats = verifier_model.hidden(context, aux_layers=drafter.feature_layers)[1] if n else None
    logits = drafter.model(
        block_inputs(torch.tensor([seq[-1]]), gamma + 1, drafter.model.dflash.mask_token_id),
        torch.arange(n, n + gamma + 1)[None],
        features=feats,
        feature_pos=torch.arange(n)[None] if n else None,
    )[0, 1:]
    return torch.softmax(logits / drafter.temperature, -1)


PROMPTS = [[1, 2, 3, 4, 5], [6], [7, 8, 9, 1, 2, 3, 4, 5, 6], [3, 3]]


@pytest.mark.parametrize(("K", "gamma", "acceptance"), [(1, 5, "greedy_acceptance"), (3, 3, "greedy_acceptance"),
                                                        (1, 4, "leviathan")])  # fmt: skip
def test_dflash_drafting_is_exact_greedy_and_reads_the_right_states(K, gamma, acceptance):
    model = verifier(seed=7)  # eos 5 ends rows 1 and 3 early, rows 0 and 2 run to the length
    want = generate(model, PROMPTS, SpecConfig(max_new_tokens=24, eos_token_id=5)).tokens
    drafter = CheckedDFlash(_dflash(model), model, temperature=1.0, top_k=None)
    cfg = SpecConfig(max_new_tokens=24, gamma=gamma, K=K, acceptance=acceptance, eos_token_id=5, seed=K)
    res = generate(model, PROMPTS, cfg, drafter=drafter)
    assert res.tokens == want
    assert any(r == "eos" for r in res.finish_reasons) and any(r == "length" for r in res.finish_reasons)
    assert drafter.checks >= res.metrics.cycles  # one check per row per cycle
    assert drafter.worst < 1e-5
    assert res.metrics.alpha[0] > 0  # drafts were accepted, so the accepted-path states were exercised


V6, SAMPLES = 6, 4000  # the sampling tests: a 6-token verifier, its first two tokens drawn this many times
SAMPLED_PROMPT = [1, 2, 3]


def test_dflash_sampling_follows_the_verifier():
    model = verifier(seed=11, vocab=V6)
    drafter = DFlashDrafter(_dflash(model, std=0.3), temperature=1.0, top_k=None)
    for rule, (res, p) in sampled_pairs(model, drafter, SAMPLED_PROMPT, SAMPLES).items():
        assert res.metrics.alpha[0] > 0.1  # a 6-token vocabulary: drafts are often right
        assert p > 1e-3, rule


def test_dflash_refuses_more_drafts_than_its_block_and_a_plain_model():
    model = verifier(seed=5)
    drafter = DFlashDrafter(_dflash(model, block=4))
    with pytest.raises(ValueError, match="at most 3 tokens"):
        generate(model, [[1, 2]], SpecConfig(max_new_tokens=4, gamma=4), drafter=drafter)
    with pytest.raises(ValueError, match="DFlash drafter model"):
        DFlashDrafter(model)
    assert V > 6  # the exactness test above uses the 13-token helpers' vocabulary


class RecordingDFlash(DFlashDrafter):
    """Keeps every drafted token id, to check none lies outside the draft vocabulary."""

    def propose(self, *args, **kw):
        out = super().propose(*args, **kw)
        self.drafted = getattr(self, "drafted", set()) | set(out.tokens.flatten().tolist())
        return out


def test_a_draft_vocabulary_never_drafts_outside_it_and_stays_lossless():
    """A drafter over N of the V tokens (``DFlashModel.use_vocab``): its q is 0 outside them, so they are never
    drafted, and the output is still exactly the verifier's, greedy and sampled (chi-square)."""
    from streakline.models.draft_vocab import DraftVocab

    model = verifier(seed=7)
    vocab = DraftVocab(torch.tensor([0, 2, 3, 5, 8, 11]), V)  # the eos 5 among them
    want = generate(model, PROMPTS, SpecConfig(max_new_tokens=24, eos_token_id=5)).tokens
    drafter = RecordingDFlash(_dflash(model).use_vocab(vocab), temperature=1.0, top_k=None)
    for K, rule in ((1, "greedy_acceptance"), (3, "greedy_acceptance"), (1, "leviathan")):
        cfg = SpecConfig(max_new_tokens=24, gamma=4, K=K, acceptance=rule, eos_token_id=5, seed=K)
        res = generate(model, PROMPTS, cfg, drafter=drafter)
        assert res.tokens == want, (K, rule)
    assert drafter.drafted and drafter.drafted <= set(vocab.ids.tolist())
    assert any(t not in vocab.ids.tolist() for seq in want for t in seq)  # the verifier wrote tokens outside it

    small = verifier(seed=11, vocab=V6)
    sampler = DFlashDrafter(_dflash(small, std=0.3).use_vocab(DraftVocab(torch.tensor([0, 2, 3, 4]), V6)),
                            temperature=1.0, top_k=None)  # fmt: skip
    for rule, (_, p) in sampled_pairs(small, sampler, SAMPLED_PROMPT, SAMPLES).items():
        assert p > 1e-3, rule
