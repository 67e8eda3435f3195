"""The four attention modes and explicit masks, checked by what each mode promises about information flow."""

import pytest
import torch

from streakline.models import Transformer
from streakline.models.masks import build_mask
from tests.models.helpers import VOCAB, tiny_config


def _model(family="qwen2", **kw):
    return Transformer(tiny_config(family, **kw)).init_weights(seed=11).eval()


def _ids(B, T, seed=0):
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_causal_positions_do_not_see_the_future():
    model = _model()
    a = _ids(1, 12)
    b = a.clone()
    b[:, 8:] = (b[:, 8:] + 1) % VOCAB
    torch.testing.assert_close(model(a)[:, :8], model(b)[:, :8], atol=0, rtol=0)
    assert not torch.allclose(model(a)[:, 8:], model(b)[:, 8:])


@torch.no_grad()
def test_full_attention_sees_everything():
    model = _model(attention="full")
    a = _ids(1, 12)
    b = a.clone()
    b[:, -1] = (b[:, -1] + 1) % VOCAB
    assert not torch.allclose(model(a)[:, 0], model(b)[:, 0])


@torch.no_grad()
def test_prefix_causal_prefix_is_blind_to_window_and_window_sees_all():
    model = _model(attention="prefix_causal")
    P, T = 7, 12
    a = _ids(2, T)
    b = a.clone()
    b[:, P:] = (b[:, P:] + 3) % VOCAB  # change only the window
    la, lb = model(a, prefix_len=P), model(b, prefix_len=P)
    torch.testing.assert_close(la[:, :P], lb[:, :P], atol=0, rtol=0)
    # The prefix equals a plain causal run over the prefix alone: this is what makes the prefix KV cache exact.
    torch.testing.assert_close(la[:, :P], model(a[:, :P], mode="causal"), atol=1e-5, rtol=0)
    c = a.clone()
    c[:, -1] = (c[:, -1] + 1) % VOCAB  # the last window token changes the first window slot's logits
    assert not torch.allclose(model(c, prefix_len=P)[:, P], la[:, P])
    with pytest.raises(ValueError, match="prefix_len"):
        model(a)


@torch.no_grad()
def test_block_causal_is_bidirectional_inside_a_block_causal_across():
    model = _model("sdar")  # block_size 4
    a = _ids(1, 12)
    b = a.clone()
    b[:, 9] = (b[:, 9] + 1) % VOCAB  # inside block 2 (positions 8..11)
    la, lb = model(a), model(b)
    torch.testing.assert_close(la[:, :8], lb[:, :8], atol=0, rtol=0)  # earlier blocks untouched
    assert not torch.allclose(la[:, 8], lb[:, 8])  # position 8 sees the later position 9 of its own block


@torch.no_grad()
@pytest.mark.parametrize("mode", ["causal", "full", "block_causal"])
def test_explicit_mask_reproduces_each_mode(mode):
    model = _model("sdar")
    ids = _ids(2, 10)
    pos = torch.arange(10)
    if mode == "causal":
        allowed = pos[None, :] <= pos[:, None]
    elif mode == "full":
        allowed = torch.ones(10, 10, dtype=torch.bool)
    else:
        allowed = (pos[None, :] // 4) <= (pos[:, None] // 4)
    explicit = allowed.expand(2, 10, 10)
    torch.testing.assert_close(model(ids, attn_mask=explicit), model(ids, mode=mode), atol=1e-5, rtol=0)


@torch.no_grad()
def test_left_padding_gives_each_row_its_unpadded_logits():
    model = _model()
    rows = [_ids(1, 9, seed=1)[0], _ids(1, 5, seed=2)[0], _ids(1, 1, seed=3)[0]]
    T = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, T - len(r) :] = r
        mask[i, T - len(r) :] = 1
    batched = model(ids, attention_mask=mask)
    assert torch.isfinite(batched).all()  # padding rows must not produce NaN
    for i, r in enumerate(rows):
        torch.testing.assert_close(batched[i, T - len(r) :], model(r[None])[0], atol=1e-5, rtol=0)


def test_mask_fast_paths_build_nothing():
    pos = torch.arange(5)[None]
    assert build_mask("causal", pos, None, None) == (None, True)
    assert build_mask("full", pos, None, None) == (None, False)
    mask, _ = build_mask("block_causal", pos, None, None, block_size=2)
    assert mask.shape == (1, 1, 5, 5)
    with pytest.raises(ValueError, match="expected"):
        build_mask("causal", pos, None, None, explicit=torch.ones(1, 5, 4, dtype=torch.bool))


def test_explicit_mask_argument_is_not_modified():
    model = _model()
    explicit = torch.zeros(1, 4, 4, dtype=torch.bool)
    explicit[..., 0] = True
    before = explicit.clone()
    with torch.no_grad():
        model(_ids(1, 4), attn_mask=explicit)
    assert torch.equal(explicit, before)


def test_gradients_flow_with_and_without_checkpointing():
    model = _model().train()
    ids = _ids(2, 8)
    loss = model(ids).logsumexp(-1).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.gradient_checkpointing = True
    model(ids).logsumexp(-1).mean().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], atol=1e-6, rtol=1e-5)
