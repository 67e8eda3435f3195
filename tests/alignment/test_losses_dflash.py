"""The DFlash trainers' losses: ``dflash_ce``'s decay for the block size (the paper's gamma, and the value it
uses when none is set), D-PACE's weights by hand, ``dpace`` against its formula with constant weights and its
gradient at alpha = 0 against streak's, and the config validation of their knobs (``method.decay_gamma``,
``method.dpace_alpha``). Speculators' own D-PACE is compared in test_dpace_speculators.py.

    python -m pytest tests/alignment/test_losses_dflash.py -q
"""

import math
import re

import pytest
import torch

from streakline.alignment.losses import LossSettings, dflash_decay_gamma, dpace_weights
from tests.alignment.loss_cases import G, N, _case, _constant_weight_loss, _label_q, _leaves, _q, _run

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
# Their knobs in the config


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
