"""The attention dispatcher (``streakline/models/attention.py``): the path each case takes, and the same numbers on
every path that runs here. Run: ``python -m pytest tests/models/test_attention.py``."""

import pytest
import torch
import torch.nn.functional as F

from streakline.models.attention import PATHS, attend, choose_path, fold_gqa


def _qkv(B=2, H=8, Hkv=2, T=5, S=11, D=16, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g, dtype=dtype)
    k = torch.randn(B, Hkv, S, D, generator=g, dtype=dtype)
    v = torch.randn(B, Hkv, S, D, generator=g, dtype=dtype)
    mask = torch.rand(B, 1, T, S, generator=g) < 0.6
    mask[..., -T:] |= torch.eye(T, dtype=torch.bool)  # every query sees itself (as build_mask guarantees)
    return q, k, v, mask


def _expanded(q, k, v, mask, is_causal=False):
    """The definition: every query head attends over its own copy of its group's keys/values."""
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)


def test_paths_chosen_on_purpose():
    cpu = torch.zeros(1, dtype=torch.bfloat16)
    assert choose_path(cpu, has_mask=False) == choose_path(cpu, has_mask=True) == "default"
    # the rules themselves, on a stand-in that reports a CUDA device (only the device type and dtype are read)

    class OnCuda:
        def __init__(self, dtype):
            self.device, self.dtype = torch.device("cuda", 0), dtype

    assert choose_path(OnCuda(torch.bfloat16), has_mask=False) == "flash"  # plain causal/full decode: no plan rebuilds
    assert choose_path(OnCuda(torch.float16), has_mask=False) == "flash"
    assert choose_path(OnCuda(torch.bfloat16), has_mask=True) == "efficient"  # trees, padding, static caches
    assert choose_path(OnCuda(torch.float32), has_mask=False) == "efficient"  # flash takes no fp32
    assert set(PATHS) == {"flash", "efficient", "default"}


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_folded_gqa_equals_expanded_keys(groups):
    q, k, v, mask = _qkv(H=2 * groups, Hkv=2)
    want = _expanded(q, k, v, mask)
    got = fold_gqa(q, k, v, mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # a mask broadcast over the batch folds the same way
    torch.testing.assert_close(fold_gqa(q, k, v, mask[:1].expand_as(mask)), _expanded(q, k, v, mask[:1]), rtol=1e-5,
                               atol=1e-6)  # fmt: skip


def test_folded_gqa_with_a_transposed_query_layout():
    """The model hands ``attend`` queries as a transposed view ([B, T, H, D] storage): the fold must follow heads,
    not storage order."""
    q, k, v, mask = _qkv()
    q_view = q.transpose(1, 2).contiguous().transpose(1, 2)
    assert not q_view.is_contiguous()
    torch.testing.assert_close(fold_gqa(q_view, k, v, mask), _expanded(q, k, v, mask), rtol=1e-5, atol=1e-6)


def test_attend_default_path_matches_the_definition():
    q, k, v, mask = _qkv()
    torch.testing.assert_close(attend(q, k, v, mask, False), _expanded(q, k, v, mask), rtol=1e-5, atol=1e-6)
    q, k, v, _ = _qkv(T=7, S=7)
    torch.testing.assert_close(attend(q, k, v, None, True), _expanded(q, k, v, None, True), rtol=1e-5, atol=1e-6)


def test_unknown_path_is_refused():
    q, k, v, mask = _qkv()
    with pytest.raises(ValueError, match="unknown attention path"):
        attend(q, k, v, mask, False, path="cudnn")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (bench/gpu.sh runs it)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_paths_match_the_definition(dtype):
    """On a GPU: flash (no mask) and efficient (mask, folded GQA) against the expanded math computation."""
    q, k, v, mask = (t.cuda() for t in _qkv(T=7, S=7, dtype=dtype))
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)
    ref = _expanded(q.float(), k.float(), v.float(), mask)
    assert choose_path(q, has_mask=True) == "efficient"
    torch.testing.assert_close(attend(q, k, v, mask, False).float(), ref, **tol)
    causal = _expanded(q.float(), k.float(), v.float(), None, True)
    torch.testing.assert_close(attend(q, k, v, None, True).float(), causal, **tol)
