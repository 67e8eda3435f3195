"""Attention masks for the four attention modes and for explicit (tree) masks.

Every mode is a rule over *position ids*, not over indices, so the same rule serves a fresh prefill, a cached
decode step, a left-padded batch and a cache whose rows kept different numbers of tokens after a tree gather:

    causal         key visible iff  k_pos <= q_pos
    full           every key visible
    prefix_causal  a prefix query (q_pos < P) sees k_pos <= q_pos; a window query (q_pos >= P) sees every key
    block_causal   key visible iff  k_pos // L <= q_pos // L   (bidirectional in a block, causal across blocks)
    explicit       a caller-built boolean mask (draft trees, packed training windows)

Padding and masked-out cache slots are never visible. Each query always sees itself, so a row made only of
padding yields finite (ignored) values instead of NaN.

``build_mask`` returns ``(mask, is_causal)`` for ``torch.nn.functional.scaled_dot_product_attention``; it returns
``(None, ...)`` on the common fast paths so the hot decode loop builds nothing. With a static cache
(``KVCache.static``) the keys are every slot of the cache, so the mask is always built, over the whole capacity
(the slots this forward writes are ``[past, past + T)``; the others are real only where the cache says so).
"""

from __future__ import annotations

import torch

from .kv_cache import KVCache


def default_positions(valid: torch.Tensor | None, B: int, T: int, start: torch.Tensor | None, device) -> torch.Tensor:
    """Position ids ``[B, T]``: left padding does not advance the position; ``start`` ``[B]`` offsets each row."""
    if valid is None:
        pos = torch.arange(T, device=device).expand(B, T)
    else:
        pos = (valid.long().cumsum(dim=1) - 1).clamp(min=0)
    if start is not None:
        pos = pos + start[:, None]
    return pos


def build_mask(
    mode: str,
    q_pos: torch.Tensor,
    q_valid: torch.Tensor | None,
    cache: KVCache | None,
    *,
    prefix_len: torch.Tensor | int | None = None,
    block_size: int | None = None,
    explicit: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, bool]:
    """Boolean mask ``[B, 1, T, S]`` (True = may attend) with S = cached length + T, or None on fast paths.

    q_pos: ``[B, T]`` position ids of the new tokens; q_valid: ``[B, T]`` (None = all real);
    explicit: ``[B, T, S]`` or ``[B, T, T]`` (then every valid cached key is visible).
    """
    if cache is not None and getattr(cache, "per_row", False):  # a RowCache: each row its own length (row_cache.py)
        return cache.mask(q_pos, q_valid, mode)
    B, T = q_pos.shape
    past = cache.length if cache is not None else 0
    static = cache is not None and cache.static
    clean = q_valid is None and (cache is None or cache.all_valid) and not static
    if explicit is None and clean:
        if mode == "full":
            return None, False
        if mode == "causal":
            if past == 0:
                return None, T > 1
            if T == 1:
                return None, False

    device = q_pos.device
    if static:  # keys are every slot: the cached ones, this forward's at [past, past + T), and unused ones (invalid)
        S = cache.capacity
        k_pos = cache.pos.clone()
        k_pos[:, past : past + T] = q_pos
        k_valid = cache.valid.clone()
        k_valid[:, past:] = False
        k_valid[:, past : past + T] = True if q_valid is None else q_valid.bool()
    elif cache is not None and past:
        k_pos = torch.cat([cache.pos[:, :past], q_pos], dim=1)
        k_valid = cache.valid[:, :past]
        new_valid = torch.ones(B, T, dtype=torch.bool, device=device) if q_valid is None else q_valid.bool()
        k_valid = torch.cat([k_valid, new_valid], dim=1)
    else:
        k_pos = q_pos
        k_valid = None if q_valid is None else q_valid.bool()

    qp = q_pos[:, :, None]
    kp = k_pos[:, None, :]
    if explicit is not None:
        allowed = explicit.to(device=device, dtype=torch.bool).clone()  # never write into the caller's tensor
        if allowed.shape[-1] == T and past:
            allowed = torch.cat([torch.ones(B, T, past, dtype=torch.bool, device=device), allowed], dim=-1)
        if allowed.shape != (B, T, past + T):
            raise ValueError(
                f"explicit mask has shape {tuple(explicit.shape)}; expected [B, T, S] = {(B, T, past + T)}"
            )
        if static:  # the unused slots past this forward's are invalid anyway
            allowed = torch.cat([allowed, allowed.new_zeros(B, T, S - past - T)], dim=-1)
    elif mode == "causal":
        allowed = kp <= qp
    elif mode == "full":
        allowed = torch.ones(B, T, kp.shape[-1], dtype=torch.bool, device=device)
    elif mode == "prefix_causal":
        if prefix_len is None:
            raise ValueError("attention 'prefix_causal' needs prefix_len: the position where the draft window starts")
        P = (
            torch.as_tensor(prefix_len, device=device).reshape(-1, 1, 1)
            if not isinstance(prefix_len, int)
            else prefix_len
        )
        allowed = (kp <= qp) | (qp >= P)
    elif mode == "block_causal":
        if not block_size:
            raise ValueError("attention 'block_causal' needs block_size")
        allowed = torch.div(kp, block_size, rounding_mode="floor") <= torch.div(qp, block_size, rounding_mode="floor")
    else:
        raise ValueError(f"unknown attention mode {mode!r}")

    if k_valid is not None:
        allowed = allowed & k_valid[:, None, :]
    # Every query sees itself (keeps all-padding rows finite; trees include the node itself anyway).
    diag = torch.eye(T, dtype=torch.bool, device=device)
    allowed[:, :, past : past + T] |= diag
    return allowed[:, None], False
