"""Fused verification of K draft chains: acceptance probabilities, self-selection, the acceptance walk and the
replacement/bonus sample, in one call (docs/algorithms.md sections 2-3).

``verify_chains`` is the one public function. ``_verify_torch`` beside it is the specification (it materialises the
fp32 probabilities; clear, slow on big vocabularies); ``_verify_triton`` is the GPU path and must agree with it.
The switch in ``streakline.decoding.kernels`` picks one (``backend=``, ``use_backend``, ``$STREAKLINE_KERNELS``).

Triton layout (two launches per call, no [N, K, G+1, V] probability tensor, no fp32 copy of the logits):
  1. ``row_stats``, grid (N, K, G+1): one streaming pass over V per verifier row; per-lane running argmax of the
     logits and online max/sum-exp of ``logits / T``; writes argmax and log-normaliser per row and the slot's
     acceptance probability ``a`` (exact: match; greedy: ``p(x)``; leviathan: ``min(1, p(x) / q(x))``), reading the
     draft token's logit (and q entry) with one scalar load.
  2. ``select_sample``, grid (N,): the per-N step as a second tiny Triton kernel (not torch ops: a dozen
     launches on [N, K, G] tensors would cost more than the work): match lengths and streak scores from
     [K, G] tiles (``tl.cumprod``), selection (ties -> lowest k), the acceptance walk on the chosen chain, then for
     greedy/leviathan two streaming passes over the chosen row that build the residual on the fly: pass one sums
     it, pass two finds the inverse-CDF token with ``tl.cumsum`` inside a block plus a carried offset.
Block sizes are pinned (no autotune: configs that differ between ranks would make ranks disagree).

Where the two paths can disagree: both compute in fp32 from the same upcast logits, but the Triton path forms
``p = exp(x / T - lse)`` where the reference divides by the sum, and it sums/scans in a different order. So
``scores`` agree to ~1e-6 relative, and the discrete outputs agree unless a uniform lands within rounding distance
(~1e-6) of a boundary: ``u_accept[j]`` of ``a[c, j]``, ``u_sample`` of a CDF step of the residual (or ``u_sample``
so close to 1 that one path falls back to the last positive entry), or two chains' streak scores within rounding of
each other. Such a coincidence changes a sample by a measure-zero-like event; it does not bias the decoder.

    out = verify_chains(logits, drafts, rule="greedy", temperature=1.0, u_accept=ua, u_sample=us)
    TRITON_INTERPRET=1 python -m pytest tests/decoding/kernels/test_verify.py -q     # both paths on CPU
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import Tensor

# The package defines these before it imports this module, so the cycle resolves.
from streakline.decoding.kernels import backend_for, interpreting

RULES = ("exact", "greedy", "leviathan")
SELECTIONS = ("streak", "longest")
_RULE_ID = {"exact": 0, "greedy": 1, "leviathan": 2}

# Pinned launch configs (see the module docstring). 4096 bf16 logits per step = 16 per thread at 8 warps: wide
# vector loads and enough bytes in flight per program to stream a 152k vocabulary at bandwidth.
_STATS_BLOCK_V = 4096
_STATS_WARPS = 8
_SAMPLE_BLOCK_V = 4096
_SAMPLE_WARPS = 8


@dataclass
class VerifyOut:
    chosen: Tensor  # [N] int64, the selected chain
    accepted: Tensor  # [N] int64, number of accepted draft tokens on the chosen chain (0..G)
    next_token: Tensor  # [N] int64, the replacement (first rejected slot) or bonus (all accepted) token
    scores: Tensor  # [N, K] float32, the selection score of every chain


def verify_chains(
    logits: Tensor,
    drafts: Tensor,
    *,
    rule: str,
    temperature: float,
    u_accept: Tensor,
    u_sample: Tensor,
    q: Tensor | None = None,
    selection: str = "streak",
    backend: str | None = None,
) -> VerifyOut:
    """Verify K draft chains per row, pick one, walk its acceptance and sample the replacement/bonus token.

    logits: ``[N, K, G+1, V]`` verifier logits (fp32/bf16/fp16). Row j of chain k is ``p_{j+1}`` for draft slot j+1
        given the prefix and chain k's tokens before it; row G is the bonus distribution. Any strides.
    drafts: ``[N, K, G]`` int64 token ids in ``[0, V)``.
    rule: "exact" (verifier temperature 0; ``temperature`` ignored), "greedy" (SpecDiff-2 greedy acceptance) or
        "leviathan" (speculative sampling; needs K == 1 and ``q``). ``p = softmax(logits.float() / temperature)``.
    u_accept: ``[N, G]`` uniforms in [0, 1), one per slot (shared by the chains: only the chosen one is walked).
    u_sample: ``[N]`` uniforms in [0, 1) for the inverse-CDF draw of the replacement/bonus token.
    q: ``[N, G, V]`` drafter probabilities the drafts were sampled from (leviathan only).
    selection: "streak" (expected accepted streak, SpecDiff-2) or "longest" (greedy match length); "exact"
        always picks the longest exact match. Ties go to the lowest k.
    Returns ``VerifyOut`` (chosen, accepted, next_token: ``[N]`` int64; scores: ``[N, K]`` float32).
    """
    _validate(logits, drafts, rule, temperature, u_accept, u_sample, q, selection)
    u_accept = u_accept.float()
    u_sample = u_sample.float()
    if backend_for(logits, backend) == "triton":
        return _verify_triton(logits, drafts, rule, temperature, u_accept, u_sample, q, selection)
    return _verify_torch(logits, drafts, rule, temperature, u_accept, u_sample, q, selection)


def _validate(logits, drafts, rule, temperature, u_accept, u_sample, q, selection) -> None:
    if rule not in RULES:
        raise ValueError(f"unknown acceptance rule {rule!r}; valid: {', '.join(RULES)}")
    if selection not in SELECTIONS:
        raise ValueError(f"unknown selection {selection!r}; valid: {', '.join(SELECTIONS)}")
    if logits.dim() != 4:
        raise ValueError(f"logits must be [N, K, G+1, V], got shape {tuple(logits.shape)}")
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"logits must be float32, bfloat16 or float16, got {logits.dtype}")
    N, K, G1, V = logits.shape
    G = G1 - 1
    if min(N, K, G1, V) < 1:
        raise ValueError(f"logits [N, K, G+1, V] needs N, K, G+1, V >= 1, got {tuple(logits.shape)}")
    if drafts.shape != (N, K, G) or drafts.dtype != torch.int64:
        raise ValueError(f"drafts must be int64 [N, K, G] = {[N, K, G]}, got {drafts.dtype} {list(drafts.shape)}")
    if u_accept.shape != (N, G) or not u_accept.is_floating_point():
        raise ValueError(f"u_accept must be float [N, G] = {[N, G]}, got {u_accept.dtype} {list(u_accept.shape)}")
    if u_sample.shape != (N,) or not u_sample.is_floating_point():
        raise ValueError(f"u_sample must be float [N] = {[N]}, got {u_sample.dtype} {list(u_sample.shape)}")
    if rule != "exact" and not temperature > 0:
        raise ValueError(f"rule {rule!r} needs temperature > 0 (use rule='exact' for temperature 0), got {temperature}")
    if rule == "leviathan":
        if K != 1:
            raise ValueError("leviathan verifies one draft; use multidraft_leviathan or greedy_acceptance for K > 1")
        if q is None:
            raise ValueError("rule 'leviathan' needs q, the [N, G, V] drafter probabilities the drafts came from")
        if q.shape != (N, G, V) or not q.is_floating_point():
            raise ValueError(f"q must be float [N, G, V] = {[N, G, V]}, got {q.dtype} {list(q.shape)}")
    tensors = [drafts, u_accept, u_sample] + ([q] if rule == "leviathan" else [])
    if any(t.device != logits.device for t in tensors):
        raise ValueError(f"all inputs must be on the logits' device {logits.device}")


# ----------------------------------------------------------------------------------------------------------------
# Reference (the specification)
# ----------------------------------------------------------------------------------------------------------------


def _verify_torch(logits, drafts, rule, temperature, u_accept, u_sample, q, selection) -> VerifyOut:
    N, K, G1, V = logits.shape
    G = G1 - 1
    if drafts.numel() and (int(drafts.min()) < 0 or int(drafts.max()) >= V):
        raise ValueError(f"draft token ids must lie in [0, {V})")
    rows = torch.arange(N, device=logits.device)
    x = logits.float()
    amax = x.argmax(-1)  # [N, K, G+1]; ties -> lowest id
    match_len = (drafts == amax[..., :G]).long().cumprod(-1).sum(-1)  # [N, K] leading exact matches

    if rule == "exact":
        scores = match_len.float()
        chosen = scores.argmax(-1)  # first maximum -> lowest k
        accepted = match_len[rows, chosen]
        next_token = amax[rows, chosen, accepted]
        return VerifyOut(chosen, accepted, next_token, scores)

    p = torch.softmax(x / temperature, dim=-1)  # [N, K, G+1, V]
    a = p[..., :G, :].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)  # [N, K, G] = p_j(x_j)
    if rule == "leviathan":
        qx = q.float().gather(-1, drafts[:, 0].unsqueeze(-1)).squeeze(-1).unsqueeze(1)  # [N, 1, G]
        a = torch.where(qx > 0, torch.clamp(a / qx, max=1.0), torch.ones_like(a))
    scores = a.cumprod(-1).sum(-1)  # [N, K] expected accepted streak
    chosen = (scores if selection == "streak" else match_len).argmax(-1)

    if G == 0:
        accepted = torch.zeros(N, dtype=torch.long, device=logits.device)
    else:
        rejected = u_accept >= a[rows, chosen]  # [N, G]
        accepted = torch.where(rejected.any(-1), rejected.long().argmax(-1), G)

    r = p[rows, chosen, accepted]  # [N, V]: bonus distribution unless a slot was rejected
    if G > 0:
        slot = accepted.clamp(max=G - 1)
        was_rejected = (accepted < G).unsqueeze(-1)
        if rule == "greedy":
            residual = r.scatter(-1, drafts[rows, chosen, slot].unsqueeze(-1), 0.0)
        else:
            residual = torch.clamp(r - q.float()[rows, slot], min=0.0)
        r = torch.where(was_rejected, residual, r)
    # argmax of the logits stands in for argmax p (the same token up to rounding ties); only reached when the
    # residual underflows to all zeros, which the acceptance rules make (nearly) impossible.
    next_token = _inverse_cdf(r, u_sample, fallback=amax[rows, chosen, accepted])
    return VerifyOut(chosen, accepted, next_token, scores)


def _inverse_cdf(r: Tensor, u: Tensor, fallback: Tensor) -> Tensor:
    """Smallest v with ``cumsum(r)[v] > u * sum(r)``; the last positive entry if rounding leaves none; ``fallback``
    where ``sum(r) == 0``. r: ``[N, V]`` unnormalised non-negative weights; u, fallback: ``[N]``. Returns ``[N]``."""
    V = r.shape[-1]
    total = r.sum(-1)
    hit = r.cumsum(-1) > (u * total).unsqueeze(-1)
    first = hit.long().argmax(-1)
    last = (V - 1) - (r > 0).flip(-1).long().argmax(-1)
    token = torch.where(hit.any(-1), first, last)
    return torch.where(total > 0, token, fallback)


# ----------------------------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------------------------


@functools.cache
def _kernels(interpret: bool) -> SimpleNamespace:
    """Build the Triton kernels; keyed on the interpreter flag, which ``triton.jit`` reads at decoration time."""
    del interpret  # only part of the cache key
    import triton
    import triton.language as tl

    @triton.jit
    def row_stats(
        logits_ptr, drafts_ptr, q_ptr, a_ptr, amax_ptr, lse_ptr,
        K, G, V, s_ln, s_lk, s_lj, s_lv, s_qn, s_qj, s_qv, temperature,
        RULE: tl.constexpr, BLOCK_V: tl.constexpr,
    ):  # fmt: skip
        n = tl.program_id(0).to(tl.int64)
        k = tl.program_id(1).to(tl.int64)
        j = tl.program_id(2).to(tl.int64)
        row_ptr = logits_ptr + n * s_ln + k * s_lk + j * s_lj
        out = (n * K + k) * (G + 1) + j
        offs = tl.arange(0, BLOCK_V)
        # Per-lane accumulators, reduced once after the loop. A lane sees increasing ids, so a strict ">" keeps the
        # lowest id among equal maxima, as torch.argmax does.
        best = tl.full([BLOCK_V], float("-inf"), tl.float32)
        best_i = tl.zeros([BLOCK_V], tl.int32)
        # A finite floor instead of -inf so that fully masked or -inf lanes give exp(-inf) = 0, never inf - inf.
        run_m = tl.full([BLOCK_V], -3.0e38, tl.float32)
        run_s = tl.zeros([BLOCK_V], tl.float32)
        for v0 in range(0, V, BLOCK_V):
            idx = v0 + offs
            mask = idx < V
            x = tl.load(row_ptr + idx.to(tl.int64) * s_lv, mask=mask, other=float("-inf")).to(tl.float32)
            better = x > best
            best = tl.where(better, x, best)
            best_i = tl.where(better, idx, best_i)
            if RULE != 0:
                xs = x / temperature
                new_m = tl.maximum(run_m, xs)
                run_s = run_s * tl.exp(run_m - new_m) + tl.exp(xs - new_m)
                run_m = new_m
        top = tl.max(best, axis=0)
        amax = tl.min(tl.where(best == top, best_i, 2147483647), axis=0)
        tl.store(amax_ptr + out, amax.to(tl.int64))
        if RULE != 0:
            m = tl.max(run_m, axis=0)
            lse = m + tl.log(tl.sum(run_s * tl.exp(run_m - m), axis=0))
            tl.store(lse_ptr + out, lse)
            if j < G:
                d = tl.load(drafts_ptr + (n * K + k) * G + j)
                a = tl.exp(tl.load(row_ptr + d * s_lv).to(tl.float32) / temperature - lse)
                if RULE == 2:
                    qd = tl.load(q_ptr + n * s_qn + j * s_qj + d * s_qv).to(tl.float32)
                    a = tl.where(qd > 0, tl.minimum(a / qd, 1.0), 1.0)
                tl.store(a_ptr + (n * K + k) * G + j, a)

    @triton.jit
    def select_sample(
        logits_ptr, drafts_ptr, q_ptr, a_ptr, amax_ptr, lse_ptr, ua_ptr, us_ptr,
        chosen_ptr, accepted_ptr, next_ptr, scores_ptr,
        K, G, V, s_ln, s_lk, s_lj, s_lv, s_qn, s_qj, s_qv, temperature,
        RULE: tl.constexpr, LONGEST: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):  # fmt: skip
        n = tl.program_id(0).to(tl.int64)
        ks = tl.arange(0, BLOCK_K)
        gs = tl.arange(0, BLOCK_G)
        kmask = ks < K
        gmask = gs < G
        tile = kmask[:, None] & gmask[None, :]
        chain = n * K + ks  # [BLOCK_K]
        d = tl.load(drafts_ptr + chain[:, None] * G + gs[None, :], mask=tile, other=-1)
        am = tl.load(amax_ptr + chain[:, None] * (G + 1) + gs[None, :], mask=tile, other=-2)
        # Padding columns sit after the real ones, so they never cut a real prefix short.
        lead = tl.cumprod(((d == am) & tile).to(tl.int32), axis=1)
        match_len = tl.sum(lead, axis=1)  # [BLOCK_K]
        a = tl.zeros([BLOCK_K, BLOCK_G], tl.float32)
        if RULE == 0:
            scores = match_len.to(tl.float32)
        else:
            a = tl.load(a_ptr + chain[:, None] * G + gs[None, :], mask=tile, other=0.0)
            scores = tl.sum(tl.where(tile, tl.cumprod(a, axis=1), 0.0), axis=1)
        tl.store(scores_ptr + chain, scores, mask=kmask)

        key = scores
        if LONGEST:
            key = match_len.to(tl.float32)
        key = tl.where(kmask, key, -1.0)  # real keys are >= 0
        c = tl.min(tl.where(key == tl.max(key, axis=0), ks, BLOCK_K), axis=0)
        if RULE == 0:
            acc = tl.sum(tl.where(ks == c, match_len, 0), axis=0)
        else:
            a_c = tl.sum(tl.where((ks == c)[:, None], a, 0.0), axis=0)  # [BLOCK_G], exact (adds zeros)
            u = tl.load(ua_ptr + n * G + gs, mask=gmask, other=0.0)
            acc = tl.min(tl.where((u >= a_c) & gmask, gs, G), axis=0)
        tl.store(chosen_ptr + n, c.to(tl.int64))
        tl.store(accepted_ptr + n, acc.to(tl.int64))

        row = (n * K + c) * (G + 1) + acc
        token = tl.load(amax_ptr + row)
        if RULE != 0:
            lse = tl.load(lse_ptr + row)
            row_ptr = logits_ptr + n * s_ln + c * s_lk + acc * s_lj
            q_row = q_ptr + n * s_qn + acc * s_qj
            was_rejected = acc < G
            # -1 matches no id: nothing is zeroed when the chain was fully accepted (bonus row).
            x_rej = tl.load(drafts_ptr + (n * K + c) * G + acc, mask=was_rejected, other=-1)
            # The bonus row has no q to subtract: read none of it (a scalar end, since the interpreter refuses a
            # vector mask broadcast against a scalar bool).
            q_end = tl.where(was_rejected, V, 0)
            offs = tl.arange(0, BLOCK_V)
            tot = tl.zeros([BLOCK_V], tl.float32)
            last = tl.full([BLOCK_V], -1, tl.int32)
            for v0 in range(0, V, BLOCK_V):
                idx = v0 + offs
                mask = idx < V
                x = tl.load(row_ptr + idx.to(tl.int64) * s_lv, mask=mask, other=float("-inf")).to(tl.float32)
                r = tl.exp(x / temperature - lse)
                if RULE == 1:
                    r = tl.where(idx == x_rej, 0.0, r)
                else:
                    qv = tl.load(q_row + idx.to(tl.int64) * s_qv, mask=idx < q_end, other=0.0)
                    r = tl.maximum(r - qv.to(tl.float32), 0.0)
                r = tl.where(mask, r, 0.0)
                tot += r
                last = tl.maximum(last, tl.where(r > 0, idx, -1))
            total = tl.sum(tot, axis=0)
            threshold = tl.load(us_ptr + n) * total
            carry = 0.0
            first = V
            # Second pass recomputes r with the same ops (bitwise equal) instead of storing a [V] scratch row. It is
            # written out twice on purpose: the kernels are built inside _kernels() (so TRITON_INTERPRET is read
            # late), and a @triton.jit helper defined there is a closure the interpreter cannot resolve.
            for v0 in range(0, V, BLOCK_V):
                idx = v0 + offs
                mask = idx < V
                x = tl.load(row_ptr + idx.to(tl.int64) * s_lv, mask=mask, other=float("-inf")).to(tl.float32)
                r = tl.exp(x / temperature - lse)
                if RULE == 1:
                    r = tl.where(idx == x_rej, 0.0, r)
                else:
                    qv = tl.load(q_row + idx.to(tl.int64) * s_qv, mask=idx < q_end, other=0.0)
                    r = tl.maximum(r - qv.to(tl.float32), 0.0)
                r = tl.where(mask, r, 0.0)
                cdf = carry + tl.cumsum(r, axis=0)
                first = tl.minimum(first, tl.min(tl.where((cdf > threshold) & mask, idx, V), axis=0))
                carry += tl.sum(r, axis=0)
            sampled = tl.where(first < V, first, tl.max(last, axis=0))
            token = tl.where(total > 0, sampled.to(tl.int64), token)
        tl.store(next_ptr + n, token)

    return SimpleNamespace(row_stats=row_stats, select_sample=select_sample, next_power_of_2=triton.next_power_of_2)


def _verify_triton(logits, drafts, rule, temperature, u_accept, u_sample, q, selection) -> VerifyOut:
    ker = _kernels(interpreting())
    N, K, G1, V = logits.shape
    G = G1 - 1
    dev = logits.device
    rule_id = _RULE_ID[rule]
    temperature = float(temperature) if rule != "exact" else 1.0
    # Empty tensors may have a null data pointer, which a compiled launch refuses: stand in 1-element buffers
    # that the kernels never read (every access is masked by G).
    a = torch.empty(N * K * max(G, 1), dtype=torch.float32, device=dev)
    amax = torch.empty(N * K * G1, dtype=torch.int64, device=dev)
    lse = torch.empty(N * K * G1, dtype=torch.float32, device=dev)
    drafts_c = drafts.contiguous() if G > 0 else torch.zeros(1, dtype=torch.int64, device=dev)
    ua = u_accept.contiguous() if G > 0 else torch.zeros(1, dtype=torch.float32, device=dev)
    us = u_sample.contiguous()
    q_t, q_strides = (q, q.stride()) if rule == "leviathan" and G > 0 else (a, (0, 0, 0))
    s_l = logits.stride()
    chosen = torch.empty(N, dtype=torch.int64, device=dev)
    accepted = torch.empty(N, dtype=torch.int64, device=dev)
    next_token = torch.empty(N, dtype=torch.int64, device=dev)
    scores = torch.empty(N, K, dtype=torch.float32, device=dev)

    common = (K, G, V, *s_l, *q_strides, temperature)
    ker.row_stats[(N, K, G1)](
        logits, drafts_c, q_t, a, amax, lse, *common, RULE=rule_id, BLOCK_V=_STATS_BLOCK_V, num_warps=_STATS_WARPS
    )
    ker.select_sample[(N,)](
        logits, drafts_c, q_t, a, amax, lse, ua, us, chosen, accepted, next_token, scores, *common,
        RULE=rule_id, LONGEST=rule != "exact" and selection == "longest",
        BLOCK_K=max(2, ker.next_power_of_2(K)), BLOCK_G=max(2, ker.next_power_of_2(G)),
        BLOCK_V=_SAMPLE_BLOCK_V, num_warps=_SAMPLE_WARPS,
    )  # fmt: skip
    return VerifyOut(chosen, accepted, next_token, scores)
