"""Which attention kernel a forward takes, chosen in one place, and the call that runs it.

``torch.nn.functional.scaled_dot_product_attention`` picks a kernel by itself, and on a GPU its choice for a decode
step with an explicit boolean mask is cuDNN, which builds a new execution plan for every new key length: measured on
an H200 at Qwen2.5-7B shapes that was 62% of the host time of a step (1.3 ms of CPU per call, 28 calls a step). So
the model chooses:

    path        when                                              kernel
    flash       CUDA, fp16/bf16, no mask (plain causal or full)   FlashAttention (GQA native)
    efficient   CUDA, a mask, or fp32                             memory-efficient attention, no per-shape plans
    default     CPU (and anything else)                           in bf16 with at most 16 queries a head (a decode
                                                                  step, a verify window) the decode-attention
                                                                  kernel (``cpu_attention.py``) where this CPU
                                                                  runs it; else whatever SDPA picks: CPU flash or
                                                                  math; a masked one-query step with GQA folded

``efficient`` folds grouped-query attention into the query axis instead of asking SDPA for ``enable_gqa`` (which
only the flash and math kernels take): the G query heads sharing one key/value head become G x T queries of that
head, with the mask repeated G times, so no key/value is ever copied. ``fold_gqa`` is exact on every device (the
tests compare it with the expanded computation on CPU).

    out = attend(q, k, v, mask, is_causal)          # q [B, H, T, D], k/v [B, Hkv, S, D], mask [B, 1, T, S] or None
    choose_path(q, has_mask=True)                   # -> "efficient" on a GPU, "default" on CPU
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from . import cpu_attention

PATHS = ("flash", "efficient", "default")


def choose_path(q: torch.Tensor, *, has_mask: bool) -> str:
    """The kernel path for queries ``q`` (only their device and dtype count) with or without an explicit mask."""
    if q.device.type != "cuda":
        return "default"
    if has_mask or q.dtype not in (torch.float16, torch.bfloat16):
        return "efficient"
    return "flash"


def _backends(path: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # SDPA takes the first kernel of the allowed set that supports the call, in its own priority order (flash, then
    # efficient, then math). Math stays allowed as the last resort for a shape the fast kernels refuse (an odd head
    # size): slow but right. cuDNN is never allowed.
    if path == "flash":
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
    return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def fold_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, sdpa=None) -> torch.Tensor:
    """Grouped-query attention without copying keys/values: ``[B, H, T, D]`` queries become ``[B, Hkv, G*T, D]``.

    Query head h uses key/value head ``h // G`` (the convention of ``repeat_interleave`` and of every Llama/Qwen
    checkpoint), so heads ``kv*G .. kv*G + G-1`` are one group; a group's queries are stacked g-major, and the mask
    ``[B, 1, T, S]`` is repeated G times along the query axis to match. Causality must be in the mask (is_causal
    would apply to the folded axis).
    """
    sdpa = sdpa or F.scaled_dot_product_attention
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    if G == 1:
        return sdpa(q, k, v, attn_mask=mask)
    qf = q.reshape(B, Hkv, G * T, D)  # heads are contiguous per group: [B, Hkv, G, T, D] -> [B, Hkv, G*T, D]
    mf = None if mask is None else mask.expand(B, 1, T, mask.shape[-1]).repeat(1, 1, G, 1)
    out = sdpa(qf, k, v, attn_mask=mf)
    return out.reshape(B, H, T, D)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
    *,
    path: str | None = None,
) -> torch.Tensor:
    """Attention ``[B, H, T, D]`` of queries ``q`` over keys/values ``k, v`` ``[B, Hkv, S, D]`` on the chosen path.

    mask: boolean ``[B, 1, T, S]`` (True = may attend) or None; is_causal: only with mask None.
    path: force one of ``PATHS`` (tests); default ``choose_path``.
    """
    path = path or choose_path(q, has_mask=mask is not None)
    if path not in PATHS:
        raise ValueError(f"unknown attention path {path!r}; valid: {', '.join(PATHS)}")
    if path == "default":  # a CPU decode step or verify window in bf16: the kernel beside this reference
        out = cpu_attention.attend(q, k, v, mask, is_causal)
        if out is not None:
            return out
    gqa = k.shape[1] != q.shape[1]
    ctx = contextlib.nullcontext() if path == "default" else _backends(path)
    with ctx:
        if path == "efficient" and gqa:
            if is_causal:  # a causal prefill in fp32 on a GPU: the mask makes the fold exact
                T, S = q.shape[2], k.shape[2]
                mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)[None, None]
            return fold_gqa(q, k, v, mask)
        if gqa and mask is not None and q.shape[2] == 1 and q.device.type == "cpu":
            # a masked decode step on CPU: SDPA's CPU kernel takes the folded G queries of a key/value head as one
            # block, 1.3-1.4x faster than enable_gqa at SmolLM2's shapes (64 rows, 170 keys; bench/sampling.py)
            return fold_gqa(q, k, v, mask)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=gqa)
