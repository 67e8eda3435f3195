"""The DFlash drafter model (``streakline/models/dflash.py``) and the verifier's layer states it reads: packed
training blocks equal one block per forward, the cached decoding path equals the uncached one, the layer states are
the residual streams vLLM and ``speculators`` number."""

from __future__ import annotations

import pytest
import torch

from streakline.models import KVCache, Transformer, TransformerConfig
from streakline.models.dflash import DFlashConfig, DFlashModel, block_inputs, packed_blocks

V, H = 97, 32


def _verifier(seed: int = 0) -> Transformer:
    cfg = TransformerConfig(
        vocab_size=V, hidden_size=H, intermediate_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
        family="qwen3", qk_norm=True,
    )  # fmt: skip
    return Transformer(cfg).init_weights(seed=seed).eval()


def _drafter(verifier: Transformer, layers=(1, 3), block: int = 5, seed: int = 1) -> DFlashModel:
    shapes = TransformerConfig(
        vocab_size=V, hidden_size=H, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
        family="qwen3", qk_norm=True, attention="full",
    )  # fmt: skip
    cfg = DFlashConfig(layers=shapes, target_layer_ids=layers, block_size=block, mask_token_id=V - 1)
    # std 0.2: larger weights than the init default, so that a wrong mask or position shows in the logits
    return DFlashModel(cfg).init_weights(seed=seed, std=0.2).share(verifier).eval()


def test_aux_layers_are_the_residual_streams_entering_each_layer():
    verifier = _verifier()
    ids = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(0))
    h, aux = verifier.hidden(ids, aux_layers=(0, 2, 4))
    assert torch.equal(h, verifier.hidden(ids))  # asking for states changes nothing else
    streams = aux.split(H, dim=-1)
    assert torch.equal(streams[0], verifier.embed(ids))  # id 0: the embeddings
    # id 4 = num_layers: the last layer's output, before the final norm
    assert torch.allclose(verifier.norm(streams[2]), h, atol=1e-6)
    # id 2: run layers 0 and 1 by hand
    from streakline.models.transformer import rotary_tables

    x = verifier.embed(ids)
    pos = torch.arange(9).expand(2, 9)
    cos, sin = rotary_tables(pos, verifier.config.head_dim, verifier.config.rope_theta, x.dtype)
    for i in range(2):
        x = verifier.layers[i](x, cos, sin, None, True, None, i)
    assert torch.allclose(streams[1], x, atol=1e-6)
    with pytest.raises(ValueError, match="outside 0..4"):
        verifier.hidden(ids, aux_layers=(5,))


def _features(verifier, ids, layers):
    with torch.no_grad():
        return verifier.hidden(ids, aux_layers=layers)[1]


def test_packed_blocks_equal_one_block_per_forward():
    verifier = _verifier()
    drafter = _drafter(verifier)
    L = drafter.dflash.block_size
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V - 1, (2, 20), generator=gen)
    feats = _features(verifier, ids, drafter.dflash.target_layer_ids)
    anchors = torch.tensor([[0, 4, 11], [3, 9, 15]])
    block_ids, block_pos, mask = packed_blocks(ids, anchors, L, drafter.dflash.mask_token_id)
    pos = torch.arange(20).expand(2, 20)
    with torch.no_grad():
        packed = drafter(block_ids, block_pos, features=feats, feature_pos=pos, attn_mask=mask)
        for r in range(2):
            for j, a in enumerate(anchors[r].tolist()):
                one = block_inputs(ids[r, a : a + 1], L, drafter.dflash.mask_token_id)
                alone = drafter(
                    one, torch.arange(a, a + L)[None], features=feats[r : r + 1, :a], feature_pos=pos[r : r + 1, :a]
                )
                assert torch.allclose(packed[r, j * L : (j + 1) * L], alone[0], atol=1e-5), (r, a)
    # the context matters (an anchor past 0 drafts differently without it), so the comparison above can fail
    with torch.no_grad():
        blind = drafter(block_inputs(ids[0, 4:5], L, drafter.dflash.mask_token_id), torch.arange(4, 4 + L)[None])
    assert not torch.allclose(packed[0, L : 2 * L], blind[0], atol=1e-3)


def test_cached_drafting_equals_the_uncached_forward():
    verifier = _verifier()
    drafter = _drafter(verifier)
    L = drafter.dflash.block_size
    ids = torch.randint(0, V - 1, (2, 14), generator=torch.Generator().manual_seed(5))
    feats = _features(verifier, ids, drafter.dflash.target_layer_ids)
    pos = torch.arange(14).expand(2, 14)
    block = block_inputs(ids[:, 13], L, drafter.dflash.mask_token_id)
    with torch.no_grad():
        reference = drafter(block, 13 + torch.arange(L).expand(2, L), features=feats[:, :13], feature_pos=pos[:, :13])
        cache = KVCache.for_model(drafter, 2, 64)
        drafter.add_context(feats[:, :6], cache)  # context in two pieces, as cycles add it
        drafter.add_context(feats[:, 6:13], cache)
        cached = drafter.draft(block, cache)
    assert torch.allclose(cached, reference, atol=1e-5)
    assert cache.length == 13  # the block never stays in the cache


def test_cached_drafting_with_ragged_context_rows():
    """Rows whose contexts grew by different amounts (right-aligned, validity masks) draft as if alone."""
    verifier = _verifier()
    drafter = _drafter(verifier)
    L = drafter.dflash.block_size
    gen = torch.Generator().manual_seed(7)
    rows = [torch.randint(0, V - 1, (n,), generator=gen) for n in (9, 6)]
    feats = [_features(verifier, r[None], drafter.dflash.target_layer_ids)[0] for r in rows]
    cache = KVCache.for_model(drafter, 2, 64)
    # first piece: 5 and 2 context rows, left-padded; second piece: 3 and 3
    with torch.no_grad():
        for lo, hi in ((0, (5, 2)), ((5, 2), (8, 5))):
            lo = lo if isinstance(lo, tuple) else (0, 0)
            n = max(h - s for s, h in zip(lo, hi, strict=True))
            piece = torch.zeros(2, n, feats[0].shape[-1])
            valid = torch.zeros(2, n, dtype=torch.bool)
            for r in range(2):
                k = hi[r] - lo[r]
                piece[r, n - k :] = feats[r][lo[r] : hi[r]]
                valid[r, n - k :] = True
            drafter.add_context(piece, cache, valid)
        last = torch.stack([rows[0][8], rows[1][5]])
        cached = drafter.draft(block_inputs(last, L, drafter.dflash.mask_token_id), cache)
        for r, n in ((0, 8), (1, 5)):
            alone = drafter(
                block_inputs(last[r : r + 1], L, drafter.dflash.mask_token_id),
                torch.arange(n, n + L)[None],
                features=feats[r][None, :n],
                feature_pos=torch.arange(n)[None],
            )
            assert torch.allclose(cached[r], alone[0], atol=1e-5), r


def test_share_refuses_a_verifier_it_does_not_fit():
    verifier = _verifier()
    drafter = _drafter(verifier)
    other = Transformer(
        TransformerConfig(
            vocab_size=V + 3, hidden_size=H, intermediate_size=64, num_layers=4, num_heads=4, num_kv_heads=2
        )
    )
    with pytest.raises(ValueError, match="vocabulary"):
        drafter.share(other)
    shallow = Transformer(
        TransformerConfig(vocab_size=V, hidden_size=H, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
    )
    with pytest.raises(ValueError, match="layers"):
        drafter.share(shallow)
    with pytest.raises(RuntimeError, match="share"):
        _ = DFlashModel(drafter.dflash).embed


def test_fused_projections_draft_the_same():
    """On a GPU inference fuses q/k/v; the context rows then take only the k/v rows of the fused matrix."""
    import copy

    verifier = _verifier()
    drafter = _drafter(verifier)
    fused = copy.deepcopy(drafter).share(verifier).fuse_projections()
    L = drafter.dflash.block_size
    ids = torch.randint(0, V - 1, (2, 12), generator=torch.Generator().manual_seed(9))
    feats = _features(verifier, ids, drafter.dflash.target_layer_ids)
    block = block_inputs(ids[:, 11], L, drafter.dflash.mask_token_id)
    with torch.no_grad():
        outs = []
        for model in (drafter, fused):
            cache = KVCache.for_model(model, 2, 64)
            model.add_context(feats[:, :11], cache)
            outs.append(model.draft(block, cache))
    assert torch.allclose(outs[0], outs[1], atol=1e-5)
