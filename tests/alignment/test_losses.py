"""What every distillation loss shares: invalid slots change nothing (other hidden states and padded teachers
there, values and gradients), a window without valid slots contributes zero, streak products stop at the first
invalid slot; and the loss registry and settings (names against the config schema, input checks,
``LossSettings.from_config``). Each loss family's own tests: test_losses_streak.py (streak, ce_streak, expce, mdm),
test_losses_dflash.py (dflash_ce, dpace), test_losses_distillspec.py (distillspec, ar_distill and their
divergences), test_losses_chunked.py (chunked log-probs and memory flat in V).

    python -m pytest tests/alignment/test_losses.py -q
"""

import math

import pytest
import torch

from streakline.alignment.losses import DIVERGENCES, LOSSES, LossSettings
from streakline.config import schema
from tests.alignment.loss_cases import G, H, N, V, _case, _leaves, _run

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
