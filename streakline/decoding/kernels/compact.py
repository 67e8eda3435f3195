"""Tree-path KV compaction: move the accepted path of a verified draft tree to the front of the draft region, in
place, for every layer at once.

``compact_kv`` is the one public function; ``_compact_torch`` is the reference (``torch.gather`` + slice write, what
``KVCache.gather`` does) and ``_compact_triton`` the GPU path; the switch in ``streakline.decoding.kernels`` picks one.

Triton layout: grid (L*B*H, cdiv(n, BLOCK_N)); each program loads a [BLOCK_N, BLOCK_D] tile of source rows (for k
and v) and stores it at the destination rows, skipping self-copies. Block sizes are pinned (no autotune).

    compact_kv(cache.k, cache.v, index, start)        # index: [B, n] absolute slot ids, start <= index < C
    TRITON_INTERPRET=1 python -m pytest tests/decoding/kernels/test_compact.py -q
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch
from torch import Tensor

# The package defines these before it imports this module, so the cycle resolves.
from streakline.decoding.kernels import backend_for, interpreting

_BLOCK_N = 16
_MAX_BLOCK_D = 64  # D=128 (typical head_dim) takes two steps; a [16, 64] bf16 tile is 2 KiB per load
_WARPS = 4


def compact_kv(k: Tensor, v: Tensor, index: Tensor, start: int, backend: str | None = None) -> None:
    """In place: for all layers l, rows b, heads h and i < n: k[l, b, h, start + i] = old k[l, b, h, index[b, i]]
    (same for v).

    k, v: ``[L, B, H, C, D]`` (any float dtype, contiguous); index: ``[B, n]`` int64 absolute slot ids with
    ``start <= index < C``.
    Precondition (the layout of a verified draft tree guarantees it): for each row, a source slot is either its own
    destination (``index[b, i] == start + i``) or not a destination of any entry (``index[b, i] >= start + n``) --
    this is what makes the in-place parallel copy race-free. The torch reference checks it and raises ValueError;
    the Triton path does not check (no host sync).
    """
    _validate(k, v, index, start)
    if index.shape[1] == 0:
        return
    if backend_for(k, backend) == "triton":
        _compact_triton(k, v, index, start)
    else:
        _compact_torch(k, v, index, start)


def _validate(k: Tensor, v: Tensor, index: Tensor, start: int) -> None:
    if k.dim() != 5 or k.shape != v.shape:
        raise ValueError(f"k and v must both be [L, B, H, C, D], got {list(k.shape)} and {list(v.shape)}")
    if k.dtype != v.dtype or not k.is_floating_point():
        raise ValueError(f"k and v must share one float dtype, got {k.dtype} and {v.dtype}")
    if not (k.is_contiguous() and v.is_contiguous()):
        raise ValueError("k and v must be contiguous")
    _, B, _, C, _ = k.shape
    if index.dim() != 2 or index.shape[0] != B or index.dtype != torch.int64:
        raise ValueError(f"index must be int64 [B, n] with B = {B}, got {index.dtype} {list(index.shape)}")
    if index.device != k.device or v.device != k.device:
        raise ValueError(f"k, v and index must be on one device, got {k.device}, {v.device}, {index.device}")
    n = index.shape[1]
    if not 0 <= start <= start + n <= C:
        raise ValueError(f"destination slots [{start}, {start + n}) must lie in the cache's [0, {C})")


def _compact_torch(k: Tensor, v: Tensor, index: Tensor, start: int) -> None:
    L, B, H, C, D = k.shape
    n = index.shape[1]
    if int(index.min()) < start or int(index.max()) >= C:
        raise ValueError(f"compact_kv indices must lie in [{start}, {C})")
    dest = start + torch.arange(n, device=index.device)
    racy = (index != dest) & (index < start + n)
    if bool(racy.any()):
        b, i = (int(t) for t in racy.nonzero()[0])
        raise ValueError(
            f"compact_kv index[{b}, {i}] = {int(index[b, i])} reads a slot that entry {int(index[b, i]) - start} "
            f"overwrites; a source must be its own destination (start + i) or lie at or past start + n = {start + n}"
        )
    idx = index[None, :, None, :, None].expand(L, B, H, n, D)
    for t in (k, v):
        t[:, :, :, start : start + n] = torch.gather(t, 3, idx)


@functools.cache
def _kernels(interpret: bool) -> SimpleNamespace:
    """Build the Triton kernel; keyed on the interpreter flag, which ``triton.jit`` reads at decoration time."""
    del interpret  # only part of the cache key
    import triton
    import triton.language as tl

    @triton.jit
    def compact(k_ptr, v_ptr, index_ptr, B, H, C, D, n, start, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        lbh = tl.program_id(0).to(tl.int64)  # (l * B + b) * H + h
        b = (lbh // H) % B
        i = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        src = tl.load(index_ptr + b * n + i, mask=i < n, other=0)
        dst = start + i
        # Self-copies are skipped, which is also what lets a self-copy slot sit among the sources race-free.
        move = (i < n) & (src != dst)
        base = lbh * C * D
        cols = tl.arange(0, BLOCK_D)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + cols
            mask = move[:, None] & (d < D)[None, :]
            src_off = base + src[:, None] * D + d[None, :]
            dst_off = base + dst[:, None].to(tl.int64) * D + d[None, :]
            tl.store(k_ptr + dst_off, tl.load(k_ptr + src_off, mask=mask), mask=mask)
            tl.store(v_ptr + dst_off, tl.load(v_ptr + src_off, mask=mask), mask=mask)

    return SimpleNamespace(compact=compact, next_power_of_2=triton.next_power_of_2, cdiv=triton.cdiv)


def _compact_triton(k: Tensor, v: Tensor, index: Tensor, start: int) -> None:
    ker = _kernels(interpreting())
    L, B, H, C, D = k.shape
    n = index.shape[1]
    index = index.contiguous()
    block_d = min(_MAX_BLOCK_D, ker.next_power_of_2(D))
    grid = (L * B * H, ker.cdiv(n, _BLOCK_N))
    ker.compact[grid](k, v, index, B, H, C, D, n, start, BLOCK_N=_BLOCK_N, BLOCK_D=block_d, num_warps=_WARPS)
