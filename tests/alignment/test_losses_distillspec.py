"""Teacher distillation (``distillspec`` and ``ar_distill``) with every divergence (fkl, rkl, jsd, tvd): values and
gradients against the formula from explicit probabilities, for a full-vocabulary teacher and a stored top-k one;
top-k at k = V equal to the full vocabulary; drafter mass outside the teacher's top-k seen; padded and float16
teacher log-probs kept finite; zero divergence when teacher equals drafter; tvd's subgradient at ties; and the
error without a teacher.

    python -m pytest tests/alignment/test_losses_distillspec.py -q
"""

import math

import pytest
import torch

from streakline.alignment.losses import DIVERGENCES
from tests.alignment.loss_cases import TEMP, V, _case, _leaves, _run

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
