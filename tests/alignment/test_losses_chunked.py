"""Chunked log-probs (``streakline/alignment/chunked.py``): ``chunked_logprobs`` and ``logsumexp_chunked`` against
the naive log-softmax (values and gradients, fp32 and bf16, any chunk size), out-of-range ids refused, and memory
flat in V: the bytes autograd keeps and the largest tensor any op allocates at V = 50 000, for the log-probs and
for a full-vocabulary divergence.

    python -m pytest tests/alignment/test_losses_chunked.py -q
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

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


def test_chunked_logprobs_keeps_no_vocabulary_sized_tensor():
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


def test_full_vocabulary_divergence_keeps_no_fp32_vocabulary_tensor():
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
