"""Distillation losses for diffusion drafters (docs/algorithms.md section 4), on the chunked log-probs of
``chunked.py``.

Every loss is a registered component with one signature, ``(LossInput, LossSettings) -> LossOutput``:

    settings = LossSettings.from_config(cfg.method)
    inp = LossInput(hidden, model.output_weight, labels, valid, temperature=1.5)  # q's temperature (stage=distill's)
    out = compute_loss(inp, settings)   # out.loss (scalar), out.metrics ("loss", "q_mean_j", "streak_q", ...)
    out.loss.backward()

``hidden`` ``[N, G, H]`` are the drafter's hidden states that predict the G slots of N windows (before the output
matrix), so no loss ever sees ``[N, G, V]`` logits: log-probs come from ``chunked_logprobs``, an autograd Function
that walks the vocabulary ``chunk`` output rows at a time and keeps only ``[M]`` log-normalisers for backward,
which recomputes each chunk (``chunked.py``; a CPU keeps forward's products instead while they fit
``KEEP_CPU_BYTES``). Peak extra memory is O(M * chunk), flat in V (152k-token vocabularies included).
Full-vocabulary teacher divergences use a second Function of the same shape.

Invalid slots (``valid`` False, past the end of a completion) carry no weight anywhere, and a streak product
stops at the first invalid slot: it is never extended through one as if its probability were 1.

Run the tests with ``.venv/bin/python -m pytest -q tests/alignment/test_losses*.py`` (what every loss shares and
the registry in ``test_losses.py``, each loss family in ``test_losses_<family>.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

# the chunked machinery lives in chunked.py; its public names are re-exported here for the losses' callers
from .chunked import (  # noqa: F401
    DEFAULT_CHUNK,
    DIVERGENCES,
    chunked_divergence,
    chunked_logprobs,
    divergence_terms,
    logsumexp_chunked,
    naive_logprobs,
)

# ----------------------------------------------------------------------------------------------------------------
# The registry


@dataclass
class LossInput:
    """What every loss receives. N windows of G slots; shapes are checked by ``compute_loss``."""

    hidden: Tensor  # [N, G, H] drafter hidden states that predict the G window slots
    weight: Tensor  # [V, H] drafter output matrix (model.output_weight)
    labels: Tensor  # [N, G] int64, x_j (the verifier's tokens); any value at invalid slots
    valid: Tensor  # [N, G] bool, v_j (False past the end of the completion; valid slots form a prefix)
    temperature: float = 1.0  # deployment drafter temperature for ℓ_j = log q_j(x_j)
    teacher_ids: Tensor | None = None  # [N, G, k] verifier top-k ids per slot (stored in trajectory shards)
    teacher_logprobs: Tensor | None = None  # [N, G, k] their verifier log-probs (float16/32)
    teacher_logits: Tensor | None = None  # [N, G, V] full verifier logits (online teacher), used over top-k if both
    masked: Tensor | None = None  # [N, G] bool, mdm only: which slots are hidden
    rate: Tensor | None = None  # [N] mdm only: the mask rate t of each window


@dataclass
class LossOutput:
    loss: Tensor  # scalar
    metrics: dict[str, Any] = field(default_factory=dict)  # "loss", "q_mean_j" (G floats or None), "streak_q", ...


@dataclass
class LossSettings:
    """The loss knobs of ``MethodConfig`` (streakline/config/schema.py); ``name`` is its ``loss`` field."""

    name: str
    lam: float = 0.9  # expce decay per slot
    inclusive: bool = False  # ce_streak: weight slot m by the streak through m instead of m-1
    streak_smoothing: float = 0.0  # ce_streak: the weight's factors are (1 - s) q_j + s (0: SpecDiff-2's q_j)
    divergence: str = "fkl"  # distillspec / ar_distill: one of DIVERGENCES
    beta: float = 0.5  # jsd mixing weight
    # dflash_ce: slot k weighs exp(-(k-1)/decay_gamma); None: the DFlash paper's value for the block size that G
    # slots make, G + 1 (dflash_decay_gamma). Not called gamma: method.gamma is the window width everywhere else.
    decay_gamma: float | None = None
    dpace_alpha: float = 0.5  # dpace: the confidence smoothing s = (1 - alpha) q + alpha
    chunk: int = DEFAULT_CHUNK  # vocabulary rows per chunk of the log-softmax

    @classmethod
    def from_config(cls, method: Any, *, chunk: int = DEFAULT_CHUNK) -> LossSettings:
        """From a resolved ``MethodConfig`` (or anything with its fields)."""
        return cls(
            name=method.loss,
            lam=method.lam,
            inclusive=method.inclusive,
            streak_smoothing=method.streak_smoothing,
            divergence=method.divergence,
            beta=method.beta,
            decay_gamma=method.decay_gamma,
            dpace_alpha=method.dpace_alpha,
            chunk=getattr(method, "chunk", chunk),
        )


LossFn = Callable[[LossInput, LossSettings], LossOutput]
LOSSES: dict[str, LossFn] = {}
# The losses that read the verifier's distribution (stored top-k or online logits), not only its tokens.
TEACHER_LOSSES = ("distillspec", "ar_distill")
# The losses whose slot weights are products of the drafter's probabilities along the window: a slot the drafter
# cannot draft (q = 0, outside a draft vocabulary) ends every streak there (alignment/dflash.py: draft_labels).
STREAK_PRODUCT_LOSSES = ("streak", "ce_streak", "dpace")


def register_loss(name: str) -> Callable[[LossFn], LossFn]:
    """Decorator adding a loss to ``LOSSES`` under ``name`` (a name can be registered once)."""

    def add(fn: LossFn) -> LossFn:
        if name in LOSSES:
            raise ValueError(f"loss {name!r} is already registered")
        LOSSES[name] = fn
        return fn

    return add


def compute_loss(inp: LossInput, settings: LossSettings) -> LossOutput:
    """Run the registered loss ``settings.name`` on ``inp``; scalar loss plus float metrics."""
    if settings.name not in LOSSES:
        raise ValueError(f"unknown loss {settings.name!r}; valid: {sorted(LOSSES)}")
    _check_input(inp)
    return LOSSES[settings.name](inp, settings)


def _check_input(inp: LossInput) -> None:
    if inp.hidden.dim() != 3:
        raise ValueError(f"hidden must be [N, G, H], got {tuple(inp.hidden.shape)}")
    N, G, H = inp.hidden.shape
    if N == 0 or G == 0:
        raise ValueError(f"need at least one window and one slot, got hidden {tuple(inp.hidden.shape)}")
    if inp.weight.dim() != 2 or inp.weight.shape[1] != H:
        raise ValueError(f"weight must be [V, {H}], got {tuple(inp.weight.shape)}")
    for name in ("labels", "valid"):
        if getattr(inp, name).shape != (N, G):
            raise ValueError(f"{name} must be [N, G] = {(N, G)}, got {tuple(getattr(inp, name).shape)}")
    if inp.valid.dtype != torch.bool:
        raise ValueError(f"valid must be bool, got {inp.valid.dtype}")
    if not inp.temperature > 0:
        raise ValueError(f"temperature must be > 0, got {inp.temperature}")


# ----------------------------------------------------------------------------------------------------------------
# Shared pieces of the losses


def _alive(valid: Tensor) -> Tensor:
    """``[N, G]`` slots a streak product reaches: valid and no invalid slot before them."""
    return valid.long().cumprod(1).bool()


def _slot_logprobs(inp: LossInput, chunk: int, temperature: float | None = None, rows: slice = slice(None)) -> Tensor:
    """``[N, G']`` fp32 ℓ_j = log q_j(x_j) for the slots ``rows``; 0 at invalid slots (their labels may be junk)."""
    valid, hidden = inp.valid[:, rows], inp.hidden[:, rows]
    labels = torch.where(valid, inp.labels[:, rows], 0)
    N, G = labels.shape
    ell = chunked_logprobs(
        hidden.reshape(N * G, -1),
        inp.weight,
        labels.reshape(N * G, 1),
        temperature=inp.temperature if temperature is None else temperature,
        chunk=chunk,
    ).view(N, G)
    return torch.where(valid, ell, 0.0)


def _output(loss: Tensor, ell: Tensor, valid: Tensor, **extra: Any) -> LossOutput:
    """Loss plus the metrics every loss reports, from label log-probs ``ell`` ``[N, G]``."""
    with torch.no_grad():
        ell = torch.where(valid, ell.detach(), 0.0)
        q_sum = torch.where(valid, ell.exp(), 0.0).sum(0).tolist()
        count = valid.sum(0).tolist()
        alive = _alive(valid)
        streak = torch.where(alive, ell.cumsum(1).exp(), 0.0).sum(1).mean()
    metrics = {
        "loss": float(loss.detach()),
        "q_mean_j": [s / c if c else None for s, c in zip(q_sum, count, strict=True)],
        "streak_q": float(streak),
        **extra,
    }
    return LossOutput(loss=loss, metrics=metrics)


# ----------------------------------------------------------------------------------------------------------------
# Losses (per window, then averaged over the N windows)


@register_loss("streak")
def streak_loss(inp: LossInput, settings: LossSettings) -> LossOutput:
    """``-Σ_m v_m exp(Σ_{j≤m} ℓ_j)``: the drafter's expected streak on the verifier's tokens (SpecDiff-2 Def. 5.1).

    Its gradient is ``-Σ_j W_j ∇ℓ_j`` with ``W_j = Σ_{m≥j} Π_{i≤m} q_i(x_i)``."""
    alive = _alive(inp.valid)
    ell = torch.where(alive, _slot_logprobs(inp, settings.chunk), 0.0)
    streak = torch.where(alive, ell.cumsum(1).exp(), 0.0)
    return _output(-streak.sum() / ell.shape[0], ell, inp.valid)


@register_loss("ce_streak")
def ce_streak_loss(inp: LossInput, settings: LossSettings) -> LossOutput:
    """``-Σ_m v_m sg(exp(Σ_{j<m} ℓ_j)) ℓ_m`` (SpecDiff-2 Eq. 9); ``inclusive`` uses ``j ≤ m`` in the weight.

    ``streak_smoothing`` s > 0 (a project variant, docs/algorithms.md section 4) builds the weight from smoothed
    confidences, ``Π_{j<m} ((1 - s) q_j + s)``, as D-PACE smooths its own: s = 1 is plain cross-entropy."""
    s = settings.streak_smoothing
    if not 0.0 <= s <= 1.0:
        raise ValueError(f"ce_streak needs 0 <= streak_smoothing <= 1 (method.streak_smoothing), got {s}")
    alive = _alive(inp.valid)
    ell = torch.where(alive, _slot_logprobs(inp, settings.chunk), 0.0)
    with torch.no_grad():
        # log of each factor: ℓ_j itself at s = 0 (exact, no exp/log round trip), log((1 - s) q_j + s) otherwise
        factor = ell if s == 0.0 else torch.log((1.0 - s) * ell.exp() + s)
        through = torch.where(alive, factor, 0.0).cumsum(1)
        if not settings.inclusive:
            # An explicit exclusive cumsum rather than cumsum - ℓ: no cancellation when ℓ is very negative.
            through = torch.cat([torch.zeros_like(through[:, :1]), through[:, :-1]], 1)
        weight = torch.where(alive, through.exp(), 0.0)
    return _output(-(weight * ell).sum() / ell.shape[0], ell, inp.valid)


@register_loss("expce")
def expce_loss(inp: LossInput, settings: LossSettings) -> LossOutput:
    """``-Σ_m v_m λ^{m-1} ℓ_m``: cross-entropy with a fixed exponential decay over window positions."""
    ell = _slot_logprobs(inp, settings.chunk)
    decay = settings.lam ** torch.arange(ell.shape[1], device=ell.device, dtype=torch.float32)
    return _output(-(torch.where(inp.valid, ell, 0.0) * decay).sum() / ell.shape[0], ell, inp.valid)


# The decay the DFlash paper trains with at the block sizes it reports (B = the anchor plus B - 1 drafted slots).
DFLASH_DECAY_GAMMAS = {8: 4.0, 10: 5.0, 16: 7.0}


def dflash_decay_gamma(block_size: int) -> float:
    """The DFlash paper's decay γ for blocks of ``block_size`` (the anchor and ``block_size - 1`` drafted slots).

    The paper gives γ only at 8, 10 and 16 (``DFLASH_DECAY_GAMMAS``); between them γ is linear in the block size and
    beyond them each end segment is extended: γ = B/2 up to B = 10 (through 4 at 8 and 5 at 10), γ = 5 + (B - 10)/3
    from there (through 7 at 16). A project choice: the paper states no rule. Extending the segments keeps the last
    slot's weight e^{-(B-2)/γ} near the paper's (0.22, 0.20, 0.14 at 8, 10, 16): 0.37 at B = 4 and 0.09 at B = 32,
    where clamping γ to [4, 7] would give 0.61 and 0.01. γ >= 1 for every block that drafts a slot (B >= 2).
    """
    if block_size < 2:
        raise ValueError(f"a DFlash block drafts block_size - 1 slots; block_size must be >= 2, got {block_size}")
    points = sorted(DFLASH_DECAY_GAMMAS.items())
    # the segment that holds block_size, or the end segment nearest to it
    seg = next((i for i in range(len(points) - 1) if block_size <= points[i + 1][0]), len(points) - 2)
    (b0, g0), (b1, g1) = points[seg], points[seg + 1]
    return g0 + (g1 - g0) * (block_size - b0) / (b1 - b0)


@register_loss("dflash_ce")
def dflash_ce_loss(inp: LossInput, settings: LossSettings) -> LossOutput:
    """``-Σ_{n,k} v_nk w_k ℓ_nk / Σ_{n,k} v_nk w_k`` with ``w_k = exp(-(k-1)/γ)``: the decayed cross-entropy the
    DFlash papers train their drafters with, a weighted mean over every valid slot of the batch (slot k 1-based;
    invalid slots weigh 0). γ is ``settings.decay_gamma``, or when that is None the paper's value for the block that
    G slots make, ``dflash_decay_gamma(G + 1)`` (4.5 for the 8 slots of a block of 9). ``speculators`` divides the
    same weighted sum by the number of valid slots instead, which scales each batch's loss by that batch's mean slot
    weight."""
    G = inp.labels.shape[1]
    gamma = dflash_decay_gamma(G + 1) if settings.decay_gamma is None else settings.decay_gamma
    if not gamma > 0:
        raise ValueError(f"dflash_ce needs decay_gamma > 0 (method.decay_gamma), got {gamma}")
    ell = _slot_logprobs(inp, settings.chunk)
    k = torch.arange(G, device=ell.device, dtype=torch.float32)
    weight = torch.where(inp.valid, torch.exp(-k / gamma), 0.0)
    # A batch without a valid slot gives 0 (a zero sum over a tiny positive total), not NaN.
    total = weight.sum().clamp(min=torch.finfo(weight.dtype).tiny)
    return _output(-(weight * ell).sum() / total, ell, inp.valid)


def dpace_weights(q: Tensor, valid: Tensor, alpha: float) -> Tensor:
    """D-PACE's slot weights ``W_j = Σ_{m≥j} Π_{i≤m} s_i`` with ``s_i = (1 - α) q_i + α``, ``[N, G]`` fp32, from the
    drafter's probabilities ``q`` ``[N, G]`` of the verifier's tokens and ``valid`` ``[N, G]`` bool.

    A product stops at a window's first invalid slot: the slots from there on weigh 0 and add nothing to the
    earlier slots' sums. At α = 0, ``W_j`` is the streak loss's gradient weight; at α = 1 it is the number of reached
    slots from ``j`` on. The arithmetic is ``speculators``' (``dpace_loss_decay``): an unreached slot's factor is 1
    in the running product and its term 0 in the suffix sum."""
    alive = _alive(valid)
    smooth = torch.where(alive, (1.0 - alpha) * q.float() + alpha, 1.0)
    prefix = torch.where(alive, smooth.cumprod(1), 0.0)
    return torch.where(alive, prefix.flip(1).cumsum(1).flip(1), 0.0)


@register_loss("dpace")
def dpace_loss(inp: LossInput, settings: LossSettings) -> LossOutput:
    """``-Σ_{n,j} sg(W_nj) ℓ_nj / Σ_{n,j} r_nj``: D-PACE, cross-entropy on the verifier's tokens with each slot
    weighted by ``dpace_weights`` of the drafter's own (detached) ``q_j = exp(ℓ_j)``, α = ``settings.dpace_alpha``,
    divided by the number of slots the products reach (``r``: valid, no invalid slot before; with ``valid`` a prefix,
    as every caller gives it, the valid slots of the batch). The default DFlash loss of ``speculators``, matched to
    its definition there (``tests/alignment/test_dpace_speculators.py``). At α = 0 its gradient is the streak loss's
    times ``N / Σ r``."""
    alpha = settings.dpace_alpha
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"dpace needs 0 <= dpace_alpha <= 1 (method.dpace_alpha), got {alpha}")
    alive = _alive(inp.valid)
    ell = torch.where(alive, _slot_logprobs(inp, settings.chunk), 0.0)
    with torch.no_grad():
        weight = dpace_weights(ell.detach().exp(), alive, alpha)
    return _output(-(weight * ell).sum() / alive.sum().clamp(min=1), ell, inp.valid)


@register_loss("mdm")
def mdm_loss(inp: LossInput, settings: LossSettings) -> LossOutput:
    """Masked-diffusion CE ``-Σ_j masked_j v_j ℓ_j / t`` summed over windows and divided by the number of valid
    slots in the batch (as ``pretrain.mdm_window_loss``), at temperature 1 whatever ``inp.temperature`` says."""
    if inp.masked is None or inp.rate is None:
        raise ValueError("mdm needs LossInput.masked [N, G] and LossInput.rate [N] (the window mask rates)")
    N, G = inp.valid.shape
    if inp.masked.shape != (N, G):
        raise ValueError(f"masked must be [N, G] = {(N, G)}, got {tuple(inp.masked.shape)}")
    if inp.rate.numel() != N:
        raise ValueError(f"rate must hold one mask rate per window ({N}), got {tuple(inp.rate.shape)}")
    ell = _slot_logprobs(inp, settings.chunk, temperature=1.0)
    use = inp.masked.bool() & inp.valid
    weighted = torch.where(use, ell / inp.rate.reshape(N, 1).float(), 0.0)
    return _output(-weighted.sum() / inp.valid.sum().clamp(min=1), ell, inp.valid)


# A stored top-k teacher covers k ids; everything else is one lumped bucket whose mass is 1 minus the mass on the k
# ids. That remainder comes from a difference of nearly equal numbers when the k ids hold almost everything (float16
# log-probs of the teacher, an fp32 normaliser over the drafter's vocabulary), so below REST_FLOOR it is rounding
# noise: both sides' remainders are floored there, which keeps log(rest) finite in values and gradients and makes
# the bucket contribute exactly 0 when both remainders are that small (k = V in particular).
REST_FLOOR = 1e-6


def _log1mexp(x: Tensor) -> Tensor:
    """``log(1 - exp(x))`` for x < 0, accurate near 0 and for very negative x (both branches stay finite)."""
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def _lump_rest(logx: Tensor) -> Tensor:
    """``[M, k]`` log-probabilities of k ids (of a distribution over a larger vocabulary) -> ``[M, k + 1]``, the
    last entry the log of the mass on every other id, ``log(1 - Σ_k x)``, at least ``log(REST_FLOOR)``.

    Where the k ids hold more than ``1 - REST_FLOOR`` (rounding, or padding rows with a repeated id) they are scaled
    down to exactly that, so the k + 1 entries always form a distribution.
    """
    cap = math.log1p(-REST_FLOOR)
    inside = logx.logsumexp(-1, keepdim=True)
    excess = (inside - cap).clamp(min=0.0)
    return torch.cat([logx - excess, _log1mexp(torch.minimum(inside, torch.full_like(inside, cap)))], -1)


_NO_TEACHER = (
    "{loss} needs the verifier's distribution: store top-k logprobs with data.topk_logprobs=20 in "
    "stage=trajectories, or use method.teacher=online"
)


def _teacher_divergence(inp: LossInput, settings: LossSettings, loss: str, rows: slice) -> tuple[Tensor, Tensor]:
    """``(D [N, G'], ℓ [N, G'])`` for the slots ``rows``: the divergence between verifier and drafter per slot and
    the drafter's label log-probs, 0 at invalid slots.

    With full ``teacher_logits`` the divergence runs over the whole vocabulary (chunked). With top-k
    ``teacher_ids``/``teacher_logprobs`` (the verifier's log_softmax over its full vocabulary at k distinct ids, as
    stage=trajectories stores them) it runs over k + 1 buckets: the k ids, with p as stored and q the drafter's
    full-vocabulary probabilities there (not renormalised), plus one bucket for every other id, holding the rest
    of each side's mass (``_lump_rest``). So mass the drafter puts outside the teacher's top-k is penalised. By the
    data-processing inequality this is a lower bound on the full-vocabulary divergence, equal to it when k = V.
    """
    if settings.divergence not in DIVERGENCES:
        raise ValueError(f"unknown divergence {settings.divergence!r}; valid: {sorted(DIVERGENCES)}")
    if settings.divergence == "jsd" and not 0 < settings.beta < 1:
        raise ValueError(f"jsd needs 0 < beta < 1, got {settings.beta}")
    valid, hidden = inp.valid[:, rows], inp.hidden[:, rows]
    labels = torch.where(valid, inp.labels[:, rows], 0)
    N, G = labels.shape
    flat_h = hidden.reshape(N * G, -1)
    if inp.teacher_logits is not None:
        teacher = inp.teacher_logits[:, rows]
        if teacher.shape != (N, G, inp.weight.shape[0]):
            raise ValueError(
                f"teacher_logits must be [N, G, V] with the drafter's V = {inp.weight.shape[0]}, "
                f"got {tuple(inp.teacher_logits.shape)}"
            )
        div, ell = chunked_divergence(
            flat_h,
            inp.weight,
            teacher.reshape(N * G, -1),
            labels.reshape(-1),
            name=settings.divergence,
            beta=settings.beta,
            temperature=inp.temperature,
            chunk=settings.chunk,
        )
    elif inp.teacher_ids is not None and inp.teacher_logprobs is not None:
        ids, logp = inp.teacher_ids[:, rows], inp.teacher_logprobs[:, rows]
        if ids.shape[:2] != (N, G) or ids.shape != logp.shape:
            raise ValueError(
                f"teacher_ids and teacher_logprobs must both be [N, G, k], got {tuple(inp.teacher_ids.shape)} "
                f"and {tuple(inp.teacher_logprobs.shape)}"
            )
        # Invalid slots may hold padding (-inf log-probs, junk ids); give them a harmless finite teacher (id 0,
        # log-prob 0, which _lump_rest scales down to a valid distribution) so no NaN appears even in terms that
        # are masked away (NaN * 0 would still poison gradients). Stored float16 log_softmax can round to a hair
        # above 0; no probability is above 1.
        ids = torch.where(valid[..., None], ids, 0).reshape(N * G, -1)
        logp = torch.where(valid[..., None], logp.float().clamp(max=0.0), 0.0).reshape(N * G, -1)
        both = chunked_logprobs(
            flat_h,
            inp.weight,
            torch.cat([labels.reshape(-1, 1), ids], 1),
            temperature=inp.temperature,
            chunk=settings.chunk,
        )
        ell = both[:, 0].detach()
        terms = divergence_terms(settings.divergence, _lump_rest(logp), _lump_rest(both[:, 1:]), settings.beta)
        div = terms.sum(-1)
    else:
        raise ValueError(_NO_TEACHER.format(loss=loss))
    zero = torch.zeros((), device=div.device)
    return torch.where(valid, div.view(N, G), zero), torch.where(valid, ell.view(N, G), zero)


@register_loss("distillspec")
def distillspec_loss(inp: LossInput, settings: LossSettings) -> LossOutput:
    """``Σ_j v_j D(p_j || q_j)`` averaged over each window's valid slots, then over windows (DistillSpec).

    ``settings.divergence`` ∈ fkl, rkl, jsd (``settings.beta``), tvd. The teacher is ``inp.teacher_logits`` (full
    vocabulary) or the stored top-k (``teacher_ids``/``teacher_logprobs``: p and the drafter's full-vocabulary q on
    the k ids, plus one lumped bucket each for the mass outside them, a lower bound exact at k = V); see
    ``_teacher_divergence``."""
    div, ell = _teacher_divergence(inp, settings, "distillspec", slice(None))
    per_window = div.sum(1) / inp.valid.sum(1).clamp(min=1)
    mean_div = float(div.detach().sum() / inp.valid.sum().clamp(min=1))
    return _output(per_window.mean(), ell, inp.valid, divergence=mean_div)


@register_loss("ar_distill")
def ar_distill_loss(inp: LossInput, settings: LossSettings) -> LossOutput:
    """``D(p_1 || q_1)`` on the first slot only, averaged over the windows whose first slot is valid (the
    AR-distillation baseline). The metrics still score every slot, at the cost of one gradient-free pass over V."""
    div, _ = _teacher_divergence(inp, settings, "ar_distill", slice(0, 1))
    first = inp.valid[:, 0]
    loss = div[:, 0].sum() / first.sum().clamp(min=1)
    with torch.no_grad():
        ell = _slot_logprobs(inp, settings.chunk)
    return _output(loss, ell, inp.valid, divergence=float(loss.detach()))
