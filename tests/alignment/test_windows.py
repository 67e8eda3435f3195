"""Packed draft windows give the same logits, loss and gradients as one window per forward (prefix_causal)."""

import pytest
import torch
import torch.nn.functional as F

from streakline.alignment.windows import pack_windows, window_input, window_labels
from streakline.models import Transformer
from tests.models.helpers import VOCAB, tiny_config

B, T, K, W = 2, 13, 3, 5
MASK = VOCAB - 1


def _model() -> Transformer:
    # std 0.2 (not the default 0.02) so attention is sharp enough that a wrong mask moves logits far past 1e-5.
    return Transformer(tiny_config("qwen2", attention="prefix_causal")).init_weights(seed=5, std=0.2).eval()


def _clean(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB - 1, (B, T), generator=torch.Generator().manual_seed(seed))


# Row 0 has a window overlapping the end (offset 11: two valid slots); row 1 repeats an offset.
OFFSETS = torch.tensor([[1, 6, 11], [4, 4, 9]])


def _unpacked_slot_logits(model, clean, offsets, shift, fill=None):
    """``[B, K, W, V]`` logits predicting each slot, one forward per window."""
    out = torch.empty(B, K, W, VOCAB)
    for b in range(B):
        for k in range(K):
            i = int(offsets[b, k])
            ids, P = window_input(clean[b], i, W, MASK, None if fill is None else fill[b, k])
            logits = model(ids[None], prefix_len=P)[0]
            # Shifted: the logit at position i+j-1 predicts slot j (0-indexed), so slot 0 reads the last clean token.
            out[b, k] = logits[i - 1 : i + W - 1] if shift else logits[i : i + W]
    return out


def _packed_forward(model, packed):
    return model(packed.input_ids, position_ids=packed.position_ids, attn_mask=packed.attn_mask)


@torch.no_grad()
@pytest.mark.parametrize("shift", [False, True])
def test_packed_slot_logits_match_one_window_per_forward(shift):
    model, clean = _model(), _clean()
    packed = pack_windows(clean, OFFSETS, W, MASK, shift=shift)
    assert packed.input_ids.shape == (B, T + K * W) and packed.attn_mask.shape == (B, T + K * W, T + K * W)
    got = packed.gather(_packed_forward(model, packed))
    want = _unpacked_slot_logits(model, clean, OFFSETS, shift)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    if shift:
        torch.testing.assert_close(packed.logit_index[:, :, 0], OFFSETS - 1)
        torch.testing.assert_close(packed.logit_index[:, :, 1:], packed.slot_index[:, :, :-1])
    else:
        torch.testing.assert_close(packed.logit_index, packed.slot_index)

    # The comparison has teeth: letting window 1 of row 0 see one more clean token moves its logits well past 1e-5.
    leaky = packed.attn_mask.clone()
    slots = packed.slot_index[0, 1]
    leaky[0, slots, int(OFFSETS[0, 1])] = True
    moved = model(packed.input_ids, position_ids=packed.position_ids, attn_mask=leaky)
    assert (moved[0, slots] - _packed_forward(model, packed)[0, slots]).abs().max() > 1e-3


@torch.no_grad()
@pytest.mark.parametrize("shift", [False, True])
def test_fill_reveals_slots_identically(shift):
    model, clean = _model(), _clean(1)
    g = torch.Generator().manual_seed(3)
    reveal = torch.rand(B, K, W, generator=g) < 0.4
    truth = torch.randint(0, VOCAB - 1, (B, K, W), generator=g)
    fill = torch.where(reveal, truth, torch.full_like(truth, MASK))
    packed = pack_windows(clean, OFFSETS, W, MASK, shift=shift, fill=fill)
    torch.testing.assert_close(packed.input_ids[:, T:], fill.reshape(B, K * W))
    got = packed.gather(_packed_forward(model, packed))
    want = _unpacked_slot_logits(model, clean, OFFSETS, shift, fill)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@torch.no_grad()
def test_clean_part_equals_plain_causal_forward():
    model, clean = _model(), _clean(2)
    packed = pack_windows(clean, OFFSETS, W, MASK)
    torch.testing.assert_close(_packed_forward(model, packed)[:, :T], model(clean, mode="causal"), atol=1e-5, rtol=0)
    # Clean tokens never attend to a window.
    assert not packed.attn_mask[:, :T, T:].any()


@pytest.mark.parametrize("shift", [False, True])
def test_loss_and_gradients_match(shift):
    model, clean = _model(), _clean(4)

    def ce(slot_logits, labels, valid):
        per_slot = F.cross_entropy(slot_logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none")
        return (per_slot * valid.reshape(-1)).sum() / valid.sum()

    packed = pack_windows(clean, OFFSETS, W, MASK, shift=shift)
    loss_packed = ce(packed.gather(_packed_forward(model, packed)), packed.labels, packed.valid)
    grads_packed = torch.autograd.grad(loss_packed, list(model.parameters()))

    labels = torch.empty(B, K, W, dtype=torch.long)
    valid = torch.empty(B, K, W, dtype=torch.bool)
    for b in range(B):
        for k in range(K):
            labels[b, k], valid[b, k] = window_labels(clean[b], int(OFFSETS[b, k]), W, MASK)
    torch.testing.assert_close(packed.labels, labels, atol=0, rtol=0)
    torch.testing.assert_close(packed.valid, valid, atol=0, rtol=0)
    loss_unpacked = ce(_unpacked_slot_logits(model, clean, OFFSETS, shift), labels, valid)
    grads_unpacked = torch.autograd.grad(loss_unpacked, list(model.parameters()))

    torch.testing.assert_close(loss_packed, loss_unpacked, atol=1e-5, rtol=0)
    for (name, _), gp, gu in zip(model.named_parameters(), grads_packed, grads_unpacked, strict=True):
        torch.testing.assert_close(gp, gu, atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_windows_past_the_end_are_invalid_exactly_there():
    clean = _clean()
    offsets = torch.tensor([[12, 8, 0], [10, 11, 3]])
    packed = pack_windows(clean, offsets, W, MASK)
    want = (offsets[:, :, None] + torch.arange(W)) < T
    torch.testing.assert_close(packed.valid, want, atol=0, rtol=0)
    assert (packed.labels[~packed.valid] == MASK).all()
    torch.testing.assert_close(packed.labels[0, 2], clean[0, :W])
    torch.testing.assert_close(packed.position_ids[0, packed.slot_index[0, 0]], 12 + torch.arange(W))


@torch.no_grad()
def test_right_padding_is_neither_attended_nor_labelled():
    model, clean = _model(), _clean(6)
    lengths = [T, 9]
    pad_valid = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    padded = clean.masked_fill(~pad_valid, 0)
    offsets = torch.tensor([[2, 7, 11], [3, 7, 10]])  # row 1's last window starts in the padding
    packed = pack_windows(padded, offsets, W, MASK, pad_valid=pad_valid)
    # No query other than the padded token itself attends to a padded token.
    seen = packed.attn_mask[1, :, 9:T].clone()
    seen[torch.arange(9, T), torch.arange(T - 9)] = False
    assert not seen.any()
    torch.testing.assert_close(packed.valid[1], (offsets[1, :, None] + torch.arange(W)) < 9, atol=0, rtol=0)
    assert not packed.valid[1, 2].any()

    logits = _packed_forward(model, packed)
    assert torch.isfinite(logits).all()
    short = clean[1, :9]
    torch.testing.assert_close(logits[1, :9], model(short[None], mode="causal")[0], atol=1e-5, rtol=0)
    for k in range(2):
        i = int(offsets[1, k])
        ids, P = window_input(short, i, W, MASK)
        want = model(ids[None], prefix_len=P)[0, i:]
        torch.testing.assert_close(logits[1, packed.slot_index[1, k]], want, atol=1e-5, rtol=0)


def test_invalid_offsets_and_shapes_raise():
    clean = _clean()
    with pytest.raises(ValueError, match="shifted"):
        pack_windows(clean, torch.tensor([[0, 3, 4], [1, 2, 3]]), W, MASK, shift=True)
    pack_windows(clean, torch.tensor([[0, 3, 4], [1, 2, 3]]), W, MASK)  # offset 0 is fine unshifted
    with pytest.raises(ValueError, match="at least one label"):
        pack_windows(clean, torch.tensor([[1, 3, T], [1, 2, 3]]), W, MASK)
    with pytest.raises(ValueError, match="negative"):
        pack_windows(clean, torch.tensor([[-1, 3, 4], [1, 2, 3]]), W, MASK)
    with pytest.raises(ValueError, match=r"\[B, K\]"):
        pack_windows(clean, torch.tensor([1, 2, 3]), W, MASK)
    with pytest.raises(ValueError, match="fill"):
        pack_windows(clean, OFFSETS, W, MASK, fill=torch.zeros(B, K, W + 1, dtype=torch.long))
    with pytest.raises(ValueError, match="right padding"):
        pack_windows(clean, OFFSETS, W, MASK, pad_valid=torch.tensor([[True] * T, [False] + [True] * (T - 1)]))
    with pytest.raises(ValueError, match="width"):
        pack_windows(clean, OFFSETS, 0, MASK)
    with pytest.raises(ValueError, match="at least one label"):
        window_input(clean[0], T, W, MASK)
