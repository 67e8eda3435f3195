"""``models/cpu_linear.py``: the skinny bf16 CPU kernel against its reference. Each output is the fp32 sum of the
bf16 products rounded to bf16 (so within one bf16 step of an fp32 reference, as ``F.linear`` is); a row's output
does not depend on the rows beside it, on N or on the thread count, so a fused matrix gives the separate ones'
outputs bit for bit; it takes only what it can (bf16, CPU, few rows, no autograd), ``F.linear`` the rest exactly;
and a bf16 model that ``build(inference=True)`` puts on it decodes speculatively what it decodes alone.
On a CPU with neither AVX512-BF16 nor AVX2 and FMA the kernel tests skip, saying so; the fallback tests run
everywhere. On an AVX2 CPU they test the AVX2 kernel, on an AVX512-BF16 one the other (``instruction_set()`` says)."""

import copy

import pytest
import torch
import torch.nn.functional as F

from streakline.decoding.drafters import ARDrafter
from streakline.decoding.speculative import SpecConfig, generate
from streakline.models import Transformer, cpu_linear
from tests.decoding.helpers import causal_copy
from tests.models.helpers import tiny_config

needs_kernel = pytest.mark.skipif(
    not cpu_linear.available(), reason="this CPU (or toolchain) runs neither the AVX512-BF16 nor the AVX2 kernel"
)


def _bf16(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def _ulp(t: torch.Tensor) -> torch.Tensor:
    """One bf16 step at each value's magnitude (8 significant bits)."""
    return torch.ldexp(torch.ones_like(t, dtype=torch.float32), torch.frexp(t.float()).exponent - 8)


@needs_kernel
@pytest.mark.parametrize(
    ("M", "N", "K"),
    [(1, 7, 33), (3, 13, 576), (4, 40, 70), (2, 9, 31), (1, 1, 1), (4, 8, 64), (9, 100, 576), (12, 33, 64),
     (13, 48, 577), (16, 17, 32), (40, 48, 96)],
)  # fmt: skip
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_is_the_fp32_sum_rounded_to_bf16(M, N, K, bias):
    """Awkward shapes: N not a multiple of 16 or 32 (a group or a tile part-filled), K odd (a zero column pairs
    the last), M past 12 (x's rows in two passes), M past 16 (the AVX2 kernel's, F.linear's on AVX512-BF16)."""
    x, w = _bf16(M, K, seed=1), _bf16(N, K, seed=2)
    b = _bf16(N, seed=3) if bias else None
    want = x.double() @ w.double().t() + (0 if b is None else b.double())
    got = cpu_linear.linear(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (M, N)
    err = (got.double() - want).abs()
    # fp32 sums in another order than the float64 reference, then one bf16 rounding: within one step of it
    assert bool((err <= _ulp(want) + 1e-5 * K).all()), float(err.max())
    ref = F.linear(x, w, b)  # torch's own bf16 linear is as far from the reference, no further
    assert float(err.max()) <= float((ref.double() - want).abs().max()) + float(_ulp(want).max())


@needs_kernel
def test_a_rows_output_does_not_depend_on_its_neighbours_n_or_threads():
    x, w = _bf16(14, 200, seed=4), _bf16(77, 200, seed=5)
    together = cpu_linear.linear(x, w)
    for i in range(14):
        assert torch.equal(cpu_linear.linear(x[i : i + 1], w), together[i : i + 1])
    assert torch.equal(cpu_linear.linear(x, w[:40]), together[:, :40])  # fewer weight rows: the same sums
    # rows of a weight it has packed, as the k/v rows of a fused q/k/v matrix: from a group's first row the base's
    # packed copy, from another row a copy of their own; the same sums either way
    assert torch.equal(cpu_linear.linear(x, w[32:]), together[:, 32:])
    assert torch.equal(cpu_linear.linear(x, w[5:]), together[:, 5:])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu_linear.linear(x, w), together)
    finally:
        torch.set_num_threads(threads)
    strided = torch.cat([x, x], dim=-1)[:, :200]  # rows with a stride: read in place
    assert torch.equal(cpu_linear.linear(strided, w), together)
    assert torch.equal(cpu_linear.linear(x[None], w)[0], together)  # leading dimensions flattened and restored


@needs_kernel
def test_a_weight_changed_in_place_is_packed_again():
    """The packed copy is kept with the weight; loading new values into it (``load_state_dict``, ``copy_``) moves
    its version, and the next product reads the new values."""
    x, w = _bf16(2, 64, seed=6), _bf16(20, 64, seed=7)
    before = cpu_linear.linear(x, w)
    with torch.no_grad():
        w.copy_(_bf16(20, 64, seed=8))
    after = cpu_linear.linear(x, w)
    assert torch.equal(after, cpu_linear.linear(x, w.clone())) and not torch.equal(after, before)


def test_what_the_kernel_does_not_take_is_f_linear_exactly():
    w = torch.randn(6, 20)
    cases = [(torch.randn(2, 20), w), (torch.randn(2, 20).half(), w.half())]  # fp32, fp16
    if cpu_linear.max_rows() is not None:
        cases.append((_bf16(cpu_linear.max_rows() + 1, 20), w.bfloat16()))  # more rows than it takes
    for x, weight in cases:
        assert torch.equal(cpu_linear.linear(x, weight), F.linear(x, weight))
    x, wg = _bf16(1, 20), w.bfloat16().requires_grad_()
    out = cpu_linear.linear(x, wg)  # autograd: torch's, with its backward
    out.sum().backward()
    assert torch.equal(out.detach(), F.linear(x, wg.detach())) and wg.grad is not None
    with cpu_linear.use_reference():
        assert torch.equal(cpu_linear.linear(x, w.bfloat16()), F.linear(x, w.bfloat16()))


@needs_kernel
@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: q/k/v biases
def test_a_fused_kernel_model_gives_the_separate_projections_outputs_bit_for_bit(family):
    model = Transformer(tiny_config(family)).init_weights(seed=2, std=0.1).eval().bfloat16()
    plain = cpu_linear.use_kernels(copy.deepcopy(model))
    fused = cpu_linear.use_kernels(copy.deepcopy(model).fuse_projections())
    assert isinstance(fused.layers[0].attn.qkv_proj, cpu_linear.KernelLinear)
    ids = torch.randint(0, 90, (1, 3), generator=torch.Generator().manual_seed(0))  # 3 rows: the kernel's
    with torch.no_grad():
        assert torch.equal(fused(ids), plain(ids))
    assert sorted(fused.state_dict()) == sorted(model.state_dict())  # the checkpoint's names, as before


@needs_kernel
def test_a_kernel_model_decodes_speculatively_what_it_decodes_alone():
    """The verifier on the kernel (one row a vanilla step) and a drafter window on torch's linear (more rows):
    greedy speculative output still equals the same model's vanilla output, here where no near-tie falls."""
    model = cpu_linear.use_kernels(
        Transformer(tiny_config("qwen2", vocab_size=13)).init_weights(seed=7, std=0.1).eval().bfloat16()
    )
    prompts = [[1, 2, 3, 4], [5, 6]]
    want = generate(model, prompts, SpecConfig(max_new_tokens=16)).tokens
    got = generate(model, prompts, SpecConfig(max_new_tokens=16, gamma=3), drafter=ARDrafter(causal_copy(model)))
    assert got.tokens == want and got.metrics.accepted > 0
