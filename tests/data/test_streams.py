"""Token streams: documents joined with eos, windows sampled reproducibly, aligned windows start at documents."""

import pytest
import torch

from streakline.data.streams import TokenStream, mixed_batch


class CharTokenizer:
    """A stand-in tokenizer with the call signature the stream uses: one id per character, eos = 0."""

    eos_token_id = 0

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[ord(c) for c in t] for t in texts]}


def test_documents_are_joined_with_eos_and_starts_recorded():
    s = TokenStream.from_texts(["ab", "cde", "f"], CharTokenizer(), "t", batch=2)
    assert s.ids.tolist() == [97, 98, 0, 99, 100, 101, 0, 102, 0]
    assert s.doc_starts.tolist() == [0, 3, 7]


def test_sampling_is_reproducible_and_in_range():
    s = TokenStream(torch.arange(100), "n")
    a = s.sample(4, 10, torch.Generator().manual_seed(1))
    b = s.sample(4, 10, torch.Generator().manual_seed(1))
    assert torch.equal(a, b) and a.shape == (4, 10)
    assert torch.equal(a[:, 1:] - a[:, :-1], torch.ones(4, 9, dtype=torch.long))  # contiguous windows
    with pytest.raises(ValueError, match="fewer than one window"):
        s.sample(1, 100, torch.Generator())


def test_aligned_windows_start_at_documents():
    texts = [c * n for c, n in zip("abcde", (5, 9, 3, 12, 7), strict=True)]
    s = TokenStream.from_texts(texts, CharTokenizer(), "m", aligned=True)
    allowed = {tuple(s.ids[i : i + 4].tolist()) for i in s.doc_starts.tolist() if i < len(s) - 4}
    batch = s.sample(64, 4, torch.Generator().manual_seed(0))
    assert {tuple(row.tolist()) for row in batch} <= allowed
    assert len({tuple(row.tolist()) for row in batch}) > 1


def test_mixed_batch_follows_weights():
    a, b = TokenStream(torch.zeros(50, dtype=torch.long)), TokenStream(torch.ones(50, dtype=torch.long))
    batch = mixed_batch([a, b], [0.0, 1.0], 8, 5, torch.Generator().manual_seed(0))
    assert batch.eq(1).all()
    batch = mixed_batch([a, b], [0.5, 0.5], 400, 1, torch.Generator().manual_seed(0))
    assert 150 < int(batch.sum()) < 250
