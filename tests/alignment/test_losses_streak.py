"""The per-label losses against their formulas written out by hand from plain softmax probabilities: ``streak``,
``ce_streak`` (its streak weights carry no gradient), ``expce`` and ``mdm``; the per-slot metrics; and the streak
gradient against ``-Σ_j W_j ∇ℓ_j`` written out analytically (docs/algorithms.md section 4).

    python -m pytest tests/alignment/test_losses_streak.py -q
"""

import math

import pytest
import torch

from tests.alignment.loss_cases import TEMP, G, N, V, _case, _constant_weight_loss, _label_q, _leaves, _q, _run

# ---------------------------------------------------------------------------------------------------------------
# Each loss against its formula


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


def _ce_streak_weights(qx, inclusive=False, smoothing=0.0):
    """Slot m's weight written out: the product of the earlier slots' factors (through m with ``inclusive``), each
    factor ``(1 - s) q_j + s``, until the window's first invalid slot."""
    weights = torch.zeros(N, G, dtype=torch.float64)
    for n, row in enumerate(qx):
        prod = 1.0
        for j, q in enumerate(row):
            if q is None:
                break
            factor = (1.0 - smoothing) * q + smoothing
            weights[n, j] = prod * factor if inclusive else prod
            prod *= factor
    return weights


@pytest.mark.parametrize(
    ("inclusive", "smoothing"),
    [(False, 0.0), (True, 0.0), (False, 0.3), (True, 0.3), (False, 1.0)],
)
def test_ce_streak_matches_formula_with_constant_weights(inclusive, smoothing):
    """Eq. 9's weights (``inclusive``: through slot m) and ``method.streak_smoothing`` s, whose factors are
    ``(1 - s) q_j + s`` (s = 1: plain cross-entropy over the slots a product reaches); never with gradient."""
    hidden, weight, labels, valid, _ = _case(1)
    weights = _ce_streak_weights(_label_q(_q(hidden, weight), labels, valid), inclusive, smoothing)

    h, w = _leaves(hidden, weight)
    out = _run("ce_streak", h, w, labels, valid, inclusive=inclusive, streak_smoothing=smoothing)
    out.loss.backward()

    # The formula with the weights as plain constants: if the loss let gradient through its streak weights,
    # its gradient would differ from this one.
    ref, h_ref, w_ref = _constant_weight_loss(hidden, weight, labels, valid, weights, N)
    assert out.loss.item() == pytest.approx(ref.item(), rel=1e-5)
    torch.testing.assert_close(h.grad.double(), h_ref.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(w.grad.double(), w_ref.grad, rtol=1e-4, atol=1e-6)
    if smoothing == 0.0:  # the default path, bit for bit
        default = _run("ce_streak", hidden, weight, labels, valid, inclusive=inclusive)
        assert out.loss.item() == default.loss.item()


def test_ce_streak_refuses_smoothing_outside_0_1():
    hidden, weight, labels, valid, _ = _case(1)
    with pytest.raises(ValueError, match="streak_smoothing"):
        _run("ce_streak", hidden, weight, labels, valid, streak_smoothing=1.5)


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
