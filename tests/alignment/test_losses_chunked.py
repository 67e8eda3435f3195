"""Chunked log-probs (``streakline/alignment/chunked.py``): ``chunked_logprobs`` and ``logsumexp_chunked`` against
the naive log-softmax (values and gradients, fp32 and bf16, any chunk size), the same under autocast (bf16
products read in fp32, backward in the forward's precision, frozen weights' cached copies never stale),
out-of-range ids refused, backward's reuse of forward's chunk products on a CPU (bit for bit what the recompute
gives, and only under ``KEEP_CPU_BYTES``), and memory flat in V where the products are not kept: the bytes autograd
keeps and the largest tensor any op allocates at V = 50 000, for the log-probs and for a full-vocabulary divergence.

    python -m pytest tests/alignment/test_losses_chunked.py -q
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from streakline.alignment import chunked as chunked_module
from streakline.alignment.losses import chunked_divergence, chunked_logprobs, logsumexp_chunked, naive_logprobs
from tests.alignment.loss_cases import TEMP, H, V, _leaves

# ---------------------------------------------------------------------------------------------------------------
# chunked_logprobs


@pytest.mark.parametrize(
    "dtype, value_tol, grad_tol",
    [
        (torch.float32, dict(rtol=1e-5, atol=1e-5), dict(rtol=1e-4, atol=1e-5)),
        # bf16 inputs: both sides upcast the same bf16 values, so values agree to fp32 rounding; gradients are
        # rounded to bf16 on return (8 mantissa bits), hence a bf16-sized tolerance there.
        (torch.bfloat16, dict(rtol=1e-5, atol=1e-4), dict(rtol=1.6e-2, atol=1e-3)),
    ],
)
def test_chunked_logprobs_matches_naive(dtype, value_tol, grad_tol):
    M, k, Vb, Hb = 37, 3, 1001, 16
    hidden = torch.randn(M, Hb).to(dtype)
    weight = (torch.randn(Vb, Hb) * 0.5).to(dtype)
    ids = torch.randint(0, Vb, (M, k))
    ids[0] = torch.tensor([0, Vb - 1, Vb - 1])  # chunk edges, and a repeated id in one row
    upstream = torch.randn(M, k)

    grads = []
    for fn in (chunked_logprobs, naive_logprobs):
        h, w = _leaves(hidden, weight)
        extra = {"chunk": 128} if fn is chunked_logprobs else {}
        out = fn(h, w, ids, temperature=0.7, **extra)
        assert out.dtype == torch.float32 and out.shape == (M, k)
        (out * upstream).sum().backward()
        grads.append((out.detach(), h.grad, w.grad))
    (out_c, gh_c, gw_c), (out_n, gh_n, gw_n) = grads
    torch.testing.assert_close(out_c, out_n, **value_tol)
    assert gh_c.dtype == dtype and gw_c.dtype == dtype
    torch.testing.assert_close(gh_c.float(), gh_n.float(), **grad_tol)
    torch.testing.assert_close(gw_c.float(), gw_n.float(), **grad_tol)


@pytest.mark.parametrize("chunk", [1, 5, 23, 1000])
def test_chunked_logprobs_any_chunk_and_logsumexp(chunk):
    hidden, weight = torch.randn(6, H), torch.randn(V, H)
    ids = torch.randint(0, V, (6, 2))
    expected = torch.log_softmax(hidden.double() @ weight.double().T / TEMP, -1).gather(-1, ids)
    got = chunked_logprobs(hidden, weight, ids, temperature=TEMP, chunk=chunk)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    lse = logsumexp_chunked(hidden, weight, temperature=TEMP, chunk=chunk)
    torch.testing.assert_close(
        lse.double(), (hidden.double() @ weight.double().T / TEMP).logsumexp(-1), rtol=1e-5, atol=1e-5
    )


def test_chunked_logprobs_rejects_out_of_range_ids():
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 23\)"):
        chunked_logprobs(torch.randn(2, H), torch.randn(V, H), torch.tensor([[0], [V]]))


# ---------------------------------------------------------------------------------------------------------------
# Under autocast (stage=distill's mixed precision): bf16 products, fp32 reductions


def _bf16_logits(hidden, weight, temperature):
    """What one bf16 GEMM gives, read in fp32: the logits the chunks must reproduce under autocast (the temperature
    divides the hidden states before they are rounded, as ``chunked.py`` folds it in)."""
    return ((hidden / temperature).bfloat16() @ weight.bfloat16().T).float()


@pytest.mark.parametrize("trainable", [True, False])
def test_under_autocast_the_chunks_multiply_in_bf16_and_reduce_in_fp32(trainable):
    M, Vb, Hb, T = 29, 1001, 64, 0.7
    g = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(M, Hb, generator=g), torch.randn(Vb, Hb, generator=g) * 0.5
    ids, labels, upstream = torch.randint(0, Vb, (M, 2)), torch.randint(0, Vb, (M,)), torch.randn(M, 2)
    teacher = torch.randn(M, Vb, generator=g)
    exact = torch.log_softmax(hidden @ weight.T / T, -1)
    want = torch.log_softmax(_bf16_logits(hidden, weight, T), -1)  # fp32 softmax over bf16 products
    assert (want - exact).abs().max() > 1e-3  # the two are told apart: bf16 rounding is far above fp32's

    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(trainable)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = chunked_logprobs(h, w, ids, temperature=T, chunk=128)
        lse = logsumexp_chunked(h, w, temperature=T, chunk=128)
        div, label = chunked_divergence(h, w, teacher, labels, name="fkl", temperature=T, chunk=128)
    assert got.dtype == lse.dtype == div.dtype == torch.float32
    torch.testing.assert_close(got, want.gather(-1, ids), rtol=0, atol=2e-5)
    torch.testing.assert_close(label, want.gather(-1, labels[:, None])[:, 0], rtol=0, atol=2e-5)
    torch.testing.assert_close(lse, _bf16_logits(hidden, weight, T).logsumexp(-1), rtol=0, atol=2e-5)
    p = torch.softmax(teacher, -1)
    torch.testing.assert_close(div, (p * (p.log() - want)).sum(-1), rtol=0, atol=2e-5)

    # backward runs outside autocast, in the forward's precision: the exact gradient of these values, up to the
    # bf16 rounding of the upstream factor and the weight in the two products (8 mantissa bits)
    ((got * upstream).sum() + div.sum()).backward()
    h_ref, w_ref = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    logq = torch.log_softmax((h_ref @ w_ref.T) / T, -1)
    ((logq.gather(-1, ids) * upstream).sum() + (p * (p.log() - logq)).sum()).backward()
    scale = h_ref.grad.abs().max()
    assert (h.grad - h_ref.grad).abs().max() < 3e-2 * scale
    if trainable:
        assert (w.grad - w_ref.grad).abs().max() < 3e-2 * w_ref.grad.abs().max()
    else:
        assert w.grad is None


def test_a_frozen_weight_changed_in_place_is_not_read_from_its_stale_copy():
    hidden, weight = torch.randn(5, 32), torch.randn(300, 32)  # frozen: no grad, so its bf16 copy is cached
    first, other = weight.clone(), torch.randn(300, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        before = logsumexp_chunked(hidden, weight, chunk=64)
        assert torch.equal(logsumexp_chunked(hidden, weight, chunk=64), before)  # the cached copy: same values
        with torch.no_grad():
            weight.mul_(2.0)  # in place: a new version of the same tensor
        doubled = logsumexp_chunked(hidden, weight, chunk=64)
        weight.data = other  # another storage under the same tensor
        swapped = logsumexp_chunked(hidden, weight, chunk=64)
    for got, w in ((before, first), (doubled, 2 * first), (swapped, other)):
        torch.testing.assert_close(got, _bf16_logits(hidden, w, 1.0).logsumexp(-1), rtol=0, atol=2e-5)


# ---------------------------------------------------------------------------------------------------------------
# Backward reusing forward's products (a CPU, under KEEP_CPU_BYTES)


def _values_and_grads(autocast: bool, trainable: bool):
    """Both Functions' outputs and the gradients of a loss over them, on one fixed problem."""
    M, Vb, Hb, T = 23, 777, 48, 1.5
    g = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(M, Hb, generator=g), torch.randn(Vb, Hb, generator=g) * 0.5
    ids, labels, upstream = torch.randint(0, Vb, (M, 3), generator=g), torch.randint(0, Vb, (M,), generator=g), \
        torch.randn(M, 3, generator=g)  # fmt: skip
    teacher = torch.randn(M, Vb, generator=g)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(trainable)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        ell = chunked_logprobs(h, w, ids, temperature=T, chunk=100)
        div, label = chunked_divergence(h, w, teacher, labels, name="jsd", temperature=T, chunk=100)
    ((ell * upstream).sum() + div.sum()).backward()
    return [ell, div, label, h.grad] + ([w.grad] if trainable else [])


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("trainable", [False, True])
def test_backward_from_kept_products_is_the_recomputed_backward_bit_for_bit(monkeypatch, autocast, trainable):
    kept = _values_and_grads(autocast, trainable)
    monkeypatch.setattr(chunked_module, "KEEP_CPU_BYTES", 0)  # past the cap: backward multiplies every chunk again
    recomputed = _values_and_grads(autocast, trainable)
    for a, b in zip(kept, recomputed, strict=True):
        assert torch.equal(a, b)


def test_products_are_kept_on_a_cpu_only_and_only_under_the_cap(monkeypatch):
    hidden = torch.zeros(700, 8)
    assert chunked_module._keeps_products(hidden, 49_152, torch.bfloat16)  # SmolLM2's head: 69 MB in bf16
    monkeypatch.setattr(chunked_module, "KEEP_CPU_BYTES", 700 * 49_152 * 2 - 1)
    assert not chunked_module._keeps_products(hidden, 49_152, torch.bfloat16)
    assert chunked_module._keeps_products(hidden, 49_152 // 2, torch.bfloat16)
    assert not chunked_module._keeps_products(hidden, 49_152 // 2, torch.float32)  # fp32 products take twice the bytes
    assert not chunked_module._keeps_products(torch.zeros(1, 8, device="meta"), 10, torch.bfloat16)  # not a CPU


# ---------------------------------------------------------------------------------------------------------------
# Memory flat in V

BIG_V, BIG_M, BIG_H = 50_000, 64, 32


def _saved_bytes(fn, inputs):
    """Bytes the autograd graph of ``fn(*inputs)`` keeps alive beyond the inputs themselves."""
    known = {t.untyped_storage().data_ptr() for t in inputs}
    saved = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in known:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*inputs)
    return sum(saved.values()), out


class _LargestOutput(TorchDispatchMode):
    """Largest tensor any op allocates, in elements. Views of an op's inputs (detach, slices) allocate nothing and
    are skipped, and so is ``[V, H]`` (the weight gradient, which training needs anyway)."""

    def __init__(self, skip_shape):
        super().__init__()
        self.skip, self.largest = tuple(skip_shape), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves = tree_leaves((args, kwargs))
        inputs = {t.untyped_storage().data_ptr() for t in leaves if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) == self.skip:
                continue
            if t.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, t.numel())
        return out


def _big():
    hidden = torch.randn(BIG_M, BIG_H, requires_grad=True)
    weight = (torch.randn(BIG_V, BIG_H) * 0.1).requires_grad_(True)
    return hidden, weight, torch.randint(0, BIG_V, (BIG_M, 1))


def test_chunked_logprobs_keeps_no_vocabulary_sized_tensor(monkeypatch):
    monkeypatch.setattr(chunked_module, "KEEP_CPU_BYTES", 0)  # the flat path: a GPU's, and a CPU's past the cap
    hidden, weight, ids = _big()
    budget = BIG_M * BIG_V * 4 // 4
    naive, out_n = _saved_bytes(lambda h, w, i: naive_logprobs(h, w, i), (hidden, weight, ids))
    assert naive >= BIG_M * BIG_V * 4  # the measure does see an [M, V] fp32 tensor when there is one
    chunked, out_c = _saved_bytes(lambda h, w, i: chunked_logprobs(h, w, i, chunk=2048), (hidden, weight, ids))
    assert chunked < budget, f"chunked path saves {chunked} bytes, budget {budget}"
    torch.testing.assert_close(out_c, out_n.detach(), rtol=1e-5, atol=1e-5)

    # Transients too: no op in forward or backward produces anything near [M, V].
    for fn, bound in ((naive_logprobs, None), (lambda h, w, i: chunked_logprobs(h, w, i, chunk=2048), budget // 4)):
        h, w = _leaves(hidden.detach(), weight.detach())
        with _LargestOutput(weight.shape) as mode:
            fn(h, w, ids).sum().backward()
        if bound is None:
            assert mode.largest >= BIG_M * BIG_V
        else:
            assert mode.largest < bound, f"an op produced {mode.largest} elements"


def test_full_vocabulary_divergence_keeps_no_fp32_vocabulary_tensor(monkeypatch):
    monkeypatch.setattr(chunked_module, "KEEP_CPU_BYTES", 0)
    hidden, weight, ids = _big()
    teacher = torch.randn(BIG_M, BIG_V).bfloat16()
    budget = BIG_M * BIG_V * 4 // 4

    def run(h, w, t, i):
        return chunked_divergence(h, w, t, i[:, 0], name="jsd", chunk=2048)[0]

    saved, _ = _saved_bytes(run, (hidden, weight, teacher, ids))
    assert saved < budget
    with _LargestOutput(weight.shape) as mode:
        run(hidden, weight, teacher, ids).sum().backward()
    assert mode.largest < budget // 4, f"an op produced {mode.largest} elements"
