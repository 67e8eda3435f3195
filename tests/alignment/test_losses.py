"""Distillation losses: chunked log-probs against the naive log-softmax, every loss against its formula written out
by hand from plain softmax probabilities, invalid slots, stop-gradients, divergences, and vocabulary memory; for the
DFlash trainers' losses also dflash_ce's decay for the block size and D-PACE's weights by hand and its gradient at
alpha = 0 against streak's (speculators' own D-PACE is compared in test_dpace_speculators.py)."""

import math
import re

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from streakline.alignment.losses import (
    DIVERGENCES,
    LOSSES,
    LossInput,
    LossSettings,
    chunked_divergence,
    chunked_logprobs,
    compute_loss,
    dflash_decay_gamma,
    dpace_weights,
    logsumexp_chunked,
    naive_logprobs,
)
from streakline.config import schema

N, G, H, V = 4, 5, 8, 23
TEMP = 0.7
VALID_LEN = [5, 3, 1, 0]  # window 3 has no valid slot at all


def _valid(lengths=VALID_LEN, width=G):
    return torch.tensor([[j < n for j in range(width)] for n in lengths])


def _case(seed=0, lengths=VALID_LEN):
    """Small hand-made windows: random hidden/weight/teacher, labels junk (-100) at invalid slots."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(len(lengths), G, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.7
    valid = _valid(lengths)
    labels = torch.where(valid, torch.randint(0, V, (len(lengths), G), generator=g), -100)
    teacher = torch.randn(len(lengths), G, V, generator=g) * 1.5
    return hidden, weight, labels, valid, teacher


def _q(hidden, weight, temperature=TEMP):
    """``[N, G, V]`` float64 drafter probabilities by plain softmax (the independent reference)."""
    return torch.softmax(hidden.double() @ weight.double().T / temperature, -1)


def _constant_weight_loss(hidden, weight, labels, valid, weights, denominator):
    """``-Σ weights·ℓ / denominator`` in float64 with ``weights`` as plain constants, backpropagated: the reference
    for a loss whose slot weights must carry no gradient. Returns the loss and its two leaves (their ``.grad`` set)."""
    h_ref, w_ref = _leaves(hidden.double(), weight.double())
    logq = torch.log_softmax(h_ref @ w_ref.T / TEMP, -1)
    ell = logq.gather(-1, torch.where(valid, labels, 0)[..., None])[..., 0]
    ref = -(weights * torch.where(valid, ell, 0.0)).sum() / denominator
    ref.backward()
    return ref, h_ref, w_ref


def _leaves(hidden, weight):
    return hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)


def _run(name, hidden, weight, labels, valid, temperature=TEMP, **kw):
    names = ("lam", "inclusive", "divergence", "beta", "decay_gamma", "dpace_alpha", "chunk")
    settings = {k: kw.pop(k) for k in names if k in kw}
    settings.setdefault("chunk", 7)  # several chunks over V = 23, the last one short
    inp = LossInput(hidden, weight, labels, valid, temperature=temperature, **kw)
    return compute_loss(inp, LossSettings(name=name, **settings))


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
# Each loss against its formula


def _label_q(q, labels, valid):
    """``[N][G]`` python floats q_j(x_j), None at invalid slots."""
    return [[float(q[n, j, labels[n, j]]) if valid[n, j] else None for j in range(G)] for n in range(len(q))]


def test_streak_matches_formula():
    hidden, weight, labels, valid, _ = _case()
    out = _run("streak", hidden, weight, labels, valid)
    qx = _label_q(_q(hidden, weight), labels, valid)
    total = 0.0
    for row in qx:
        prod = 1.0
        for q in row:
            if q is None:
                break
            prod *= q
            total += prod
    assert out.loss.item() == pytest.approx(-total / N, rel=1e-5)
    assert out.metrics["streak_q"] == pytest.approx(total / N, rel=1e-5)
    assert out.metrics["loss"] == pytest.approx(out.loss.item())


@pytest.mark.parametrize("inclusive", [False, True])
def test_ce_streak_matches_formula_with_constant_weights(inclusive):
    hidden, weight, labels, valid, _ = _case(1)
    qx = _label_q(_q(hidden, weight), labels, valid)
    weights = torch.zeros(N, G, dtype=torch.float64)
    for n, row in enumerate(qx):
        prod = 1.0
        for j, q in enumerate(row):
            if q is None:
                break
            weights[n, j] = prod * q if inclusive else prod
            prod *= q

    h, w = _leaves(hidden, weight)
    out = _run("ce_streak", h, w, labels, valid, inclusive=inclusive)
    out.loss.backward()

    # The formula with the weights as plain constants: if the loss let gradient through its streak weights,
    # its gradient would differ from this one.
    ref, h_ref, w_ref = _constant_weight_loss(hidden, weight, labels, valid, weights, N)
    assert out.loss.item() == pytest.approx(ref.item(), rel=1e-5)
    torch.testing.assert_close(h.grad.double(), h_ref.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(w.grad.double(), w_ref.grad, rtol=1e-4, atol=1e-6)


def test_expce_matches_formula():
    hidden, weight, labels, valid, _ = _case(2)
    qx = _label_q(_q(hidden, weight), labels, valid)
    lam = 0.8
    total = sum(lam**j * math.log(q) for row in qx for j, q in enumerate(row) if q is not None)
    out = _run("expce", hidden, weight, labels, valid, lam=lam)
    assert out.loss.item() == pytest.approx(-total / N, rel=1e-5)


def test_mdm_matches_formula_at_temperature_one():
    hidden, weight, labels, valid, _ = _case(3)
    masked = torch.rand(N, G) < 0.6
    rate = torch.tensor([0.3, 0.9, 0.5, 0.1])
    qx = _label_q(_q(hidden, weight, temperature=1.0), labels, valid)
    total = sum(math.log(qx[n][j]) / float(rate[n]) for n in range(N) for j in range(G) if valid[n, j] and masked[n, j])
    out = _run("mdm", hidden, weight, labels, valid, temperature=TEMP, masked=masked, rate=rate)
    assert out.loss.item() == pytest.approx(-total / int(valid.sum()), rel=1e-5)


def test_metrics_per_slot_mean_and_none_where_no_window_is_valid():
    hidden, weight, labels, valid, _ = _case(4, lengths=[4, 2, 3, 0])  # slot 5 invalid everywhere
    out = _run("expce", hidden, weight, labels, valid)
    qx = _label_q(_q(hidden, weight), labels, valid)
    for j in range(G):
        seen = [row[j] for row in qx if row[j] is not None]
        if seen:
            assert out.metrics["q_mean_j"][j] == pytest.approx(sum(seen) / len(seen), rel=1e-5)
        else:
            assert out.metrics["q_mean_j"][j] is None
    assert out.metrics["q_mean_j"][G - 1] is None


def test_streak_gradient_is_the_weighted_sum_of_label_gradients():
    """docs/algorithms.md section 4: ∇ streak = Σ_j W_j ∇ℓ_j with W_j = Σ_{m≥j} Π_{i≤m} q_i(x_i); here ∇ℓ_j is
    written out analytically, ∇_h log softmax(h Wᵀ/T)[x] = (W[x] - Σ_v q_v W[v]) / T, and likewise for W."""
    hidden, weight, labels, valid, _ = _case(5)
    h, w = _leaves(hidden, weight)
    _run("streak", h, w, labels, valid).loss.backward()

    q = _q(hidden, weight)
    qx = _label_q(q, labels, valid)
    W = torch.zeros(N, G, dtype=torch.float64)
    for n, row in enumerate(qx):
        prods, prod = [], 1.0
        for x in row:
            if x is None:
                break
            prod *= x
            prods.append(prod)
        for j in range(len(prods)):
            W[n, j] = sum(prods[j:])
    wd, hd = weight.double(), hidden.double()
    onehot = torch.nn.functional.one_hot(torch.where(valid, labels, 0), V).double()
    dlogits = (onehot - q) / TEMP  # dℓ/dz per slot, [N, G, V]
    expected_h = -(W[..., None] * (dlogits @ wd)) / N
    expected_w = -torch.einsum("ng,ngv,ngh->vh", W, dlogits, hd) / N
    torch.testing.assert_close(h.grad.double(), expected_h, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(w.grad.double(), expected_w, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# dflash_ce's decay for the block size, and D-PACE


def test_dflash_decay_gamma_is_the_papers_at_its_block_sizes_and_linear_elsewhere():
    assert [dflash_decay_gamma(b) for b in (8, 10, 16)] == [4.0, 5.0, 7.0]  # the paper's table
    assert dflash_decay_gamma(9) == 4.5  # tiny-dflash: blocks of 9, windows of 8
    assert [dflash_decay_gamma(b) for b in (2, 4, 5)] == [1.0, 2.0, 2.5]  # below 10: B / 2, the 8-10 segment
    assert dflash_decay_gamma(13) == pytest.approx(6.0) and dflash_decay_gamma(22) == pytest.approx(9.0)
    with pytest.raises(ValueError, match="block_size must be >= 2"):
        dflash_decay_gamma(1)


def test_dflash_ce_without_decay_gamma_uses_the_papers_value_for_g_plus_one_slots():
    hidden, weight, labels, valid, _ = _case(12)  # G = 5 slots: blocks of 6, γ = 3
    derived = _run("dflash_ce", hidden, weight, labels, valid).loss
    qx = _label_q(_q(hidden, weight), labels, valid)
    total = sum(math.exp(-j / 3.0) * math.log(q) for row in qx for j, q in enumerate(row) if q is not None)
    norm = sum(math.exp(-j / 3.0) for row in qx for j, q in enumerate(row) if q is not None)
    assert derived.item() == pytest.approx(-total / norm, rel=1e-5)
    assert derived.item() == _run("dflash_ce", hidden, weight, labels, valid, decay_gamma=3.0).loss.item()
    seven = _run("dflash_ce", hidden, weight, labels, valid, decay_gamma=7.0).loss
    assert derived.item() != pytest.approx(seven.item())  # an explicit value still wins


def test_dpace_weights_by_hand():
    q = torch.tensor([[0.5, 0.2, 0.9], [0.5, 0.2, 0.9], [0.5, 0.2, 0.9]])
    valid = torch.tensor([[True, True, True], [True, True, False], [True, False, True]])
    # s = 0.5 q + 0.5 = 0.75, 0.6, 0.95; prefix products 0.75, 0.45, 0.4275; suffix sums of those
    want = torch.tensor([[1.6275, 0.8775, 0.4275], [1.2, 0.45, 0.0], [0.75, 0.0, 0.0]])
    torch.testing.assert_close(dpace_weights(q, valid, 0.5), want)
    # α = 1: every factor is 1, so W_j counts the reached slots from j on; α = 0: the streak's W_j
    torch.testing.assert_close(dpace_weights(q, valid, 1.0), torch.tensor([[3.0, 2, 1], [2, 1, 0], [1, 0, 0]]))
    streak_w = [0.5 + 0.1 + 0.09, 0.1 + 0.09, 0.09]
    torch.testing.assert_close(dpace_weights(q, valid, 0.0)[0], torch.tensor(streak_w))


def _dpace_reference_weights(qx, alpha):
    """``[N, G]`` float64 W_j = Σ_{m≥j} Π_{i≤m} ((1 - α) q_i + α), written out over each window's valid prefix."""
    W = torch.zeros(len(qx), G, dtype=torch.float64)
    for n, row in enumerate(qx):
        prods, prod = [], 1.0
        for q in row:
            if q is None:
                break
            prod *= (1 - alpha) * q + alpha
            prods.append(prod)
        for j in range(len(prods)):
            W[n, j] = sum(prods[j:])
    return W


@pytest.mark.parametrize("alpha", [0.5, 0.2, 1.0])
def test_dpace_matches_formula_with_constant_weights(alpha):
    hidden, weight, labels, valid, _ = _case(13)
    W = _dpace_reference_weights(_label_q(_q(hidden, weight), labels, valid), alpha)

    h, w = _leaves(hidden, weight)
    out = _run("dpace", h, w, labels, valid, dpace_alpha=alpha)
    out.loss.backward()

    # The formula with the weights as plain constants, over the batch's valid slots: were any gradient to flow
    # through the weights (the drafter's own q), the loss's gradient would differ from this one.
    ref, h_ref, w_ref = _constant_weight_loss(hidden, weight, labels, valid, W, int(valid.sum()))
    assert out.loss.item() == pytest.approx(ref.item(), rel=1e-5)
    torch.testing.assert_close(h.grad.double(), h_ref.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(w.grad.double(), w_ref.grad, rtol=1e-4, atol=1e-6)
    assert set(out.metrics) == {"loss", "q_mean_j", "streak_q"}


def test_dpace_at_alpha_zero_has_the_streak_gradient():
    """docs/algorithms.md section 4: at α = 0 the D-PACE weights are the streak gradient's W_j, so the two losses'
    gradients are equal up to their normalisers (windows for streak, valid slots for dpace)."""
    hidden, weight, labels, valid, _ = _case(14)
    grads = {}
    for name in ("streak", "dpace"):
        h, w = _leaves(hidden, weight)
        _run(name, h, w, labels, valid, dpace_alpha=0.0).loss.backward()
        grads[name] = (h.grad, w.grad)
    scale = int(valid.sum()) / N
    for streak_grad, dpace_grad in zip(grads["streak"], grads["dpace"], strict=True):
        assert streak_grad.abs().max() > 1e-4  # not vacuous
        torch.testing.assert_close(dpace_grad * scale, streak_grad, rtol=1e-5, atol=1e-7)
    # and at the default α they differ: the smoothing is what D-PACE adds
    h, _ = _leaves(hidden, weight)
    _run("dpace", h, weight, labels, valid).loss.backward()
    assert not torch.allclose(h.grad * scale, grads["streak"][0], rtol=1e-3, atol=1e-6)


def test_dpace_refuses_an_alpha_outside_zero_one():
    hidden, weight, labels, valid, _ = _case()
    with pytest.raises(ValueError, match=r"method.dpace_alpha"):
        _run("dpace", hidden, weight, labels, valid, dpace_alpha=1.5)


# ---------------------------------------------------------------------------------------------------------------
# Divergences


def _kl(a, b):
    return torch.where(a > 0, a * (a.log() - b.log()), 0.0).sum(-1)


def _divergence(name, p, q, beta):
    if name == "fkl":
        return _kl(p, q)
    if name == "rkl":
        return _kl(q, p)
    if name == "jsd":
        m = beta * p + (1 - beta) * q
        return beta * _kl(p, m) + (1 - beta) * _kl(q, m)
    return 0.5 * (p - q).abs().sum(-1)


def _distill_reference(name, hidden, weight, teacher, valid, beta, topk_ids=None, slot1=False):
    """The distillspec / ar_distill formula from explicit probabilities (float64, differentiable). With
    ``topk_ids`` the ``teacher`` holds stored log-probs: p is their exp on the k ids (not renormalised), q the
    drafter's full-vocabulary probabilities there, and one more bucket per side holds the mass on every other id
    (for q summed over those ids directly, not taken as a remainder)."""
    q = torch.softmax(hidden @ weight.T / TEMP, -1)
    if topk_ids is None:
        p = torch.softmax(teacher.double(), -1)
    else:
        outside = torch.ones_like(q, dtype=torch.bool).scatter(-1, topk_ids, False)
        p_k = teacher.double().exp().gather(-1, topk_ids)
        p = torch.cat([p_k, 1 - p_k.sum(-1, keepdim=True)], -1)
        q = torch.cat([q.gather(-1, topk_ids), torch.where(outside, q, 0.0).sum(-1, keepdim=True)], -1)
    d = torch.where(valid, _divergence(name, p, q, beta), 0.0)
    if slot1:
        return d[:, 0].sum() / valid[:, 0].sum()
    return (d.sum(1) / valid.sum(1).clamp(min=1)).mean()


@pytest.mark.parametrize("name", sorted(DIVERGENCES))
@pytest.mark.parametrize("teacher_kind", ["full", "topk"])
@pytest.mark.parametrize("loss", ["distillspec", "ar_distill"])
def test_distillation_matches_formula_values_and_gradients(name, teacher_kind, loss):
    hidden, weight, labels, valid, teacher = _case(6)
    beta = 0.3
    topk_ids = teacher.topk(6, -1).indices
    kw = {"teacher_logits": teacher}
    if teacher_kind == "topk":
        kw = {"teacher_ids": topk_ids, "teacher_logprobs": teacher.log_softmax(-1).gather(-1, topk_ids).half()}
    h, w = _leaves(hidden, weight)
    out = _run(loss, h, w, labels, valid, divergence=name, beta=beta, **kw)
    out.loss.backward()

    h_ref, w_ref = _leaves(hidden.double(), weight.double())
    # the stored teacher log-probs are float16: the reference sees the same rounding
    t_ref = teacher if teacher_kind == "full" else teacher.log_softmax(-1).half().double()
    ref = _distill_reference(
        name, h_ref, w_ref, t_ref, valid, beta, topk_ids if teacher_kind == "topk" else None, loss == "ar_distill"
    )
    ref.backward()
    assert out.loss.item() == pytest.approx(ref.item(), rel=1e-4, abs=1e-6)
    torch.testing.assert_close(h.grad.double(), h_ref.grad, rtol=1e-3, atol=1e-6)
    torch.testing.assert_close(w.grad.double(), w_ref.grad, rtol=1e-3, atol=1e-6)
    assert out.metrics["divergence"] > 0


@pytest.mark.parametrize("name", sorted(DIVERGENCES))
@pytest.mark.parametrize("loss", ["distillspec", "ar_distill"])
def test_topk_with_k_equal_v_equals_full_vocabulary(name, loss):
    """At k = V the stored top-k is the whole teacher and the lumped rest bucket is empty on both sides, so the
    top-k path must give the full-vocabulary divergence, values and gradients (both paths compute in fp32)."""
    hidden, weight, labels, valid, teacher = _case(7)
    order = teacher.argsort(-1, descending=True)  # k = V, in the order a top-k store would keep them
    results = []
    for kw in (
        {"teacher_logits": teacher},
        {"teacher_ids": order, "teacher_logprobs": teacher.log_softmax(-1).gather(-1, order)},
    ):
        h, w = _leaves(hidden, weight)
        out = _run(loss, h, w, labels, valid, divergence=name, beta=0.3, **kw)
        out.loss.backward()
        results.append((out.loss.detach(), h.grad, w.grad))
    for full, topk in zip(*results, strict=True):
        torch.testing.assert_close(full, topk, rtol=1e-5, atol=1e-6)


FREE = 0  # the drafter id whose logit _drafter_with_a_free_logit lets a test raise


def _drafter_with_a_free_logit(seed, k):
    """A drafter whose logit of id ``FREE`` can be raised for every slot at once (hidden coordinate 0 is 1, so
    ``weight[FREE, 0]`` shifts that logit alone), and a stored top-k teacher with exactly the drafter's shape on
    its k ids: the drafter's own top k (``FREE`` excluded), every other logit lowered by 3."""
    hidden, weight, labels, valid, _ = _case(seed)
    hidden[..., 0] = 1.0
    logits = hidden @ weight.T / TEMP
    ids = logits.index_fill(-1, torch.tensor([FREE]), -math.inf).topk(k, -1).indices
    teacher = torch.where(torch.zeros_like(logits, dtype=torch.bool).scatter(-1, ids, True), logits, logits - 3.0)
    return hidden, weight, labels, valid, ids, teacher.log_softmax(-1).gather(-1, ids)


@pytest.mark.parametrize("name", sorted(DIVERGENCES))
@pytest.mark.parametrize("loss", ["distillspec", "ar_distill"])
def test_topk_loss_sees_drafter_mass_outside_the_teacher_topk(name, loss):
    """q's shape on the teacher's k ids matches p's, but the drafter keeps more mass outside them than the teacher.
    Renormalising q on the k ids would hide that (loss 0, and 0 again after the drafter moves even more mass out);
    with q over the full vocabulary and one lumped rest bucket the loss is positive, grows when the logit of an id
    outside the top-k is raised, and its gradient pushes that logit down."""
    hidden, weight, labels, valid, ids, logp = _drafter_with_a_free_logit(12, k=5)
    kw = {"teacher_ids": ids, "teacher_logprobs": logp, "divergence": name, "beta": 0.3}
    h, w = _leaves(hidden, weight)
    before = _run(loss, h, w, labels, valid, **kw)
    before.loss.backward()
    assert before.loss.item() > 5e-3
    assert w.grad[FREE, 0] > 0  # gradient descent lowers the logit of the id outside the top-k
    moved = weight.clone()
    moved[FREE, 0] += 2.0  # raises that logit by 2 / TEMP in every slot; the other logits stay as they were
    after = _run(loss, hidden, moved, labels, valid, **kw)
    assert after.loss.item() > 1.5 * before.loss.item()


@pytest.mark.parametrize("name", sorted(DIVERGENCES))
def test_topk_padding_and_float16_rounding_stay_finite(name):
    """Invalid slots padded with -inf log-probs and out-of-range ids; valid slots whose float16 log-probs sum to
    more than 1 or sit a hair above 0 (as rounding leaves them), or put all the mass on the k ids: the loss and its
    gradients stay finite."""
    hidden, weight, labels, valid, teacher = _case(13)
    k = 4
    ids = teacher.topk(k, -1).indices
    logp = teacher.log_softmax(-1).gather(-1, ids).half()
    logp[0, 0] = torch.tensor([0.0, -20.0, -20.0, -20.0]).half()  # the k ids hold everything: no rest mass
    logp[0, 1] = torch.tensor([5e-4, -9.0, -9.0, -9.0]).half()  # a hair above 0: p sums to more than 1
    logp[0, 2] = torch.tensor([-0.6931, -0.6931, -12.0, -12.0]).half()  # two halves, rounded up past 1 in total
    logp[~valid] = -math.inf
    ids[~valid] = torch.tensor([-1, V + 5, 0, 0])
    for loss in ("distillspec", "ar_distill"):
        h, w = _leaves(hidden, weight)
        out = _run(loss, h, w, labels, valid, divergence=name, teacher_ids=ids, teacher_logprobs=logp)
        out.loss.backward()
        assert torch.isfinite(out.loss) and out.loss.item() >= 0
        assert torch.isfinite(h.grad).all() and torch.isfinite(w.grad).all()
        assert (h.grad[~valid] == 0).all()


@pytest.mark.parametrize("name", sorted(DIVERGENCES))
def test_divergence_is_zero_when_teacher_equals_drafter(name):
    hidden, weight, labels, valid, _ = _case(8)
    teacher = hidden @ weight.T / TEMP
    h, w = _leaves(hidden, weight)
    out = _run("distillspec", h, w, labels, valid, divergence=name, teacher_logits=teacher)
    out.loss.backward()
    assert abs(out.loss.item()) < 1e-6
    assert h.grad.abs().max() < 1e-5 and w.grad.abs().max() < 1e-5


def test_tvd_subgradient_is_zero_at_ties_and_the_sign_elsewhere():
    """|p - q| has no derivative at p = q: a tie (equal up to rounding) gets the zero subgradient, a real gap the
    sign, whatever the dtype."""
    from streakline.alignment.losses import divergence_terms

    for dtype in (torch.float32, torch.float64):
        logp = torch.randn(3, V, generator=torch.Generator().manual_seed(1), dtype=dtype).log_softmax(-1)
        eps = torch.finfo(dtype).eps
        rounding = logp * (1 + 4 * eps)  # a few units in the last place away: rounding noise, not a gap
        gap = logp.clone()
        gap[:, 0] += 1e-3  # one real difference of 0.1%
        for logq, tied in ((logp.clone(), True), (rounding, True), (gap, False)):
            logq = logq.clone().requires_grad_(True)
            divergence_terms("tvd", logp, logq).sum().backward()
            if tied:
                assert logq.grad.abs().max() == 0
            else:
                q = logq.detach().exp()
                expected = torch.zeros_like(q)
                expected[:, 0] = 0.5 * q[:, 0]  # d/dlog q of ½|p - q| with q > p: ½ q
                torch.testing.assert_close(logq.grad, expected)


def test_distillation_without_teacher_says_how_to_get_one():
    hidden, weight, labels, valid, _ = _case()
    for loss in ("distillspec", "ar_distill"):
        with pytest.raises(ValueError, match=r"data.topk_logprobs=20 in stage=trajectories.*method.teacher=online"):
            _run(loss, hidden, weight, labels, valid)


# ---------------------------------------------------------------------------------------------------------------
# Invalid slots


def _all_inputs(hidden, weight, labels, valid, teacher, kind):
    kw = {"masked": torch.ones(len(labels), G, dtype=torch.bool), "rate": torch.full((len(labels),), 0.5)}
    if kind == "full":
        kw["teacher_logits"] = teacher
    else:
        ids = teacher.topk(4, -1).indices
        kw |= {"teacher_ids": ids, "teacher_logprobs": teacher.log_softmax(-1).gather(-1, ids)}
    return kw


CASES = [(loss, "full") for loss in ("streak", "ce_streak", "expce", "dflash_ce", "dpace", "mdm")] + [
    (loss, kind) for loss in ("distillspec", "ar_distill") for kind in ("full", "topk")
]


@pytest.mark.parametrize("loss, kind", CASES)
def test_invalid_slots_change_nothing(loss, kind):
    hidden, weight, labels, valid, teacher = _case(9)
    results = []
    for junk in (False, True):
        h, t = hidden.clone(), teacher.clone()
        if junk:
            # other hidden states, and a padded teacher row (-inf everywhere), at every invalid slot
            h[~valid] = torch.randn(int((~valid).sum()), H) * 10
            t[~valid] = -math.inf
        h, w = _leaves(h, weight)
        out = _run(loss, h, w, labels, valid, divergence="jsd", **_all_inputs(h, w, labels, valid, t, kind))
        out.loss.backward()
        assert torch.isfinite(out.loss) and torch.isfinite(w.grad).all()
        assert (h.grad[~valid] == 0).all()
        results.append((out.loss.detach(), h.grad[valid], w.grad))
    for clean, junked in zip(*results, strict=True):
        torch.testing.assert_close(clean, junked, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("loss, kind", CASES)
def test_window_without_valid_slots_contributes_zero(loss, kind):
    hidden, weight, labels, valid, teacher = _case(10)
    keep = valid.any(1)
    both = _run(loss, hidden, weight, labels, valid, **_all_inputs(hidden, weight, labels, valid, teacher, kind))
    sub = [x[keep] for x in (hidden, labels, valid, teacher)]
    alone = _run(loss, sub[0], weight, sub[1], sub[2], **_all_inputs(sub[0], weight, sub[1], sub[2], sub[3], kind))
    # window averages divide by every window; mdm and dpace divide by valid slots, dflash_ce by their weights and
    # ar_distill by windows with v_1
    scale = len(labels) / int(keep.sum()) if loss in ("streak", "ce_streak", "expce", "distillspec") else 1.0
    assert both.loss.item() * scale == pytest.approx(alone.loss.item(), rel=1e-5)


def test_products_stop_at_the_first_invalid_slot_even_without_a_prefix():
    """A hole in ``valid`` must end the streak there, never bridge it as a probability of 1."""
    hidden, weight, _, _, _ = _case(11)
    labels = torch.randint(0, V, (N, G))
    holed = torch.tensor([[True, False, True, True, True]] * N)
    prefix = torch.tensor([[True, False, False, False, False]] * N)
    for loss in ("streak", "ce_streak", "dpace"):  # dpace also divides by the slots reached, not the valid ones
        a = _run(loss, hidden, weight, labels, holed).loss
        b = _run(loss, hidden, weight, labels, prefix).loss
        assert a.item() == pytest.approx(b.item(), rel=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# Registry and settings


def test_registry_matches_config_schema_and_rejects_unknown_names():
    assert set(LOSSES) == set(schema.LOSSES)
    assert set(DIVERGENCES) == set(schema.DIVERGENCES)
    hidden, weight, labels, valid, _ = _case()
    with pytest.raises(ValueError, match=r"unknown loss 'streek'; valid: \['ar_distill', 'ce_streak'"):
        _run("streek", hidden, weight, labels, valid)
    with pytest.raises(ValueError, match="mdm needs LossInput.masked"):
        _run("mdm", hidden, weight, labels, valid)
    with pytest.raises(ValueError, match=r"labels must be \[N, G\]"):
        _run("streak", hidden, weight, labels[:, :2], valid)


def test_settings_from_method_config():
    method = schema.MethodConfig(
        name="x", loss="ce_streak", lam=0.5, inclusive=True, divergence="tvd", beta=0.2, decay_gamma=4.0,
        dpace_alpha=0.3,
    )  # fmt: skip
    s = LossSettings.from_config(method, chunk=512)
    got = (s.name, s.lam, s.inclusive, s.divergence, s.beta, s.decay_gamma, s.dpace_alpha, s.chunk)
    assert got == ("ce_streak", 0.5, True, "tvd", 0.2, 4.0, 0.3, 512)
    # the schema's defaults are the loss settings' own: decay_gamma None (the paper's for the block size)
    default = LossSettings.from_config(schema.MethodConfig(name="x", loss="dflash_ce"))
    assert (default.decay_gamma, default.dpace_alpha) == (LossSettings.decay_gamma, LossSettings.dpace_alpha)
    assert default.decay_gamma is None


@pytest.mark.parametrize(
    ("overrides", "error"),
    [
        (["method=dflash_ce"], None),  # decay_gamma unset: the paper's for the block size
        (["method=dflash_ce", "method.decay_gamma=7"], None),
        (["method=dflash_ce", "method.decay_gamma=0"], "method.decay_gamma=0.0 is not valid; it must be > 0"),
        (["method=dpace", "method.dpace_alpha=0"], None),
        (["method=dpace", "method.dpace_alpha=1.5"], "method.dpace_alpha=1.5 is not valid; it must lie in [0.0, 1.0]"),
    ],
)
def test_config_validation_of_the_dflash_knobs(overrides, error):
    from streakline.config import ConfigError, compose_config

    if error is None:
        cfg = compose_config(overrides)
        assert LossSettings.from_config(cfg.method).name == cfg.method.loss
    else:
        with pytest.raises(ConfigError, match=re.escape(error)):
            compose_config(overrides)


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
