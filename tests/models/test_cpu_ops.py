"""``models/cpu_ops.py``: RMSNorm and rotary of a bf16 decode step in C against their torch references in
``models/transformer.py``. Rotary is torch's bf16 result bit for bit; RMSNorm is within one bf16 rounding of it (its
sum of squares runs in another order) and within one step of a float64 reference; a row's result does not depend
on the rows beside it or the thread count; the model's layers take the kernels in a bf16 CPU forward and give what
torch's ops give there; and what the kernels do not take (fp32, autograd, other layouts) is torch's ops exactly. On
a CPU without AVX2 and FMA the kernel tests skip, saying so; the fallback test runs everywhere."""

import pytest
import torch

from streakline.models import Transformer, cpu_native, cpu_ops
from streakline.models.transformer import RMSNorm, apply_rotary, rotary_tables
from tests.models.helpers import tiny_config

needs_kernel = pytest.mark.skipif(not cpu_ops.available(), reason="this CPU (or toolchain) has no AVX2 and FMA")


def _bf16(*shape, seed=0, scale=1.0):
    return (scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).bfloat16()


def _norm(dim: int, seed: int = 1) -> RMSNorm:
    norm = RMSNorm(dim, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(dim, generator=torch.Generator().manual_seed(seed)))
    return norm.bfloat16()


def _step(t: torch.Tensor) -> torch.Tensor:
    """One bf16 step at each value's magnitude (8 significant bits)."""
    return torch.ldexp(torch.ones_like(t, dtype=torch.float32), torch.frexp(t.float()).exponent - 8)


@needs_kernel
@pytest.mark.parametrize(("shape", "dim"), [((1, 1, 576), 576), ((3, 7, 64), 64), ((2, 5, 9, 64), 64), ((4, 13), 13)])
def test_rms_norm_is_torchs_within_a_rounding_and_the_float64_norm_within_a_step(shape, dim):
    x, norm = _bf16(*shape, seed=2, scale=3.0), _norm(dim)
    with torch.no_grad():  # inference: the weight needs no gradient
        got = cpu_ops.rms_norm(x, norm.weight, norm.eps)
    with cpu_native.use_reference(), torch.no_grad():
        ref = norm(x)
    assert got is not None and got.dtype == torch.bfloat16 and got.shape == x.shape
    assert bool(((got.float() - ref.float()).abs() <= _step(ref)).all())  # at most one rounding apart
    x64 = x.double()
    normed = (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + norm.eps)).bfloat16().double()
    want = norm.weight.double() * normed  # the two roundings torch makes, the rest exact
    assert bool(((got.double() - want).abs() <= 2 * _step(want)).all())


@needs_kernel
@pytest.mark.parametrize(
    ("B", "H", "T", "D", "shared"), [(1, 9, 1, 64, True), (2, 3, 5, 64, False), (2, 4, 3, 6, True)]
)
def test_rotary_is_torchs_bf16_result_bit_for_bit(B, H, T, D, shared):
    x = _bf16(B, T, H, D, seed=3).transpose(1, 2)  # as Attention makes it: a transposed view
    positions = torch.arange(40, 40 + T).expand(1 if shared else B, T)
    cos, sin = rotary_tables(positions, D, 10000.0, torch.bfloat16)
    got = cpu_ops.rotary(x, cos, sin)
    with cpu_native.use_reference():
        ref = apply_rotary(x, cos, sin)
    assert got is not None and torch.equal(got, ref.expand_as(got))


@needs_kernel
def test_a_rows_result_does_not_depend_on_its_neighbours_or_threads():
    x, norm = _bf16(11, 576, seed=4, scale=2.0), _norm(576).requires_grad_(False)
    together = cpu_ops.rms_norm(x, norm.weight, norm.eps)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for i in range(11):
            assert torch.equal(cpu_ops.rms_norm(x[i : i + 1].contiguous(), norm.weight, norm.eps), together[i : i + 1])
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_a_bf16_model_takes_the_kernels_and_gives_torchs_logits():
    model = Transformer(tiny_config("qwen2")).init_weights(seed=5, std=0.1).eval().bfloat16()
    ids = torch.randint(0, 90, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        fast = model(ids)
        with cpu_native.use_reference():
            ref = model(ids)
    # rotary is exact and RMSNorm at most a rounding apart, so the logits agree to a few bf16 steps
    assert torch.allclose(fast.float(), ref.float(), atol=0.05, rtol=0.02)


def test_what_the_kernels_do_not_take_is_torchs_ops_exactly():
    norm, x32 = RMSNorm(16, 1e-5), torch.randn(3, 16)
    assert cpu_ops.rms_norm(x32, norm.weight, norm.eps) is None  # fp32
    xb, nb = x32.bfloat16(), _norm(16)
    assert cpu_ops.rms_norm(xb.t().contiguous().t(), nb.weight, nb.eps) is None  # not contiguous
    grad = xb.clone().requires_grad_()
    assert cpu_ops.rms_norm(grad, nb.weight, nb.eps) is None  # autograd
    out = nb(grad)  # torch's ops, with their backward
    out.float().sum().backward()
    assert grad.grad is not None
    with cpu_native.use_reference():
        assert cpu_ops.rms_norm(xb, nb.weight, nb.eps) is None
    x = torch.randn(1, 2, 3, 8)
    cos, sin = rotary_tables(torch.arange(3)[None], 8, 10000.0, torch.float32)
    assert cpu_ops.rotary(x, cos, sin) is None  # fp32
    assert torch.equal(apply_rotary(x, cos, sin), x * cos + torch.cat([-x[..., 4:], x[..., :4]], dim=-1) * sin)
