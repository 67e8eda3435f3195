"""A skinny bf16 matrix product for CPU decoding, with ``F.linear`` as its reference: ``y = x W^T`` for few rows of x.

A vanilla decode step multiplies one row by every weight matrix of the model, so its speed is how fast the weights
stream from memory. torch's CPU ``linear`` reaches 6-17 GB/s on SmolLM2's shapes at one row in bf16 (oneDNN, 2 cores
of an AMD EPYC with AVX512-BF16, ``bench/vanilla.py``) where a plain read of memory gives 31. This kernel reads each
weight row once for all rows of x, with AVX512-BF16's pairwise dot product (``vdpbf16ps``: bf16 products summed in
fp32), eight weight rows at a time, the rows split over torch's OpenMP threads: 10-25 GB/s on the same shapes. The
fp32 sums are rounded to bf16 (nearest, ties to even) as torch rounds. It takes at most ``MAX_ROWS`` rows: past 4,
its horizontal sums (one per output) cost as much as the products and oneDNN is as fast or faster, so a verify
window of 9 stays on torch; a weight layout packed for column sums is what would take it further.

Its sums run over k in the same order whatever N, M or the thread split is, so a row of x gets the same output among
other rows as alone, and a fused [q; k; v] matrix gives what the three separate ones give, bit for bit. That is what
lets ``Transformer.fuse_projections`` run on a CPU too (``models/builder.py``).

The C source below is compiled once per machine with the system's ``gcc`` into ``~/.cache/streakline/kernels``
(``STREAKLINE_CACHE`` moves it) and loaded with ctypes; torch's own libgomp serves its threads. Where it cannot run
(another CPU, no compiler, an fp32 or fp16 model, more than ``MAX_ROWS`` rows, autograd) ``linear`` is ``F.linear``.
``STREAKLINE_CPU_LINEAR=torch`` forces the reference for a whole process; ``use_reference()`` for a block.

    y = linear(x, weight, bias)           # x [..., K], weight [N, K], bias [N] or None -> [..., N]
    python -m pytest tests/models/test_cpu_linear.py -q
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import hashlib
import os
import subprocess
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .precision import cpu_flags

MAX_ROWS = 4  # rows of x the kernel takes: up to 4 it beats oneDNN; at a verify window's 9 it does not (yet)
ENV = "STREAKLINE_CPU_LINEAR"  # "auto" (default) | "torch"

SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

/* fp32 -> bf16, round to nearest, ties to even (NaNs kept quiet) */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* One tile: rows m0 .. m0+MS-1 of x against weight rows n0 .. n0+R-1, k in steps of 32 (the tail masked). MS and
   R are constants where it is called, so the MS x R accumulators stay in registers. Per (m, n) the sum runs over k
   in one fixed order, whatever N, M or the thread split. */
static inline __attribute__((always_inline)) void tile(const int MS, const int R, const uint16_t *x,
        const uint16_t *w, const uint16_t *b, uint16_t *y, int64_t m0, int64_t n0, int64_t K, int64_t x_stride,
        int64_t y_stride, int64_t steps, __mmask32 tail) {
    __m512 acc[4][8];
    for (int i = 0; i < MS; i++)
        for (int r = 0; r < R; r++) acc[i][r] = _mm512_setzero_ps();
    for (int64_t s = 0; s < steps; s++) {
        const int64_t k = s * 32;
        const __mmask32 mask = (s == steps - 1) ? tail : (__mmask32)0xffffffffu;
        __m512i xv[4];
        for (int i = 0; i < MS; i++) xv[i] = _mm512_maskz_loadu_epi16(mask, x + (m0 + i) * x_stride + k);
        for (int r = 0; r < R; r++) {
            const __m512i wv = _mm512_maskz_loadu_epi16(mask, w + (n0 + r) * K + k);
            for (int i = 0; i < MS; i++) acc[i][r] = _mm512_dpbf16_ps(acc[i][r], (__m512bh)xv[i], (__m512bh)wv);
        }
    }
    for (int i = 0; i < MS; i++)
        for (int r = 0; r < R; r++) {
            float v = _mm512_reduce_add_ps(acc[i][r]);
            if (b) v = v + from_bf16(b[n0 + r]);
            y[(m0 + i) * y_stride + n0 + r] = to_bf16(v);
        }
}

/* y[m, n] = bf16(sum_k x[m, k] w[n, k] (+ b[n])) for few rows of x: blocks of 8 weight rows split over the
   threads; in a block, x's rows four (or fewer) at a time; the last N % 8 weight rows one at a time */
void skinny_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *b, uint16_t *y, int64_t M, int64_t N,
                 int64_t K, int64_t x_stride, int64_t y_stride, int threads) {
    const int64_t steps = (K + 31) / 32;
    const __mmask32 tail = (K % 32) ? (__mmask32)((1u << (K % 32)) - 1u) : (__mmask32)0xffffffffu;
    const int64_t blocks = N / 8;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t blk = 0; blk <= blocks; blk++) {
        const int64_t n0 = blk * 8;
        if (blk == blocks) {  /* the rest, one weight row at a time */
            for (int64_t n = n0; n < N; n++)
                for (int64_t m = 0; m < M; m++) tile(1, 1, x, w, b, y, m, n, K, x_stride, y_stride, steps, tail);
            continue;
        }
        int64_t m0 = 0;
        for (; m0 + 4 <= M; m0 += 4) {  /* 4 x 4 tiles: 16 accumulators */
            tile(4, 4, x, w, b, y, m0, n0, K, x_stride, y_stride, steps, tail);
            tile(4, 4, x, w, b, y, m0, n0 + 4, K, x_stride, y_stride, steps, tail);
        }
        switch (M - m0) {  /* what is left of x: 1-3 rows against all 8 weight rows */
            case 1: tile(1, 8, x, w, b, y, m0, n0, K, x_stride, y_stride, steps, tail); break;
            case 2: tile(2, 8, x, w, b, y, m0, n0, K, x_stride, y_stride, steps, tail); break;
            case 3:
                tile(3, 4, x, w, b, y, m0, n0, K, x_stride, y_stride, steps, tail);
                tile(3, 4, x, w, b, y, m0, n0 + 4, K, x_stride, y_stride, steps, tail);
                break;
            default: break;
        }
    }
}
"""

_override: contextvars.ContextVar[bool] = contextvars.ContextVar("streakline_cpu_linear_reference", default=False)


@contextlib.contextmanager
def use_reference() -> Iterator[None]:
    """``F.linear`` inside the block, whatever the machine could run (tests, benchmarks)."""
    token = _override.set(True)
    try:
        yield
    finally:
        _override.reset(token)


def _cache_dir() -> Path:
    root = os.environ.get("STREAKLINE_CACHE") or Path.home() / ".cache" / "streakline"
    return Path(root) / "kernels"


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The compiled kernel, built on first use; None where this CPU or toolchain cannot run it (with one warning
    saying why, for a CPU that could)."""
    if "avx512_bf16" not in cpu_flags() or "avx512bw" not in cpu_flags():
        return None
    digest = hashlib.sha256(SOURCE.encode()).hexdigest()[:12]
    target = _cache_dir() / f"skinny_bf16-{digest}.so"
    if not target.exists():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                src, out = Path(tmp) / "skinny.c", Path(tmp) / "skinny.so"
                src.write_text(SOURCE)
                cmd = ["gcc", "-O3", "-mavx512f", "-mavx512bw", "-mavx512bf16", "-fopenmp",
                       "-shared", "-fPIC", str(src), "-o", str(out)]  # fmt: skip
                subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
                os.replace(out, target)  # whole or absent: a second process may build the same file
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", None) or e
            warnings.warn(f"the CPU decode kernel did not build ({detail}); decoding uses torch's linear", stacklevel=2)
            return None
    lib = ctypes.CDLL(str(target))
    lib.skinny_bf16.restype = None
    lib.skinny_bf16.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 5 + [ctypes.c_int]
    return lib


def available() -> bool:
    """Whether ``linear`` can take the kernel here (this CPU, this toolchain; not forced to the reference)."""
    return os.environ.get(ENV, "auto") != "torch" and _library() is not None


def _takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    if _override.get() or x.device.type != "cpu" or x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False
    rows = x.numel() // max(1, x.shape[-1])
    if not 0 < rows <= MAX_ROWS or weight.dim() != 2 or not weight.is_contiguous():
        return False
    if bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()):
        return False
    return available()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: on the kernel where it can run (module docstring), else ``F.linear`` itself.
    x: ``[..., K]``; weight: ``[N, K]``; bias: ``[N]`` or None; returns ``[..., N]``."""
    if not _takes(x, weight, bias):
        return F.linear(x, weight, bias)
    K, N = x.shape[-1], weight.shape[0]
    flat = x.reshape(-1, K)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    M = flat.shape[0]
    out = torch.empty(M, N, dtype=torch.bfloat16)
    _library().skinny_bf16(
        flat.data_ptr(),
        weight.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        M,
        N,
        K,
        flat.stride(0),
        N,
        torch.get_num_threads(),
    )
    return out.view(*x.shape[:-1], N)


class KernelLinear(nn.Linear):
    """An ``nn.Linear`` whose forward is ``linear`` (the same parameters and state dict): what ``use_kernels``
    turns a model's Linear layers into for CPU inference."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def use_kernels(model: nn.Module) -> nn.Module:
    """``model`` with every ``nn.Linear`` a ``KernelLinear`` (in place; a no-op for layers already so)."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = KernelLinear
    return model
