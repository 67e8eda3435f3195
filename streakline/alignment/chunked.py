"""Log-probabilities and teacher divergences over a whole vocabulary, a chunk of output rows at a time.

The losses (``losses.py``) never see ``[M, V]`` logits: ``chunked_logprobs`` is an autograd Function that walks
the vocabulary ``chunk`` output rows at a time and keeps only ``[M]`` log-normalisers for backward, which recomputes
each chunk; ``chunked_divergence`` does the same for a full-vocabulary teacher divergence D(p || q) (fkl, rkl, jsd,
tvd: ``DIVERGENCES``). Peak extra memory is O(M * chunk), flat in V (152k-token vocabularies included), except
that a CPU keeps forward's chunk products for backward while they fit ``KEEP_CPU_BYTES``.
``naive_logprobs`` is the plain reference the tests compare with.

    ell = chunked_logprobs(hidden, weight, ids, temperature=1.5, chunk=8192)      # [M, k] log q(ids)

Run the tests with ``.venv/bin/python -m pytest -q tests/alignment/test_losses_chunked.py``.
"""

from __future__ import annotations

import math
import weakref
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


# On a CPU a chunk is also kept small enough that its fp32 logits ([M, C]) stay in the cores' caches between the
# elementwise passes over them (upcast, log-sum-exp, softmax, scaling), which cost more than the GEMM there once it
# runs in bf16. 4 MB measured best at SmolLM2's head (M = 512 label slots, C = 2048: 1.4x faster than C = 8192 in
# fp32 and in bf16, forward and backward). A GPU keeps the chunk asked for.
CPU_BLOCK_BYTES = 4 << 20
MIN_CPU_CHUNK = 256


# On a CPU, backward reuses the chunk products forward made, instead of multiplying them again, while all of them
# together stay under this many bytes: the recompute is one of the three vocabulary GEMMs of a label log-prob's
# forward and backward (two of four for a divergence), and a CPU has the memory (SmolLM2's head over 700 label slots
# keeps 69 MB in bf16). The products are the very tensors the recompute would give, so no gradient changes by a bit.
# A GPU recomputes: its memory is the budget there, and its GEMMs are cheap.
KEEP_CPU_BYTES = 512 << 20


def _keeps_products(hidden: Tensor, vocab: int, dtype: torch.dtype) -> bool:
    """Whether forward keeps its ``[M, C]`` chunk products for backward (``KEEP_CPU_BYTES``)."""
    return hidden.device.type == "cpu" and hidden.shape[0] * vocab * dtype.itemsize <= KEEP_CPU_BYTES


def _ranges(vocab: int, chunk: int, rows: int = 0, device: torch.device | None = None) -> list[tuple[int, int]]:
    if device is not None and device.type == "cpu" and rows > 0:
        chunk = min(chunk, max(MIN_CPU_CHUNK, CPU_BLOCK_BYTES // (4 * rows)))
    return [(start, min(start + chunk, vocab)) for start in range(0, vocab, chunk)]


def _gemm_dtype(hidden: Tensor) -> torch.dtype:
    """The dtype the chunk products multiply in: autocast's (bf16 under stage=distill's mixed precision, as every
    other GEMM of the step) when autocast is on for ``hidden``'s device, else fp32. Read once in forward and kept:
    backward runs outside the autocast region and must multiply as forward did. Every result is read in fp32, so
    the normalisers and the losses reduce in fp32 either way."""
    kind = hidden.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else torch.float32


# The low-precision copy of each frozen output matrix (the verifier's head a DFlash drafter reads), made once and
# reused by every step: casting a 152k x 4096 head each forward and backward would cost more than its GEMMs save.
# Keyed by id, checked against the tensor, its storage and its version, and dropped when the tensor dies.
_FROZEN: dict[int, tuple[weakref.ref, tuple[int, int, torch.dtype], Tensor]] = {}


def _weight_in(weight: Tensor, dtype: torch.dtype) -> Tensor:
    """``weight`` in the GEMM dtype: itself for fp32 (each chunk upcasts its own rows) or when it already is;
    a cached copy when it is frozen; a fresh copy when it trains (its values change every step)."""
    if dtype == torch.float32 or weight.dtype == dtype:
        return weight
    if weight.requires_grad:
        return weight.detach().to(dtype)
    stamp = (weight._version, weight.data_ptr(), dtype)
    hit = _FROZEN.get(id(weight))
    if hit is not None and hit[0]() is weight and hit[1] == stamp:
        return hit[2]
    low, key = weight.detach().to(dtype), id(weight)
    _FROZEN[key] = (weakref.ref(weight, lambda _: _FROZEN.pop(key, None)), stamp, low)
    return low


def _gemm_input(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` as the products read it: fp32, or the GEMM dtype (cast once, not once per product)."""
    return t.float() if dtype == torch.float32 else t.to(dtype)


def _scaled_input(hidden: Tensor, temperature: float, dtype: torch.dtype) -> Tensor:
    """``hidden / temperature`` in the GEMM dtype: the temperature divides the ``[M, H]`` rows once instead of
    every ``[M, C]`` block of logits, forward and backward."""
    h = hidden.float()
    return _gemm_input(h if temperature == 1.0 else h / temperature, dtype)


def _mm(a: Tensor, b: Tensor, dtype: torch.dtype) -> Tensor:
    """``a @ b`` multiplied in ``dtype``, read in fp32."""
    if dtype == torch.float32:
        return a.float() @ b.float()
    return (a.to(dtype) @ b.to(dtype)).float()


def _product(hs: Tensor, w: Tensor, start: int, end: int, dtype: torch.dtype) -> Tensor:
    """``hs @ w[start:end].T`` in the GEMM dtype (``hs`` and ``w`` as ``_scaled_input`` and ``_weight_in`` give
    them): the one product forward and backward both read, so a kept one is the recomputed one bit for bit."""
    return hs @ _gemm_input(w[start:end], dtype).T


def _backward_product(
    kept: list | None, i: int, hs: Tensor, w: Tensor, start: int, end: int, dtype: torch.dtype
) -> Tensor:
    """Chunk ``i``'s product in backward: the one forward kept (dropped from ``kept`` as it is read, so each is
    freed once its chunk is done), else ``_product`` again."""
    if kept is None:
        return _product(hs, w, start, end, dtype)
    product, kept[i] = kept[i], None
    return product


def _accumulate(grad_h, grad_w, dz: Tensor, hs: Tensor, rows: Tensor, start: int, end: int, dtype) -> None:
    """One vocabulary chunk's share of the gradients (each None when not wanted), for ``dz`` = dL/dlogits of the
    chunk and ``hs`` = hidden / T: ``grad_h += dz @ rows`` (the caller divides by T once at the end) and
    ``grad_w[start:end] = dz.T @ hs``, multiplied in ``dtype`` and accumulated in fp32."""
    if grad_h is not None:
        if dtype == torch.float32:
            grad_h.addmm_(dz, rows)
        else:
            grad_h += _mm(dz, rows, dtype)
    if grad_w is not None:
        grad_w[start:end] = _mm(dz.T, hs, dtype).to(grad_w.dtype)


def _finish_grad_h(grad_h: Tensor | None, temperature: float, like: Tensor) -> Tensor | None:
    """``grad_h / T`` (logits = hidden @ W.T / T) in the hidden states' dtype; None when not wanted."""
    if grad_h is None:
        return None
    return (grad_h if temperature == 1.0 else grad_h / temperature).to(like.dtype)


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
    dtype = _gemm_dtype(hidden)
    hs, w = _scaled_input(hidden, temperature, dtype), _weight_in(weight, dtype)
    return _logsumexp(hs, w, dtype, _ranges(weight.shape[0], chunk, hidden.shape[0], hidden.device))


def _logsumexp(
    hs: Tensor, w: Tensor, dtype: torch.dtype, ranges: list[tuple[int, int]], keep: list[Tensor] | None = None
) -> Tensor:
    """``[M]`` fp32 log-normalisers of ``hs @ w.T`` (``hs`` already scaled by 1/T, both as ``_gemm_input`` and
    ``_weight_in`` give them), one vocabulary range at a time; each range's product appended to ``keep`` if given."""
    lse = torch.full((hs.shape[0],), -math.inf, device=hs.device)
    for start, end in ranges:
        product = _product(hs, w, start, end, dtype)
        lse = torch.logaddexp(lse, product.float().logsumexp(-1))
        if keep is not None:
            keep.append(product)
    return lse


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, ids, temperature, chunk):
        dtype = _gemm_dtype(hidden)
        hs, w = _scaled_input(hidden, temperature, dtype), _weight_in(weight, dtype)
        lse = torch.full((hidden.shape[0],), -math.inf, device=hidden.device)
        picked = torch.zeros(ids.shape, device=hidden.device)
        kept = [] if _keeps_products(hidden, weight.shape[0], dtype) else None
        for start, end in _ranges(weight.shape[0], chunk, hidden.shape[0], hidden.device):
            product = _product(hs, w, start, end, dtype)
            logits = product.float()
            lse = torch.logaddexp(lse, logits.logsumexp(-1))
            picked = picked + _pick(logits, ids, start, end)
            if kept is not None:
                kept.append(product)
        # The inputs (alive anyway), the [M] normaliser and, where they fit, the chunk products: else backward
        # recomputes each chunk.
        ctx.save_for_backward(hidden, weight, ids, lse)
        ctx.temperature, ctx.chunk, ctx.gemm, ctx.kept = temperature, chunk, dtype, kept
        return picked - lse[:, None]

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, ids, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        T, dtype = ctx.temperature, ctx.gemm
        hs, w = _scaled_input(hidden, T, dtype), _weight_in(weight, dtype)
        g = grad.float()
        minus_total = -g.sum(-1, keepdim=True)
        grad_h = torch.zeros(hidden.shape, device=hidden.device) if need_h else None
        grad_w = torch.empty_like(weight) if need_w else None
        kept, ctx.kept = ctx.kept, None  # a second backward (retain_graph) recomputes
        for i, (start, end) in enumerate(_ranges(weight.shape[0], ctx.chunk, hidden.shape[0], hidden.device)):
            rows = _gemm_input(w[start:end], dtype)
            product = _backward_product(kept, i, hs, w, start, end, dtype)
            # d log p_id / d logit_v = [v = id] - p_v; the softmax part is shared by the k picks of a row. The
            # product stays in the GEMM dtype until the subtraction, which reads it in fp32 (one pass, not two).
            dz = torch.sub(product, lse[:, None]).exp_().mul_(minus_total)
            inside, local = _inside(ids, start, end)
            dz.scatter_add_(1, local, torch.where(inside, g, 0.0))
            _accumulate(grad_h, grad_w, dz, hs, rows, start, end, dtype)
        return _finish_grad_h(grad_h, T, hidden), grad_w, None, None, None


def chunked_logprobs(
    hidden: Tensor, weight: Tensor, ids: Tensor, *, temperature: float = 1.0, chunk: int = DEFAULT_CHUNK
) -> Tensor:
    """``[M, k]`` fp32 ``log_softmax(hidden @ weight.T / temperature)[m, ids[m, i]]`` without an ``[M, V]`` tensor.

    hidden ``[M, H]`` (any float dtype), weight ``[V, H]`` (the drafter's output matrix), ids ``[M, k]`` int64 in
    ``[0, V)``. Differentiable in hidden and weight; peak extra memory O(M * chunk) in forward and backward (on a
    CPU, the ``[M, V]`` products in the GEMM dtype while they fit ``KEEP_CPU_BYTES``).
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
        dtype = _gemm_dtype(hidden)
        hs, w = _scaled_input(hidden, temperature, dtype), _weight_in(weight, dtype)
        fn = DIVERGENCES[name]
        ranges = _ranges(weight.shape[0], chunk, hidden.shape[0], hidden.device)
        kept = [] if _keeps_products(hidden, weight.shape[0], dtype) else None
        lse_q = _logsumexp(hs, w, dtype, ranges, kept)  # the inputs cast once, for the normaliser and the terms
        lse_p = torch.full_like(lse_q, -math.inf)
        for start, end in ranges:
            lse_p = torch.logaddexp(lse_p, teacher[:, start:end].float().logsumexp(-1))
        div, b_total, label = torch.zeros_like(lse_q), torch.zeros_like(lse_q), torch.zeros_like(lse_q)
        for i, (start, end) in enumerate(ranges):
            product = kept[i] if kept is not None else _product(hs, w, start, end, dtype)
            logq = torch.sub(product, lse_q[:, None])
            logp = teacher[:, start:end].float() - lse_p[:, None]
            terms, b = fn(logp, logq, beta)
            div += terms.sum(-1)
            b_total += b.sum(-1)
            label += _pick(logq, labels[:, None], start, end)[:, 0]
        ctx.save_for_backward(hidden, weight, teacher, lse_q, lse_p, b_total)
        ctx.name, ctx.beta, ctx.temperature, ctx.chunk, ctx.gemm = name, beta, temperature, chunk, dtype
        ctx.kept = kept
        ctx.mark_non_differentiable(label)
        return div, label

    @staticmethod
    def backward(ctx, grad_div, _grad_label):
        hidden, weight, teacher, lse_q, lse_p, b_total = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        T, fn, dtype = ctx.temperature, DIVERGENCES[ctx.name], ctx.gemm
        hs, w = _scaled_input(hidden, T, dtype), _weight_in(weight, dtype)
        g = grad_div.float()[:, None]
        # A row nobody asked about (an invalid slot, masked with zero upstream grad) may hold a NaN divergence,
        # e.g. a padded teacher row of -inf; 0 * NaN must not leak into the shared weight gradient.
        silent = g == 0
        grad_h = torch.zeros(hidden.shape, device=hidden.device) if need_h else None
        grad_w = torch.empty_like(weight) if need_w else None
        kept, ctx.kept = ctx.kept, None
        for i, (start, end) in enumerate(_ranges(weight.shape[0], ctx.chunk, hidden.shape[0], hidden.device)):
            rows = _gemm_input(w[start:end], dtype)
            product = _backward_product(kept, i, hs, w, start, end, dtype)
            logq = torch.sub(product, lse_q[:, None])
            logp = teacher[:, start:end].float() - lse_p[:, None]
            b = fn(logp, logq, ctx.beta)[1]
            dz = torch.where(silent, 0.0, (b - logq.exp() * b_total[:, None]) * g)
            _accumulate(grad_h, grad_w, dz, hs, rows, start, end, dtype)
        return _finish_grad_h(grad_h, T, hidden), grad_w, None, None, None, None, None, None


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
