"""compact_kv: the torch reference moves the right slots and refuses a racy index; the Triton path equals it exactly
on odd shapes (fp32 and bf16), including self-copies and ragged rows.

    python -m pytest tests/decoding/kernels/test_compact.py -q      # Triton runs under TRITON_INTERPRET=1 on CPU
"""

import pytest
import torch

from streakline.decoding.kernels import compact_kv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _tree_index(B: int, start: int, chains: int, depth: int, seed: int) -> torch.Tensor:
    """``[B, n]`` index of a verified tree laid out as ``chains`` chains of ``depth`` slots from ``start``: row b keeps
    a random prefix of a random chain; rows that keep fewer than n pad with self-copies (ragged rows)."""
    g = torch.Generator().manual_seed(seed)
    chain = torch.randint(0, chains, (B,), generator=g)
    chain[0] = 0  # chain 0 already sits at the destination: every entry of row 0 is a self-copy
    kept = torch.randint(1, depth + 1, (B,), generator=g)
    n = int(kept.max())
    i = torch.arange(n)
    path = start + chain[:, None] * depth + i
    return torch.where(i < kept[:, None], path, start + i)


def _slow_reference(k: torch.Tensor, index: torch.Tensor, start: int) -> torch.Tensor:
    out = k.clone()
    for b in range(index.shape[0]):
        for i, src in enumerate(index[b].tolist()):
            out[:, b, :, start + i] = k[:, b, :, src]
    return out


def test_reference_moves_the_right_slots():
    L, B, H, C, D = 2, 3, 2, 20, 4
    k = torch.randn(L, B, H, C, D)
    v = torch.randn(L, B, H, C, D)
    index = torch.tensor([[5, 6, 7], [11, 12, 7], [14, 15, 16]])  # row 1 keeps two of chain 2 and pads
    expect_k, expect_v = _slow_reference(k, index, 5), _slow_reference(v, index, 5)
    compact_kv(k, v, index, 5, backend="torch")
    assert torch.equal(k, expect_k) and torch.equal(v, expect_v)
    assert torch.equal(k[:, 1, :, 5], expect_k[:, 1, :, 5]) and torch.equal(k[:, 1, :, 5], k[:, 1, :, 11])
    assert torch.equal(k[:, :, :, 8:], expect_k[:, :, :, 8:])  # nothing past start + n moves


def test_reference_refuses_a_racy_index():
    k = torch.randn(1, 2, 1, 12, 3)
    v = torch.randn(1, 2, 1, 12, 3)
    before = k.clone()
    # Row 1, entry 0 reads slot 3, which entry 1 of the same row overwrites.
    with pytest.raises(ValueError, match=r"index\[1, 0\] = 3"):
        compact_kv(k, v, torch.tensor([[2, 3, 4], [3, 9, 10]]), 2, backend="torch")
    with pytest.raises(ValueError, match=r"must lie in \[2, 12\)"):
        compact_kv(k, v, torch.tensor([[2, 3, 12], [2, 3, 4]]), 2, backend="torch")
    assert torch.equal(k, before)


def test_inputs_are_validated():
    k = torch.randn(1, 2, 1, 12, 4)
    with pytest.raises(ValueError, match="contiguous"):
        compact_kv(k.transpose(3, 4).contiguous().transpose(3, 4), k.clone(), torch.zeros(2, 1, dtype=torch.long), 0)
    with pytest.raises(ValueError, match="int64"):
        compact_kv(k, k.clone(), torch.zeros(2, 1, dtype=torch.int32), 0)
    with pytest.raises(ValueError, match=r"\[11, 13\)"):
        compact_kv(k, k.clone(), torch.full((2, 2), 11), 11)
    with pytest.raises(ValueError, match="both be"):
        compact_kv(k, k[:, :1].clone(), torch.zeros(2, 1, dtype=torch.long), 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("D", [20, 70])  # one block of columns; two (BLOCK_D = 64) with a ragged tail
def test_triton_equals_reference(dtype, D, triton_backend):
    L, B, H, C, start, chains, depth = 3, 2, 3, 37, 9, 3, 8
    index = _tree_index(B, start, chains, depth, seed=D)
    k = torch.randn(L, B, H, C, D).to(dtype)
    v = torch.randn(L, B, H, C, D).to(dtype)
    ref_k, ref_v = k.clone(), v.clone()
    compact_kv(ref_k, ref_v, index, start, backend="torch")
    assert torch.equal(ref_k, _slow_reference(k, index, start))
    got_k, got_v = k.to(DEVICE), v.to(DEVICE)
    compact_kv(got_k, got_v, index.to(DEVICE), start, backend=triton_backend)
    assert torch.equal(got_k.cpu(), ref_k) and torch.equal(got_v.cpu(), ref_v)


def test_triton_self_copies_and_empty_index(triton_backend):
    k = torch.randn(2, 2, 1, 10, 5)
    v = torch.randn(2, 2, 1, 10, 5)
    before_k, before_v = k.clone(), v.clone()
    got_k, got_v = k.to(DEVICE), v.to(DEVICE)
    compact_kv(got_k, got_v, torch.tensor([[3, 4, 5], [3, 4, 5]], device=DEVICE), 3, backend=triton_backend)
    compact_kv(got_k, got_v, torch.zeros(2, 0, dtype=torch.long, device=DEVICE), 3, backend=triton_backend)
    assert torch.equal(got_k.cpu(), before_k) and torch.equal(got_v.cpu(), before_v)
