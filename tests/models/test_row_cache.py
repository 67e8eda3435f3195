"""``RowCache`` (``models/row_cache.py``): rows of their own lengths, refilled and packed, give each row the logits
of that row run alone.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/models/test_row_cache.py
"""

from __future__ import annotations

import pytest
import torch

from streakline.models import Transformer, row_cache
from streakline.models.row_cache import RowCache
from tests.models.helpers import tiny_config


def _alone(model, seq):
    with torch.no_grad():
        return model(torch.tensor([seq]))[0, -1]


@pytest.mark.parametrize("chunk", [16, 2])  # all rows in one chunk, or chunks of 2 with their own key spans
@torch.no_grad()
def test_rows_of_different_lengths_refilled_and_packed_match_each_row_alone(chunk, monkeypatch):
    monkeypatch.setattr(row_cache, "CHUNK", chunk)
    model = Transformer(tiny_config("llama")).init_weights(seed=2).eval()
    cache = RowCache.for_model(model, rows=3, capacity=16)
    seqs = [[3, 4, 5, 6, 7], [8, 9], [10, 11, 12]]
    ids = torch.zeros(3, 5, dtype=torch.long)
    valid = torch.zeros(3, 5, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, : len(s)], valid[b, : len(s)] = torch.tensor(s), 1
    h = model.hidden(ids, position_ids=cache.positions(5), attention_mask=valid, cache=cache)  # right-padded prefill
    assert cache.lengths.tolist() == [5, 2, 3]
    for b, s in enumerate(seqs):
        torch.testing.assert_close(model.logits(h[b, len(s) - 1]), _alone(model, s), atol=1e-5, rtol=1e-5)
    # row 1 ends; a new prompt takes its slot while the others keep their keys
    cache.empty(torch.tensor([1]))
    cache.use_rows(torch.tensor([1]))
    seqs[1] = [20, 21, 22, 23]
    model.hidden(torch.tensor([seqs[1][:-1]]), position_ids=cache.positions(3), cache=cache)
    cache.use_rows(None)
    step = torch.tensor([[13], [seqs[1][-1]], [14]])
    seqs[0].append(13), seqs[2].append(14)
    logits = model(step, position_ids=cache.positions(1), cache=cache)[:, -1]
    for b, s in enumerate(seqs):
        torch.testing.assert_close(logits[b], _alone(model, s), atol=1e-5, rtol=1e-5)
    cache.keep_rows(torch.tensor([2, 0]))  # pack: row 1 is gone for good, the others swap places
    logits = model(torch.tensor([[15], [16]]), position_ids=cache.positions(1), cache=cache)[:, -1]
    torch.testing.assert_close(logits[0], _alone(model, seqs[2] + [15]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[1], _alone(model, seqs[0] + [16]), atol=1e-5, rtol=1e-5)


def test_a_row_past_the_capacity_is_refused():
    model = Transformer(tiny_config("qwen2")).init_weights(seed=1).eval()
    cache = RowCache.for_model(model, rows=2, capacity=4)
    with torch.no_grad(), pytest.raises(ValueError, match="capacity of 4"):
        model.hidden(torch.ones(2, 5, dtype=torch.long), position_ids=cache.positions(5), cache=cache)


def test_only_causal_attention_is_served():
    model = Transformer(tiny_config("dream")).init_weights(seed=1).eval()
    cache = RowCache.for_model(model, rows=1, capacity=8)
    with torch.no_grad(), pytest.raises(ValueError, match="causal"):
        model.hidden(torch.ones(1, 2, dtype=torch.long), position_ids=cache.positions(2), cache=cache)
