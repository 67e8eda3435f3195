"""Training windows from trajectories: coverage, labels, teacher top-k, packed = unpacked logits, resumable order."""

from collections import Counter
from itertools import islice

import datasets
import pytest
import torch

from streakline.alignment.data import TrajectoryWindows, WindowBatch, unpack_windows, window_logit_index
from streakline.data.trajectories import features
from streakline.models import Transformer
from tests.models.helpers import VOCAB, tiny_config

G, MASK, TOPK = 4, VOCAB - 1, 3
# (prompt length, completion length): one completion shorter than G, one of length 1, long ones spanning groups.
LENGTHS = [(3, 10), (1, 2), (5, 1), (2, 7), (4, 13)]


def _dataset(topk: bool = True, lengths=LENGTHS) -> datasets.Dataset:
    g = torch.Generator().manual_seed(0)
    cols = {k: [] for k in ("prompt_id", "sample_index", "seed", "finish_reason", "prompt_ids", "completion_ids")}
    if topk:
        cols.update(topk_ids=[], topk_logprobs=[])
    for r, (P, C) in enumerate(lengths):
        cols["prompt_id"].append(f"p{r}")
        cols["sample_index"].append(0)
        cols["seed"].append(r)
        cols["finish_reason"].append("eos")
        cols["prompt_ids"].append(torch.randint(0, MASK, (P,), generator=g).tolist())
        cols["completion_ids"].append(torch.randint(0, MASK, (C,), generator=g).tolist())
        if topk:
            cols["topk_ids"].append(torch.randint(0, MASK, (C, TOPK), generator=g).tolist())
            cols["topk_logprobs"].append((-torch.rand(C, TOPK, generator=g) * 5).tolist())
    # the features load_trajectories gives: int32 ids, float16 logprobs
    return datasets.Dataset.from_dict(cols, features=features(TOPK if topk else 0))


def _seq(ds, r) -> list[int]:
    return ds[r]["prompt_ids"] + ds[r]["completion_ids"]


def _one_epoch(w: TrajectoryWindows) -> WindowBatch:
    return next(w.batches(len(w)))  # batch 0 of size len(w) is exactly epoch 0


def _real_windows(batch: WindowBatch):
    for b, k in batch.window_valid.nonzero().tolist():
        yield b, k, int(batch.rows[b]), int(batch.offsets[b, k])


@pytest.mark.parametrize("stride", [1, 2])
def test_every_offset_once_per_epoch_with_labels(stride):
    ds = _dataset()
    w = TrajectoryWindows(ds, gamma=G, mask_id=MASK, stride=stride, windows_per_seq=3)
    expected = Counter((r, i) for r, (P, C) in enumerate(LENGTHS) for i in range(P, P + C, stride))
    assert len(w) == sum(-(-len(range(P, P + C, stride)) // 3) for P, C in LENGTHS)
    assert w.num_windows == sum(expected.values()) and w.dropped_windows == 0

    batch = _one_epoch(w)
    assert Counter((r, i) for _, _, r, i in _real_windows(batch)) == expected
    for b, k, r, i in _real_windows(batch):
        seq = _seq(ds, r)
        want = seq[i : i + G]
        n = len(want)
        assert batch.labels[b, k].tolist() == want + [MASK] * (G - n)
        assert batch.valid[b, k].tolist() == [True] * n + [False] * (G - n)
    # filler windows carry nothing
    filler = ~batch.window_valid
    assert filler.any() and not batch.valid[filler].any() and (batch.labels[filler] == MASK).all()
    # each row's clean part is seq up to the last label of its windows, then padding
    for b in range(len(batch.rows)):
        seq = _seq(ds, int(batch.rows[b]))
        last = int(batch.offsets[b][batch.window_valid[b]].max())
        L = min(len(seq), last + G)
        assert batch.pad_valid[b].tolist() == [True] * L + [False] * (batch.clean.shape[1] - L)
        assert batch.clean[b, :L].tolist() == seq[:L]
    assert batch.teacher_ids is None and batch.teacher_logprobs is None


def test_teacher_topk_is_the_stored_entry_of_each_slot():
    ds = _dataset()
    w = TrajectoryWindows(ds, gamma=G, mask_id=MASK, windows_per_seq=3, teacher=True)
    batch = _one_epoch(w)
    assert batch.teacher_ids.shape == batch.labels.shape + (TOPK,)
    assert batch.teacher_logprobs.dtype == torch.float32
    checked = 0
    for b, k, r, i in _real_windows(batch):
        P = len(ds[r]["prompt_ids"])
        for j in range(G):
            if batch.valid[b, k, j]:
                c = i + j - P
                assert batch.teacher_ids[b, k, j].tolist() == ds[r]["topk_ids"][c]
                want = torch.tensor(ds[r]["topk_logprobs"][c], dtype=torch.float32)
                torch.testing.assert_close(batch.teacher_logprobs[b, k, j], want, atol=0, rtol=0)
                checked += 1
    assert checked == int(batch.valid.sum()) > 0
    invalid = ~batch.valid
    assert (batch.teacher_ids[invalid] == 0).all() and (batch.teacher_logprobs[invalid] == 0).all()


def _model() -> Transformer:
    # std 0.2 (not the default) so attention is sharp enough that a wrong mask or position moves logits past 1e-5.
    cfg = tiny_config("qwen2", attention="prefix_causal", mask_token_id=MASK)
    return Transformer(cfg).init_weights(seed=0, std=0.2).eval()


@torch.no_grad()
@pytest.mark.parametrize(("shift", "pad"), [(False, 1), (True, 1), (True, 8)])
def test_packed_logits_equal_one_window_per_forward(shift, pad):
    model = _model()
    w = TrajectoryWindows(_dataset(), gamma=G, mask_id=MASK, windows_per_seq=3, seed=1, pad_multiple=pad)
    batch = next(w.batches(6))
    assert batch.clean.shape[1] % pad == 0
    packed = batch.pack(MASK, shift=shift)
    real = batch.window_valid
    assert (~real).any() and (~batch.valid[real]).any()  # the batch has filler windows and slots past the end
    torch.testing.assert_close(packed.labels[real], batch.labels[real], atol=0, rtol=0)
    torch.testing.assert_close(packed.valid, batch.valid, atol=0, rtol=0)
    got = packed.gather(model(packed.input_ids, position_ids=packed.position_ids, attn_mask=packed.attn_mask))[real]

    ids, attn, prefix_len, labels, valid = unpack_windows(batch, MASK)
    assert (
        ids.shape[0] == int(real.sum())
        and torch.equal(labels, batch.labels[real])
        and torch.equal(valid, batch.valid[real])
    )
    index = window_logit_index(prefix_len, G, shift)
    rows = torch.arange(len(ids))[:, None]
    want = model(ids, attention_mask=attn, prefix_len=prefix_len)[rows, index]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # right padding changes nothing: each window alone, unpadded, gives the same logits
    for n in range(len(ids)):
        alone = model(ids[n, attn[n]][None], prefix_len=int(prefix_len[n]))[0, index[n]]
        torch.testing.assert_close(alone, want[n], atol=1e-5, rtol=0)


def test_pack_refuses_labels_that_disagree():
    batch = _one_epoch(TrajectoryWindows(_dataset(), gamma=G, mask_id=MASK, windows_per_seq=3))
    with pytest.raises(RuntimeError, match="mask_id"):
        batch.pack(MASK - 1, shift=False)


def _assert_batches_equal(a: WindowBatch, b: WindowBatch) -> None:
    for name in ("clean", "pad_valid", "offsets", "window_valid", "labels", "valid", "rows"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_resume_reproduces_the_stream():
    ds = _dataset()
    w = TrajectoryWindows(ds, gamma=G, mask_id=MASK, windows_per_seq=3, seed=7)
    stream = list(islice(w.batches(3), 7))
    resumed = list(islice(w.batches(3, start=4), 3))
    for a, b in zip(resumed, stream[4:7], strict=True):
        _assert_batches_equal(a, b)
    # same seed, new object: same stream; another seed: another stream
    again = list(islice(TrajectoryWindows(ds, gamma=G, mask_id=MASK, windows_per_seq=3, seed=7).batches(3), 7))
    for a, b in zip(again, stream, strict=True):
        _assert_batches_equal(a, b)
    other = next(TrajectoryWindows(ds, gamma=G, mask_id=MASK, windows_per_seq=3, seed=8).batches(len(w)))
    first = next(w.batches(len(w)))
    assert not torch.equal(other.rows, first.rows) or not torch.equal(other.offsets, first.offsets)


def test_epochs_are_reshuffled_and_the_stream_is_their_concatenation():
    w = TrajectoryWindows(_dataset(), gamma=G, mask_id=MASK, windows_per_seq=3, seed=3)
    E = len(w)
    e0, e1 = w.epoch_order(0), w.epoch_order(1)
    assert sorted(e0.tolist()) == list(range(E)) and sorted(e1.tolist()) == list(range(E))
    assert not torch.equal(e0, e1)
    # batches of 5 cross the epoch boundary (E = 14); stream position p is example order[p // E][p % E]
    order = torch.cat([e0, e1])
    n = 2 * E // 5
    assert any(5 * s < E < 5 * s + 5 for s in range(n))
    for s, batch in enumerate(islice(w.batches(5), n)):
        _assert_batches_equal(batch, w.collate(order[5 * s : 5 * s + 5].tolist()))


def _bimodal(n: int = 24) -> datasets.Dataset:
    # half the trajectories short, half long, one window group each (completions of G - 1 tokens, W = 3)
    return _dataset(topk=False, lengths=[(2, G - 1) if r % 2 else (40, G - 1) for r in range(n)])


def test_length_grouping_puts_rows_of_one_length_in_a_batch():
    ds = _bimodal()
    drawn = TrajectoryWindows(ds, gamma=G, mask_id=MASK, windows_per_seq=3, seed=5)
    grouped = TrajectoryWindows(ds, gamma=G, mask_id=MASK, windows_per_seq=3, seed=5, length_grouping=6)
    E = len(grouped)
    assert E == 24

    def mixed(w: TrajectoryWindows) -> int:  # batches of 4 holding both a short and a long row, over epoch 0
        return sum(len(set(b.pad_valid.sum(1).tolist())) > 1 for b in islice(w.batches(4), E // 4))

    # one run of 6 batches spans the epoch, sorted: 12 short rows fill 3 batches exactly, 12 long ones the rest
    assert mixed(grouped) == 0
    assert mixed(drawn) > 0  # drawn at random, some batch mixes (this seed: most do)
    assert grouped.real_share(4) == 1.0 > grouped.real_share(4, grouped=False) == drawn.real_share(4)
    # still every example once an epoch, and the same batches for the same seed
    for epoch in range(3):
        order = grouped.epoch_order(epoch, 4)
        assert sorted(order.tolist()) == list(range(E))
    assert not torch.equal(grouped.epoch_order(0, 4), grouped.epoch_order(1, 4))
    assert torch.equal(drawn.epoch_order(0, 4), grouped.epoch_order(0, 1))  # batches of 1: nothing to group


def test_length_grouping_keeps_batch_boundaries_across_epochs_and_resumes():
    # E = 24 examples in batches of 5: batch 4 holds the last 4 of epoch 0 and the first of epoch 1
    w = TrajectoryWindows(_bimodal(), gamma=G, mask_id=MASK, windows_per_seq=3, seed=2, length_grouping=2)
    B = 5
    order = torch.cat([w.epoch_order(e, B) for e in range(3)])
    stream = list(islice(w.batches(B), 14))
    for s, batch in enumerate(stream):
        _assert_batches_equal(batch, w.collate(order[B * s : B * s + B].tolist()))
    # epoch 1's head (the one position finishing batch 4) stays first, so its runs of 2 batches start at batch 5:
    # batches 5-6 and 7-8 are each one sorted run, whichever batch of it comes first
    lengths = [b.pad_valid.sum(1) for b in stream]
    for first in (5, 7):
        a, b = lengths[first], lengths[first + 1]
        assert a.max() <= b.min() or b.max() <= a.min()
    for a, b in zip(list(islice(w.batches(B, start=6), 8)), stream[6:14], strict=True):
        _assert_batches_equal(a, b)
    with pytest.raises(ValueError, match="length_grouping must be >= 0"):
        TrajectoryWindows(_bimodal(), gamma=G, mask_id=MASK, length_grouping=-1)


def test_max_len_drops_windows_that_reach_past_it():
    ds = _dataset()
    max_len = 8
    w = TrajectoryWindows(ds, gamma=G, mask_id=MASK, windows_per_seq=3, max_len=max_len)
    expected = Counter((r, i) for r, (P, C) in enumerate(LENGTHS) for i in range(P, P + C) if i + G <= max_len)
    full = sum(C for _, C in LENGTHS)
    assert w.num_windows == sum(expected.values()) and w.dropped_windows == full - w.num_windows > 0
    batch = _one_epoch(w)
    assert Counter((r, i) for _, _, r, i in _real_windows(batch)) == expected
    # trajectory 2 (P = 5) has no offset with 5 + G <= 8: nothing of it is left
    assert 2 not in batch.rows.tolist()
    assert batch.clean.shape[1] <= max_len
    for b, k, r, i in _real_windows(batch):  # labels are untouched by the limit: nothing was truncated
        want = _seq(ds, r)[i : i + G]
        assert batch.labels[b, k, : len(want)].tolist() == want
    ids, _, prefix_len, _, _ = unpack_windows(batch, MASK)
    assert ids.shape[1] <= max_len and int(prefix_len.max()) + G <= max_len
    assert int(batch.pack(MASK, shift=True).position_ids.max()) < max_len
    with pytest.raises(ValueError, match="no draft windows"):
        TrajectoryWindows(_dataset(lengths=[(5, 3), (6, 1)]), gamma=G, mask_id=MASK, max_len=G + 1)


def test_padding_to_a_multiple_repeats_shapes_and_changes_nothing_else():
    """pad_multiple right-pads the clean rows with masks (pad_valid False) to a multiple of it, never past max_len;
    every other field of the batch is the unpadded one's."""
    ds = _dataset()
    plain = TrajectoryWindows(ds, gamma=G, mask_id=MASK, windows_per_seq=3, seed=2)
    examples = list(range(len(plain)))
    a = plain.collate(examples)
    T = a.clean.shape[1]
    for multiple, max_len, want in [(8, None, 24), (5, None, 20), (1, None, T), (64, 19, 19), (64, T, T)]:
        w = TrajectoryWindows(ds, gamma=G, mask_id=MASK, windows_per_seq=3, seed=2, pad_multiple=multiple,
                              max_len=max_len)  # fmt: skip
        if max_len is not None and w.num_windows != plain.num_windows:
            continue  # a max_len below a window's reach drops windows: not this comparison
        b = w.collate(examples)
        assert b.clean.shape == (len(examples), want)
        assert torch.equal(b.clean[:, :T], a.clean) and (b.clean[:, T:] == MASK).all()
        assert torch.equal(b.pad_valid[:, :T], a.pad_valid) and not b.pad_valid[:, T:].any()
        for name in ("offsets", "window_valid", "labels", "valid", "rows"):
            assert torch.equal(getattr(b, name), getattr(a, name)), name
    assert T == 17  # the longest trajectory, (4, 13); the cases above are chosen around it
    with pytest.raises(ValueError, match="pad_multiple must be >= 1"):
        TrajectoryWindows(ds, gamma=G, mask_id=MASK, pad_multiple=0)


def test_teacher_without_topk_names_the_fix():
    with pytest.raises(ValueError, match=r"data\.topk_logprobs=20 in stage=trajectories"):
        TrajectoryWindows(_dataset(topk=False), gamma=G, mask_id=MASK, teacher=True)


def test_empty_completion_gives_no_examples():
    ds = _dataset(lengths=[(3, 0), (2, 2)])
    w = TrajectoryWindows(ds, gamma=G, mask_id=MASK, windows_per_seq=4)
    assert len(w) == 1 and w.windows_per_seq == 2  # capped at the most offsets any trajectory has
    batch = _one_epoch(w)
    assert batch.rows.tolist() == [1] and batch.offsets.tolist() == [[2, 3]]
