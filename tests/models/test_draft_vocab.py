"""Draft vocabularies (``streakline/models/draft_vocab.py``): the most frequent ids with the kept ones, ties to the
lower id, ``speculators``' maps (``t2d`` mask, ``d2t`` offsets) written and read back, the id maps inverse to each
other, the draft head the target head's rows, coverage, and bad sizes or maps refused.

    python -m pytest tests/models/test_draft_vocab.py -q
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from streakline.models.draft_vocab import DraftVocab, DraftVocabError, count_tokens

V = 12


def test_counts_and_the_most_frequent_ids_with_the_kept_ones():
    counts = count_tokens([[3, 3, 3, 7, 7, 1], [7, 5, 5, 11, 0]], V)
    assert counts.tolist() == [1, 1, 0, 3, 0, 2, 0, 3, 0, 0, 0, 1]
    # 3 and 7 lead (3 each), then 5 (2); of the ids counted once, the lowest (0) takes the last place
    assert DraftVocab.from_counts(counts, 4).ids.tolist() == [0, 3, 5, 7]
    # eos (say 9, never seen) is kept whatever its count, displacing the last of the others
    assert DraftVocab.from_counts(counts, 4, keep=[9]).ids.tolist() == [3, 5, 7, 9]
    assert DraftVocab.from_counts(counts, V).ids.tolist() == list(range(V))  # N = V: the whole vocabulary
    with pytest.raises(DraftVocabError, match="token ids must lie"):
        count_tokens([[V]], V)


def test_the_maps_are_speculators_and_read_back():
    vocab = DraftVocab(torch.tensor([0, 3, 5, 7, 9]), V)
    t2d, d2t = vocab.maps()
    assert t2d.dtype == torch.bool and t2d.shape == (V,) and int(t2d.sum()) == vocab.size
    assert d2t.dtype == torch.long and d2t.shape == (vocab.size,)
    draft = torch.arange(vocab.size)
    assert (draft + d2t).tolist() == [0, 3, 5, 7, 9]  # target id = draft id + d2t[draft id]
    assert torch.nonzero(t2d).flatten().tolist() == [0, 3, 5, 7, 9]
    assert torch.equal(DraftVocab.from_maps(t2d, d2t).ids, vocab.ids)
    # maps that disagree: a mask of another size, offsets sending a draft id elsewhere
    with pytest.raises(DraftVocabError, match="marks 4 target ids but d2t maps 5"):
        DraftVocab.from_maps(t2d.clone().index_fill_(0, torch.tensor([9]), False), d2t)
    with pytest.raises(DraftVocabError, match="does not send each draft id"):
        DraftVocab.from_maps(t2d, d2t + torch.tensor([0, 0, 1, 0, 0]))


def test_ids_map_both_ways_and_the_head_is_the_target_heads_rows():
    vocab = DraftVocab(torch.tensor([1, 4, 6]), V)
    targets = torch.tensor([[4, 2, 6], [1, 11, 4]])
    drafts = vocab.to_draft(targets)
    assert drafts.tolist() == [[1, -1, 2], [0, -1, 1]]  # -1: outside the draft vocabulary
    inside = drafts >= 0
    assert torch.equal(vocab.to_target(drafts[inside]), targets[inside])
    weight = torch.randn(V, 5)
    hidden = torch.randn(3, 5)
    head = vocab.head(weight)
    # the draft logits are the target logits at the draft ids: nothing else changes
    torch.testing.assert_close(hidden @ head.T, (hidden @ weight.T)[:, vocab.ids], rtol=1e-6, atol=1e-6)
    with pytest.raises(DraftVocabError, match="a head of 11 rows"):
        vocab.head(weight[:-1])


def test_coverage_is_the_share_of_tokens_inside():
    vocab = DraftVocab(torch.tensor([0, 2]), 4)
    assert vocab.coverage(np.array([5, 1, 3, 1])) == pytest.approx(8 / 10)
    assert DraftVocab.from_counts(np.array([5, 1, 3, 1]), 4).coverage(np.array([5, 1, 3, 1])) == 1.0


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: DraftVocab.from_counts(np.ones(V), 0), "choose 1 .. 12"),
        (lambda: DraftVocab.from_counts(np.ones(V), V + 1), "choose 1 .. 12"),
        (lambda: DraftVocab.from_counts(np.ones(V), 2, keep=[1, 2, 3]), "at most 2 target ids"),
        (lambda: DraftVocab.from_counts(np.ones(V), 2, keep=[V]), "at most 2 target ids"),
        (lambda: DraftVocab(torch.tensor([3, 1]), V), "increasing order"),
        (lambda: DraftVocab(torch.tensor([3, 3]), V), "increasing order"),
        (lambda: DraftVocab(torch.tensor([0, V]), V), r"target ids in \[0, 12\)"),
        (lambda: DraftVocab(torch.tensor([], dtype=torch.long), V), "non-empty"),
    ],
)
def test_bad_sizes_and_ids_are_refused(make, message):
    with pytest.raises(DraftVocabError, match=message):
        make()
