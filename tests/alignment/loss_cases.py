"""Small hand-made loss inputs and the plain-softmax references shared by the loss tests
(``tests/alignment/test_losses*.py``): N windows of G slots, hidden size H, vocabulary V, and ``_run`` to call a
registered loss through ``compute_loss`` with the settings the tests vary.

    python -m pytest tests/alignment/test_losses*.py -q
"""

import torch

from streakline.alignment.losses import LossInput, LossSettings, compute_loss

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
    names = ("lam", "inclusive", "streak_smoothing", "divergence", "beta", "decay_gamma", "dpace_alpha", "chunk")
    settings = {k: kw.pop(k) for k in names if k in kw}
    settings.setdefault("chunk", 7)  # several chunks over V = 23, the last one short
    inp = LossInput(hidden, weight, labels, valid, temperature=temperature, **kw)
    return compute_loss(inp, LossSettings(name=name, **settings))


def _label_q(q, labels, valid):
    """``[N][G]`` python floats q_j(x_j), None at invalid slots."""
    return [[float(q[n, j, labels[n, j]]) if valid[n, j] else None for j in range(G)] for n in range(len(q))]
