"""``models/cpu_attention.py``: the bf16 decode-attention kernel against its reference. Its output is the float64
softmax attention within a bf16 rounding (and no further from it than SDPA's own bf16 output is, give or take one
step); a query row's output does not depend on the rows, batch rows or threads beside it; cache views with strides
are read in place; a row with no key to attend gives zeros; and what it does not take is left to SDPA
(``attention.attend`` takes the kernel exactly where ``attend`` here does). On a CPU with neither AVX512-BF16 nor
AVX2 and FMA the kernel tests skip, saying so; the fallback test runs everywhere."""

import pytest
import torch
import torch.nn.functional as F

from streakline.models import attention, cpu_attention, cpu_native

needs_kernel = pytest.mark.skipif(
    not cpu_attention.available(), reason="this CPU (or toolchain) runs neither the AVX512-BF16 nor the AVX2 kernel"
)


def _bf16(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def _mask(B, T, S, seed=0):
    """A random boolean mask with the last key always allowed (a row's own token), as decode masks have it."""
    m = torch.rand(B, 1, T, S, generator=torch.Generator().manual_seed(seed)) < 0.7
    m[..., -1] = True
    return m


def _reference(q, k, v, mask):
    """Attention in float64, GQA expanded, the default scale."""
    G = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(G, dim=1) for t in (k, v))
    scores = q.double() @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _ulp(t):
    return torch.ldexp(torch.ones_like(t, dtype=torch.float32), torch.frexp(t.float()).exponent - 8).double()


@needs_kernel
@pytest.mark.parametrize(
    ("B", "H", "Hkv", "T", "S", "D", "masked"),
    [(1, 9, 3, 1, 250, 64, False), (1, 9, 3, 9, 250, 64, True), (2, 4, 4, 3, 37, 32, True),
     (1, 8, 2, 16, 5, 128, True), (1, 2, 1, 1, 1, 256, False), (3, 6, 2, 2, 17, 64, True)],
)  # fmt: skip
def test_the_kernel_is_softmax_attention_rounded_to_bf16(B, H, Hkv, T, S, D, masked):
    q, k, v = _bf16(B, H, T, D, seed=1), _bf16(B, Hkv, S, D, seed=2), _bf16(B, Hkv, S, D, seed=3)
    mask = _mask(B, T, S, seed=4) if masked else None
    got = cpu_attention.attend(q, k, v, mask)
    assert got is not None and got.dtype == torch.bfloat16 and got.shape == (B, H, T, D)
    want = _reference(q, k, v, mask)
    err = (got.double() - want).abs()
    # fp32 sums and a polynomial exp, then one bf16 rounding: within a step of the value, or of the largest value
    # of its row where the output cancels towards zero
    scale = want.abs().amax(dim=-1, keepdim=True)
    assert bool((err <= _ulp(want) + 2 * _ulp(scale) * 2**-6 + 1e-6).all()), float(err.max())
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=Hkv != H)
    assert float(err.max()) <= float((sdpa.double() - want).abs().max()) + float(_ulp(scale).max())


@needs_kernel
def test_a_query_rows_output_does_not_depend_on_its_neighbours_or_threads():
    B, H, Hkv, T, S, D = 2, 6, 2, 9, 40, 64
    q, k, v, mask = _bf16(B, H, T, D, seed=5), _bf16(B, Hkv, S, D, seed=6), _bf16(B, Hkv, S, D, seed=7), _mask(B, T, S)
    together = cpu_attention.attend(q, k, v, mask)
    for b in range(B):
        for t in range(T):
            row = (slice(b, b + 1), slice(None), slice(t, t + 1))
            alone = cpu_attention.attend(q[row], k[b : b + 1], v[b : b + 1], mask[row])
            assert torch.equal(alone, together[b : b + 1, :, t : t + 1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu_attention.attend(q, k, v, mask), together)
    finally:
        torch.set_num_threads(threads)
    # keys and values as a KV cache holds them: a longer buffer's first S positions, heads apart by its length
    buf_k, buf_v = torch.zeros(B, Hkv, 64, D, dtype=torch.bfloat16), torch.zeros(B, Hkv, 64, D, dtype=torch.bfloat16)
    buf_k[:, :, :S], buf_v[:, :, :S] = k, v
    assert torch.equal(cpu_attention.attend(q, buf_k[:, :, :S], buf_v[:, :, :S], mask), together)
    # queries as a layer makes them: [B, T, H, D] seen as [B, H, T, D]
    assert torch.equal(cpu_attention.attend(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, mask), together)


@needs_kernel
def test_a_row_with_no_key_to_attend_is_zeros_and_the_others_are_untouched():
    q, k, v = _bf16(1, 2, 2, 32, seed=8), _bf16(1, 2, 6, 32, seed=9), _bf16(1, 2, 6, 32, seed=10)
    mask = torch.ones(1, 1, 2, 6, dtype=torch.bool)
    mask[0, 0, 0] = False
    out = cpu_attention.attend(q, k, v, mask)
    assert torch.equal(out[:, :, 0], torch.zeros_like(out[:, :, 0]))
    assert torch.equal(out[:, :, 1:], cpu_attention.attend(q[:, :, 1:], k, v, mask[:, :, 1:]))


@needs_kernel
def test_the_layers_attention_takes_the_kernel_on_a_cpu_in_bf16():
    q, k, v, mask = _bf16(1, 9, 1, 64, seed=11), _bf16(1, 3, 30, 64, seed=12), _bf16(1, 3, 30, 64, seed=13), None
    assert torch.equal(attention.attend(q, k, v, mask, False), cpu_attention.attend(q, k, v, mask))
    with cpu_native.use_reference():  # torch's own: SDPA
        ref = attention.attend(q, k, v, mask, False)
        assert cpu_attention.attend(q, k, v, mask) is None
    assert torch.equal(ref, F.scaled_dot_product_attention(q, k, v, enable_gqa=True))


def test_what_the_kernel_does_not_take_is_left_to_sdpa():
    k, v = _bf16(1, 2, 8, 64, seed=14), _bf16(1, 2, 8, 64, seed=15)
    assert cpu_attention.attend(_bf16(1, 2, 1, 64).float(), k.float(), v.float(), None) is None  # fp32
    assert cpu_attention.attend(_bf16(1, 2, cpu_attention.MAX_QUERIES + 1, 64), k, v, None) is None  # a prefill
    assert cpu_attention.attend(_bf16(1, 2, 3, 64), k, v, None, is_causal=True) is None  # causal over queries
    assert cpu_attention.attend(_bf16(1, 2, 1, 48), _bf16(1, 2, 8, 48), _bf16(1, 2, 8, 48), None) is None  # D=48
    grad = _bf16(1, 2, 1, 64).requires_grad_()
    assert cpu_attention.attend(grad, k, v, None) is None  # autograd: SDPA's, with its backward
    additive = torch.zeros(1, 1, 1, 8, dtype=torch.bfloat16)
    assert cpu_attention.attend(_bf16(1, 2, 1, 64), k, v, additive) is None  # a float mask
