"""Log-probabilities and teacher divergences over a whole vocabulary, a chunk of output rows at a time.

The losses (``losses.py``) never see ``[M, V]`` logits: ``chunked_logprobs`` is an autograd Function that walks
the vocabulary ``chunk`` output rows at a time and keeps only ``[M]`` log-normalisers for backward, which recomputes
each chunk; ``chunked_divergence`` does the same for a full-vocabulary teacher divergence D(p || q) (fkl, rkl, jsd,
tvd: ``DIVERGENCES``). Peak extra memory is O(M * chunk), flat in V (152k-token vocabularies included).
``naive_logprobs`` is the plain reference the tests compare with.

    ell = chunked_logprobs(hidden, weight, ids, temperature=1.5, chunk=8192)      # [M, k] log q(ids)

Run the tests with ``.venv/bin/python -m pytest -q tests/alignment/test_losses_chunked.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

DEFAULT_CHUNK = 8192


# ----------------------------------------------------------------------------------------------------------------
# Chunked log-probabilities


def _check_numerics(temperature: float, chunk: int) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")


def _ranges(vocab: int, chunk: int) -> list[tuple[int, int]]:
    return [(start, min(start + chunk, vocab)) for start in range(0, vocab, chunk)]


def _chunk_logits(h32: Tensor, weight_rows: Tensor, temperature: float) -> Tensor:
    """``[M, C]`` fp32 logits of one vocabulary chunk; the fp32 upcast happens per chunk, never for all of V."""
    return (h32 @ weight_rows.float().T) / temperature


def _inside(ids: Tensor, start: int, end: int) -> tuple[Tensor, Tensor]:
    """Which ``ids`` fall in ``[start, end)`` and their in-chunk column (0 where outside, so gathers stay legal)."""
    inside = (ids >= start) & (ids < end)
    return inside, torch.where(inside, ids - start, 0)


def _pick(logits: Tensor, ids: Tensor, start: int, end: int) -> Tensor:
    """``logits[m, ids[m, i] - start]`` where the id lies in this chunk, else 0 (each id lies in exactly one)."""
    inside, local = _inside(ids, start, end)
    return torch.where(inside, logits.gather(1, local), 0.0)


@torch.no_grad()
def logsumexp_chunked(
    hidden: Tensor, weight: Tensor, *, temperature: float = 1.0, chunk: int = DEFAULT_CHUNK
) -> Tensor:
    """``[M]`` fp32 ``logsumexp(hidden @ weight.T / temperature, -1)`` for hidden ``[M, H]``, weight ``[V, H]``,
    computed chunk by chunk over V. Carries no gradient (the Functions here use it as a saved normaliser)."""
    _check_numerics(temperature, chunk)
    h32 = hidden.float()
    lse = torch.full((h32.shape[0],), -math.inf, device=h32.device)
    for start, end in _ranges(weight.shape[0], chunk):
        lse = torch.logaddexp(lse, _chunk_logits(h32, weight[start:end], temperature).logsumexp(-1))
    return lse


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, ids, temperature, chunk):
        h32 = hidden.float()
        lse = torch.full((h32.shape[0],), -math.inf, device=h32.device)
        picked = torch.zeros(ids.shape, device=h32.device)
        for start, end in _ranges(weight.shape[0], chunk):
            logits = _chunk_logits(h32, weight[start:end], temperature)
            lse = torch.logaddexp(lse, logits.logsumexp(-1))
            picked = picked + _pick(logits, ids, start, end)
        # Only the inputs (alive anyway) and the [M] normaliser are kept: backward recomputes each chunk.
        ctx.save_for_backward(hidden, weight, ids, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        return picked - lse[:, None]

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, ids, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        T = ctx.temperature
        h32, g = hidden.float(), grad.float()
        g_total = g.sum(-1, keepdim=True)
        grad_h = torch.zeros_like(h32) if need_h else None
        grad_w = torch.empty_like(weight) if need_w else None
        for start, end in _ranges(weight.shape[0], ctx.chunk):
            w32 = weight[start:end].float()
            # d log p_id / d logit_v = [v = id] - p_v; the softmax part is shared by the k picks of a row.
            dz = (_chunk_logits(h32, w32, T) - lse[:, None]).exp_().mul_(-g_total)
            inside, local = _inside(ids, start, end)
            dz.scatter_add_(1, local, torch.where(inside, g, 0.0))
            dz.div_(T)
            if need_h:
                grad_h.addmm_(dz, w32)
            if need_w:
                grad_w[start:end] = (dz.T @ h32).to(grad_w.dtype)
        return (grad_h.to(hidden.dtype) if need_h else None), grad_w, None, None, None


def chunked_logprobs(
    hidden: Tensor, weight: Tensor, ids: Tensor, *, temperature: float = 1.0, chunk: int = DEFAULT_CHUNK
) -> Tensor:
    """``[M, k]`` fp32 ``log_softmax(hidden @ weight.T / temperature)[m, ids[m, i]]`` without an ``[M, V]`` tensor.

    hidden ``[M, H]`` (any float dtype), weight ``[V, H]`` (the drafter's output matrix), ids ``[M, k]`` int64 in
    ``[0, V)``. Differentiable in hidden and weight; peak extra memory O(M * chunk) in forward and backward.
    """
    _check_numerics(temperature, chunk)
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"need hidden [M, H] and weight [V, H], got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if ids.dim() != 2 or ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"ids must be [M, k] with M = {hidden.shape[0]}, got {tuple(ids.shape)}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= weight.shape[0]):
        raise ValueError(f"ids must lie in [0, {weight.shape[0]}), got [{int(ids.min())}, {int(ids.max())}]")
    return _ChunkedLogprobs.apply(hidden, weight, ids.long(), float(temperature), int(chunk))


def naive_logprobs(hidden: Tensor, weight: Tensor, ids: Tensor, *, temperature: float = 1.0) -> Tensor:
    """Reference for ``chunked_logprobs`` (same shapes), materialising the ``[M, V]`` fp32 log-softmax."""
    return torch.log_softmax((hidden.float() @ weight.float().T) / temperature, -1).gather(-1, ids)


# ----------------------------------------------------------------------------------------------------------------
# Divergences D(p || q) over a vocabulary axis (the last one)
#
# Each divergence gives (a) its elementwise terms, which sum over the last axis to D, and (b) dD/dlog q_v with the
# log q_v treated as free variables. The gradient with respect to drafter logits z (q = softmax z) is then
# b - q * sum(b), which is what the full-vocabulary Function needs in backward without an autograd graph.


def _jsd_logm(logp: Tensor, logq: Tensor, beta: float) -> Tensor:
    return torch.logaddexp(logp + math.log(beta), logq + math.log1p(-beta))


def _xlogy_term(logp: Tensor, other: Tensor) -> Tensor:
    """``p * (log p - other)``, 0 where p = 0 (a teacher's -inf log-prob must not turn into NaN)."""
    p = logp.exp()
    return torch.where(p > 0, p * (logp - other), 0.0)


def _fkl(logp, logq, beta):
    return _xlogy_term(logp, logq), -logp.exp()


def _rkl(logp, logq, beta):
    q = logq.exp()
    return q * (logq - logp), q * (logq - logp + 1)


def _jsd(logp, logq, beta):
    logm = _jsd_logm(logp, logq, beta)
    q = logq.exp()
    terms = beta * _xlogy_term(logp, logm) + (1 - beta) * q * (logq - logm)
    return terms, (1 - beta) * q * (logq - logm)


# |p - q| has no derivative at p = q. Probabilities that agree to within rounding (a drafter scored against logits
# computed from its own weights by another kernel, say) are a tie, and a tie's subgradient is taken as zero: without
# that the gradient would be the sign of rounding noise, summed over the vocabulary.
TIE_ULPS = 64


def _tie_sign(p: Tensor, q: Tensor) -> Tensor:
    """sign(p - q), and 0 where p and q agree to within ``TIE_ULPS`` units in the last place of the larger."""
    diff = p - q
    tol = TIE_ULPS * torch.finfo(diff.dtype).eps * torch.maximum(p, q)
    return torch.where(diff.abs() <= tol, 0.0, torch.sign(diff))


def _tvd(logp, logq, beta):
    p, q = logp.exp(), logq.exp()
    s = _tie_sign(p, q).detach()
    # (p - q) * s is |p - q| away from ties and exactly 0 at them, so autograd (the top-k path) sees the same
    # zero subgradient at a tie as the explicit derivative below (the full-vocabulary path).
    return 0.5 * (p - q) * s, -0.5 * q * s


DivergenceFn = Callable[[Tensor, Tensor, float], tuple[Tensor, Tensor]]
DIVERGENCES: dict[str, DivergenceFn] = {"fkl": _fkl, "rkl": _rkl, "jsd": _jsd, "tvd": _tvd}


def divergence_terms(name: str, logp: Tensor, logq: Tensor, beta: float = 0.5) -> Tensor:
    """Elementwise terms of ``D(p || q)`` (same shape as ``logp``/``logq``, normalised log-probs over the last
    axis); ``.sum(-1)`` is the divergence. fkl = KL(p||q), rkl = KL(q||p), jsd = β KL(p||m) + (1-β) KL(q||m) with
    m = β p + (1-β) q, tvd = ½ Σ |p - q|."""
    return DIVERGENCES[name](logp, logq, beta)[0]


class _ChunkedDivergence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, teacher, labels, name, beta, temperature, chunk):
        h32 = hidden.float()
        fn = DIVERGENCES[name]
        lse_q = logsumexp_chunked(hidden, weight, temperature=temperature, chunk=chunk)
        lse_p = torch.full_like(lse_q, -math.inf)
        for start, end in _ranges(weight.shape[0], chunk):
            lse_p = torch.logaddexp(lse_p, teacher[:, start:end].float().logsumexp(-1))
        div, b_total, label = torch.zeros_like(lse_q), torch.zeros_like(lse_q), torch.zeros_like(lse_q)
        for start, end in _ranges(weight.shape[0], chunk):
            logq = _chunk_logits(h32, weight[start:end], temperature) - lse_q[:, None]
            logp = teacher[:, start:end].float() - lse_p[:, None]
            terms, b = fn(logp, logq, beta)
            div += terms.sum(-1)
            b_total += b.sum(-1)
            label += _pick(logq, labels[:, None], start, end)[:, 0]
        ctx.save_for_backward(hidden, weight, teacher, lse_q, lse_p, b_total)
        ctx.name, ctx.beta, ctx.temperature, ctx.chunk = name, beta, temperature, chunk
        ctx.mark_non_differentiable(label)
        return div, label

    @staticmethod
    def backward(ctx, grad_div, _grad_label):
        hidden, weight, teacher, lse_q, lse_p, b_total = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        T, fn = ctx.temperature, DIVERGENCES[ctx.name]
        h32, g = hidden.float(), grad_div.float()[:, None]
        # A row nobody asked about (an invalid slot, masked with zero upstream grad) may hold a NaN divergence,
        # e.g. a padded teacher row of -inf; 0 * NaN must not leak into the shared weight gradient.
        silent = g == 0
        grad_h = torch.zeros_like(h32) if need_h else None
        grad_w = torch.empty_like(weight) if need_w else None
        for start, end in _ranges(weight.shape[0], ctx.chunk):
            w32 = weight[start:end].float()
            logq = _chunk_logits(h32, w32, T) - lse_q[:, None]
            logp = teacher[:, start:end].float() - lse_p[:, None]
            b = fn(logp, logq, ctx.beta)[1]
            dz = torch.where(silent, 0.0, (b - logq.exp() * b_total[:, None]) * g / T)
            if need_h:
                grad_h.addmm_(dz, w32)
            if need_w:
                grad_w[start:end] = (dz.T @ h32).to(grad_w.dtype)
        return (grad_h.to(hidden.dtype) if need_h else None), grad_w, None, None, None, None, None, None


def chunked_divergence(
    hidden: Tensor,
    weight: Tensor,
    teacher_logits: Tensor,
    labels: Tensor,
    *,
    name: str = "fkl",
    beta: float = 0.5,
    temperature: float = 1.0,
    chunk: int = DEFAULT_CHUNK,
) -> tuple[Tensor, Tensor]:
    """``D(p || q)`` per row over the full vocabulary, and ``log q(labels)``, without an fp32 ``[M, V]`` tensor.

    hidden ``[M, H]``, weight ``[V, H]``, teacher_logits ``[M, V]`` (p = softmax of them, any float dtype, treated
    as constant), labels ``[M]`` int64. q = softmax(hidden @ weight.T / temperature). Returns ``([M], [M])`` fp32;
    the divergence is differentiable in hidden and weight, the label log-probs are not (they feed metrics).
    """
    _check_numerics(temperature, chunk)
    if name not in DIVERGENCES:
        raise ValueError(f"unknown divergence {name!r}; valid: {sorted(DIVERGENCES)}")
    if name == "jsd" and not 0 < beta < 1:
        raise ValueError(f"jsd needs 0 < beta < 1, got {beta}")
    if teacher_logits.shape != (hidden.shape[0], weight.shape[0]):
        raise ValueError(
            f"teacher_logits must be [M, V] = {(hidden.shape[0], weight.shape[0])}, got {tuple(teacher_logits.shape)}"
        )
    return _ChunkedDivergence.apply(
        hidden, weight, teacher_logits.detach(), labels.long(), name, float(beta), float(temperature), int(chunk)
    )
