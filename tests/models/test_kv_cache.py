"""KV cache: incremental decoding equals full recomputation; crop, gather and growth behave."""

import pytest
import torch

from streakline.models import KVCache, Transformer
from tests.models.helpers import VOCAB, tiny_config


def _ids(B, T, seed=0):
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_incremental_decoding_equals_full_recompute(family):
    model = Transformer(tiny_config(family)).init_weights(seed=2).eval()
    ids = _ids(2, 14)
    full = model(ids)
    cache = KVCache.for_model(model, batch_size=2, capacity=4)  # tiny capacity: growth is exercised too
    steps = [model(ids[:, :6], cache=cache)]
    steps.append(model(ids[:, 6:9], cache=cache))  # a multi-token chunk after a prefill
    for t in range(9, 14):
        steps.append(model(ids[:, t : t + 1], cache=cache))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)
    assert cache.length == 14 and cache.capacity >= 14


@torch.no_grad()
def test_left_padded_batch_decodes_like_each_row_alone():
    model = Transformer(tiny_config("qwen2")).init_weights(seed=3).eval()
    long, short = _ids(1, 7, seed=1)[0], _ids(1, 3, seed=2)[0]
    ids = torch.zeros(2, 7, dtype=torch.long)
    mask = torch.zeros(2, 7, dtype=torch.long)
    ids[0], mask[0] = long, 1
    ids[1, 4:], mask[1, 4:] = short, 1
    nxt = _ids(2, 4, seed=3)
    cache = KVCache.for_model(model, 2)
    out = [model(ids, attention_mask=mask, cache=cache)[:, -1:]]
    for t in range(4):
        out.append(model(nxt[:, t : t + 1], cache=cache))
    out = torch.cat(out, dim=1)
    for row, prompt in enumerate([long, short]):
        ref = model(torch.cat([prompt, nxt[row]])[None])[0, len(prompt) - 1 :]
        torch.testing.assert_close(out[row], ref, atol=1e-5, rtol=0)


@torch.no_grad()
def test_crop_then_redecode_equals_never_having_decoded():
    model = Transformer(tiny_config("llama")).init_weights(seed=4).eval()
    ids = _ids(1, 10)
    cache = KVCache.for_model(model, 1)
    model(ids[:, :6], cache=cache)
    model(_ids(1, 3, seed=9), cache=cache)  # a rejected draft
    cache.crop(6)
    got = model(ids[:, 6:], cache=cache)
    torch.testing.assert_close(got, model(ids)[:, 6:], atol=1e-5, rtol=0)
    with pytest.raises(ValueError):
        cache.crop(11)


@torch.no_grad()
def test_gather_keeps_a_tree_path_per_row():
    """Two rows verify a 2-branch tree with an explicit mask; each keeps a different branch (and length)."""
    model = Transformer(tiny_config("qwen3")).init_weights(seed=5).eval()
    prompt = _ids(2, 5)
    a, b = _ids(2, 3, seed=7), _ids(2, 3, seed=8)  # branch A and branch B, 3 tokens each
    cache = KVCache.for_model(model, 2)
    model(prompt, cache=cache)
    # Flattened tree [a1 a2 a3 b1 b2 b3]: each branch is causal within itself, blind to the other.
    tree = torch.zeros(6, 6, dtype=torch.bool)
    tree[:3, :3] = torch.ones(3, 3).tril().bool()
    tree[3:, 3:] = torch.ones(3, 3).tril().bool()
    pos = torch.tensor([5, 6, 7, 5, 6, 7]).expand(2, 6)
    model(torch.cat([a, b], dim=1), cache=cache, position_ids=pos, attn_mask=tree.expand(2, 6, 6))
    # Row 0 keeps a1 a2 (2 tokens), row 1 keeps b1 b2 b3 (3 tokens).
    index = torch.tensor([[5, 6, 0], [8, 9, 10]])
    index[0, 2] = 7  # any in-range slot; masked out by keep
    keep = torch.tensor([[True, True, False], [True, True, True]])
    cache.gather(index, start=5, keep=keep)
    assert cache.length == 8
    nxt = _ids(2, 1, seed=9)
    got = model(nxt, cache=cache)
    ref0 = model(torch.cat([prompt[0], a[0, :2], nxt[0]])[None])[0, -1]
    ref1 = model(torch.cat([prompt[1], b[1], nxt[1]])[None])[0, -1]
    torch.testing.assert_close(got[0, 0], ref0, atol=1e-5, rtol=0)
    torch.testing.assert_close(got[1, 0], ref1, atol=1e-5, rtol=0)
    assert cache.next_positions().tolist() == [8, 9]


def test_gather_rejects_out_of_range_slots():
    model = Transformer(tiny_config("qwen2")).init_weights(seed=1).eval()
    cache = KVCache.for_model(model, 1)
    with torch.no_grad():
        model(_ids(1, 4), cache=cache)
    with pytest.raises(ValueError, match="gather indices"):
        cache.gather(torch.tensor([[4]]), start=2)


def test_keep_rows_drops_finished_rows_and_the_rest_decode_on():
    model = Transformer(tiny_config("qwen2")).init_weights(seed=5).eval()
    prompts = torch.randint(0, VOCAB, (3, 6), generator=torch.Generator().manual_seed(2))
    cache = KVCache.for_model(model, 3, 16)
    with torch.no_grad():
        model(prompts, cache=cache)
        cache.keep_rows(torch.tensor([2, 0]))
        nxt = torch.tensor([[4], [9]])
        got = model(nxt, cache=cache)[:, -1]
        want = model(torch.cat([prompts[[2, 0]], nxt], 1))[:, -1]
    assert cache.batch_size == 2
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_cache_larger_than_free_memory_is_refused_with_its_size_before_allocating():
    from streakline.models.kv_cache import MemoryLimitError, free_bytes

    model = Transformer(tiny_config("qwen2"))
    free = free_bytes("cpu")
    if free is None:
        pytest.skip("this platform does not report free memory")
    c = model.config
    per_position = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4  # k and v, float32
    rows = 2 * free // (per_position * 1024)  # twice what fits at 1024 positions: free memory moves, not that much
    with pytest.raises(MemoryLimitError, match=rf"KV cache of {rows} rows x 1024 positions needs .* GiB are free"):
        KVCache.for_model(model, rows, capacity=1024)
    assert KVCache.for_model(model, 2, capacity=1024).capacity == 1024  # a cache that fits is made as before
