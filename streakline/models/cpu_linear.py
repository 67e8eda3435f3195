"""A skinny bf16 matrix product for CPU decoding, with ``F.linear`` as its reference: ``y = x W^T`` for few rows of x.

A vanilla decode step multiplies one row by every weight matrix of the model, and a verify window 9 or so, so its
speed is how fast the weights stream from memory. torch's CPU ``linear`` (oneDNN) reaches 6-13 GB/s on SmolLM2's
shapes at one row in bf16 and 5-10 at nine (2 cores of an AMD EPYC with AVX512-BF16, ``bench/vanilla.py``), where a
plain read of memory gives 35. This kernel reads a copy of each weight packed for it (``pack``: for each group of 16
outputs and each pair of k, the 16 outputs' two weights in one 64-byte register), so AVX512-BF16's pairwise dot
product (``vdpbf16ps``: bf16 products summed in fp32) gives each fp32 lane its own output and no horizontal sum is
needed; per pair of k it loads one register of weights per group and broadcasts x's pair per row, up to 12 rows at
once, so a verify window reads each weight from memory once. Tiles of 32 outputs are split over torch's OpenMP
threads. The fp32 sums are rounded to bf16 (nearest, ties to even) as torch rounds. Measured there: 10-46 GB/s at
one row, 8-29 at nine, 1.5-3.4x torch. It takes at most ``MAX_ROWS`` rows; a prefill's many rows stay on oneDNN.

A CPU with AVX2 and FMA but no native bf16 (AMD Zen 2 and 3, Intel before Cooper Lake) runs a second kernel on the
same packed copy (``SOURCE_AVX2``): a 32-bit lane's high half is already the odd k's weight as an fp32 and its low
half shifted up the even k's, so two integer instructions widen 8 lanes into two fp32 registers, x's rows are
widened once a call, and fp32 FMAs sum each output. There torch emulates bf16 (1.8-15 GB/s) and its fp32 product
reads twice the bytes (6-12 GB/s streaming); this one reaches 27-37 GB/s at one row and 100-110 GFLOP/s at nine, of
the two cores' 157 (2 cores of an AMD EPYC without AVX-512, streaming SmolLM2's shapes from memory), and 140-150 at
16 rows. It takes any number of rows (``max_rows()`` is None), since torch's emulated bf16 GEMM is as slow at a
prefill's hundreds of rows (18 GFLOP/s): a 150-token prefill of SmolLM2 took 2.2 s on it, against 0.33 s in fp32.

The packed copies are made on a weight's first product and kept while it lives (``_packed``; an in-place change,
as ``load_state_dict`` makes, packs it again): one more copy of each weight the kernel reads, which is what CPU
decoding can afford at the sizes it runs. A view of whole rows of a packed weight from a group's first row (the k/v
rows of a fused q/k/v matrix) reads the base's copy.

Its sums run over k in the same order whatever N, M or the thread split is, so a row of x gets the same output among
other rows as alone, and a fused [q; k; v] matrix gives what the three separate ones give, bit for bit. That is what
lets ``Transformer.fuse_projections`` run on a CPU too (``models/builder.py``).

The C source below is compiled once per machine and loaded by ``cpu_native.library`` (gcc, a cache keyed by the
source's hash, torch's own libgomp for its threads). Where it cannot run (another CPU, no compiler, an fp32 or fp16
model, more rows than ``max_rows()``, autograd) ``linear`` is ``F.linear``.
``STREAKLINE_CPU_LINEAR=torch`` forces the reference for a whole process; ``use_reference()`` for a block.

    y = linear(x, weight, bias)           # x [..., K], weight [N, K], bias [N] or None -> [..., N]
    python -m pytest tests/models/test_cpu_linear.py -q
"""

from __future__ import annotations

import ctypes
import functools
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_native

MAX_ROWS = 16  # rows of x the AVX512-BF16 kernel takes (a decode step's, a verify window's); past it oneDNN's GEMM
ENV = cpu_native.ENV  # "auto" (default) | "torch"

SOURCE = r"""
/* after cpu_native.PRELUDE["avx512_bf16"]: to_bf16, from_bf16 */

/* One tile: rows m0 .. m0+MS-1 of x against the G groups of 16 outputs from g0. The packed weight holds, for
   group g and k-pair p, the 16 outputs' two weights (64 bytes: one register), so each fp32 lane sums its own output
   and no horizontal sum is needed: per k-pair, one load of weights per group and one broadcast of x's pair per row.
   MS and G are constants where it is called, so the MS x G accumulators stay in registers. Each output's sum runs
   over the k-pairs in one fixed order, whatever M, N or the thread split. */
static inline __attribute__((always_inline)) void tile(const int MS, const int G, const uint16_t *x,
        const uint16_t *wp, const uint16_t *b, uint16_t *y, int64_t m0, int64_t g0, int64_t N, int64_t pairs,
        int64_t x_stride, int64_t y_stride) {
    __m512 acc[12][2];
    for (int i = 0; i < MS; i++)
        for (int g = 0; g < G; g++) acc[i][g] = _mm512_setzero_ps();
    const uint16_t *w0 = wp + g0 * pairs * 32;
    for (int64_t p = 0; p < pairs; p++) {
        __m512i wv[2];
        for (int g = 0; g < G; g++) wv[g] = _mm512_loadu_si512((const void *)(w0 + (g * pairs + p) * 32));
        for (int i = 0; i < MS; i++) {
            int32_t pair;
            memcpy(&pair, x + (m0 + i) * x_stride + 2 * p, 4);
            const __m512i xv = _mm512_set1_epi32(pair);
            for (int g = 0; g < G; g++) acc[i][g] = _mm512_dpbf16_ps(acc[i][g], (__m512bh)wv[g], (__m512bh)xv);
        }
    }
    for (int g = 0; g < G; g++) {
        const int64_t n0 = (g0 + g) * 16;
        const __mmask16 mask = (n0 + 16 <= N) ? (__mmask16)0xffff : (__mmask16)((1u << (N - n0)) - 1u);
        __m512 bias = _mm512_setzero_ps();
        if (b) bias = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, b + n0)), 16));
        for (int i = 0; i < MS; i++) {
            const __m512 v = b ? _mm512_add_ps(acc[i][g], bias) : acc[i][g];
            _mm256_mask_storeu_epi16(y + (m0 + i) * y_stride + n0, mask, to_bf16(v));
        }
    }
}

#define ROWS(G)                                                                      \
    switch (rows) {                                                                  \
        case 1: tile(1, G, x, wp, b, y, m0, g0, N, pairs, x_stride, y_stride); break;   \
        case 2: tile(2, G, x, wp, b, y, m0, g0, N, pairs, x_stride, y_stride); break;   \
        case 3: tile(3, G, x, wp, b, y, m0, g0, N, pairs, x_stride, y_stride); break;   \
        case 4: tile(4, G, x, wp, b, y, m0, g0, N, pairs, x_stride, y_stride); break;   \
        case 5: tile(5, G, x, wp, b, y, m0, g0, N, pairs, x_stride, y_stride); break;   \
        case 6: tile(6, G, x, wp, b, y, m0, g0, N, pairs, x_stride, y_stride); break;   \
        case 7: tile(7, G, x, wp, b, y, m0, g0, N, pairs, x_stride, y_stride); break;   \
        case 8: tile(8, G, x, wp, b, y, m0, g0, N, pairs, x_stride, y_stride); break;   \
        case 9: tile(9, G, x, wp, b, y, m0, g0, N, pairs, x_stride, y_stride); break;   \
        case 10: tile(10, G, x, wp, b, y, m0, g0, N, pairs, x_stride, y_stride); break; \
        case 11: tile(11, G, x, wp, b, y, m0, g0, N, pairs, x_stride, y_stride); break; \
        default: tile(12, G, x, wp, b, y, m0, g0, N, pairs, x_stride, y_stride); break; \
    }

/* y[m, n] = bf16(sum_k x[m, k] w[n, k] (+ b[n])), w packed as [groups][pairs][16][2] (pack() in Python): tiles of
   two groups (32 outputs) split over the threads; in a tile, x's rows 12 (or fewer) at a time, so a verify window
   of up to 12 rows reads each weight from memory once. x has an even number of columns (2 * pairs). */
void packed_bf16(const uint16_t *x, const uint16_t *wp, const uint16_t *b, uint16_t *y, int64_t M, int64_t N,
                 int64_t pairs, int64_t x_stride, int64_t y_stride, int threads) {
    const int64_t groups = (N + 15) / 16;
    const int64_t tiles = (groups + 1) / 2;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t g0 = t * 2;
        for (int64_t m0 = 0; m0 < M; m0 += 12) {
            const int64_t rows = (M - m0 < 12) ? M - m0 : 12;
            if (g0 + 2 <= groups) {
                ROWS(2)
            } else {
                ROWS(1)
            }
        }
    }
}
"""

SOURCE_AVX2 = r"""
/* after cpu_native.PRELUDE["avx2"]: round_half, from_bf16 */

/* 16 fp32 (two registers) -> 16 bf16 in order: packus interleaves 128-bit lanes ([lo0-3 hi0-3 | lo4-7 hi4-7]),
   the permute puts them back */
static inline __m256i to_bf16(__m256 lo, __m256 hi) {
    return _mm256_permute4x64_epi64(_mm256_packus_epi32(round_half(lo), round_half(hi)), 0xd8);
}

/* One tile: rows m0 .. m0+MS-1 of x (as fp32, xf) against the G groups of 16 outputs from g0. The packed weight
   holds, for group g and k-pair p, the 16 outputs' two bf16 weights as 16 32-bit lanes (64 bytes): a lane's high
   half is the odd k's weight as an fp32 (low bits zero), its low half shifted up the even k's, so two instructions
   turn 8 lanes into two fp32 registers, and each accumulator lane sums its own output (no horizontal sum). Each
   output's sum runs over k in one fixed order (even k, then odd k, pair after pair), whatever M, N or the threads. */
static inline __attribute__((always_inline)) void tile(const int MS, const int G, const float *xf,
        const uint16_t *wp, const uint16_t *b, uint16_t *y, int64_t m0, int64_t g0, int64_t N, int64_t pairs,
        int64_t K2, int64_t y_stride) {
    __m256 acc[4][2][2];
    for (int i = 0; i < MS; i++)
        for (int g = 0; g < G; g++) acc[i][g][0] = acc[i][g][1] = _mm256_setzero_ps();
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    const uint16_t *w0 = wp + g0 * pairs * 32;
    for (int64_t p = 0; p < pairs; p++) {
        __m256 we[2][2], wo[2][2];
        for (int g = 0; g < G; g++)
            for (int h = 0; h < 2; h++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(w0 + (g * pairs + p) * 32 + h * 16));
                we[g][h] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
                wo[g][h] = _mm256_castsi256_ps(_mm256_and_si256(v, high));
            }
        for (int i = 0; i < MS; i++) {
            const float *xr = xf + (m0 + i) * K2 + 2 * p;
            const __m256 xe = _mm256_broadcast_ss(xr), xo = _mm256_broadcast_ss(xr + 1);
            for (int g = 0; g < G; g++)
                for (int h = 0; h < 2; h++)
                    acc[i][g][h] = _mm256_fmadd_ps(wo[g][h], xo, _mm256_fmadd_ps(we[g][h], xe, acc[i][g][h]));
        }
    }
    for (int g = 0; g < G; g++) {
        const int64_t n0 = (g0 + g) * 16;
        const int64_t valid = (n0 + 16 <= N) ? 16 : N - n0;
        __m256 bias[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        if (b) {
            uint16_t tmp[16] = {0};
            memcpy(tmp, b + n0, valid * 2);
            for (int h = 0; h < 2; h++)
                bias[h] = _mm256_castsi256_ps(_mm256_slli_epi32(
                        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(tmp + 8 * h))), 16));
        }
        for (int i = 0; i < MS; i++) {
            __m256 lo = acc[i][g][0], hi = acc[i][g][1];
            if (b) { lo = _mm256_add_ps(lo, bias[0]); hi = _mm256_add_ps(hi, bias[1]); }
            const __m256i out = to_bf16(lo, hi);
            if (valid == 16) _mm256_storeu_si256((__m256i *)(y + (m0 + i) * y_stride + n0), out);
            else {
                uint16_t tmp[16];
                _mm256_storeu_si256((__m256i *)tmp, out);
                memcpy(y + (m0 + i) * y_stride + n0, tmp, valid * 2);
            }
        }
    }
}

/* y[m, n] = bf16(sum_k x[m, k] w[n, k] (+ b[n])), w packed as [groups][pairs][16][2] (pack() in Python), x's rows
   first widened to fp32 (xf: M x 2*pairs). Tiles of two groups (32 outputs) split over the threads; in a tile, one
   row at a time over both groups, or four rows at a time over one group then the other (16 accumulators at most of
   AVX2's 16 registers are not all free: 8 hold sums, 4 weights), so a verify window reads each weight from memory
   once and from L1 after. */
void packed_bf16(const uint16_t *x, const uint16_t *wp, const uint16_t *b, uint16_t *y, int64_t M, int64_t N,
                 int64_t pairs, int64_t x_stride, int64_t y_stride, int threads) {
    const int64_t K2 = 2 * pairs;
    float *xf = (float *)malloc(sizeof(float) * (size_t)(M * K2));
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < K2; k++) {
            const uint32_t u = (uint32_t)x[m * x_stride + k] << 16;
            memcpy(xf + m * K2 + k, &u, 4);
        }
    const int64_t groups = (N + 15) / 16;
    const int64_t tiles = (groups + 1) / 2;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t g0 = t * 2;
        const int two = g0 + 2 <= groups;
        if (M == 1) {
            if (two) tile(1, 2, xf, wp, b, y, 0, g0, N, pairs, K2, y_stride);
            else tile(1, 1, xf, wp, b, y, 0, g0, N, pairs, K2, y_stride);
            continue;
        }
        for (int64_t g = g0; g < g0 + 1 + two; g++)
            for (int64_t m0 = 0; m0 < M; m0 += 4) {
                switch (M - m0 < 4 ? M - m0 : 4) {
                    case 1: tile(1, 1, xf, wp, b, y, m0, g, N, pairs, K2, y_stride); break;
                    case 2: tile(2, 1, xf, wp, b, y, m0, g, N, pairs, K2, y_stride); break;
                    case 3: tile(3, 1, xf, wp, b, y, m0, g, N, pairs, K2, y_stride); break;
                    default: tile(4, 1, xf, wp, b, y, m0, g, N, pairs, K2, y_stride); break;
                }
            }
    }
    free(xf);
}
"""

use_reference = cpu_native.use_reference  # torch's ops inside the block, this kernel's and the others'


KERNELS = {"avx512_bf16": SOURCE, "avx2": SOURCE_AVX2}  # by instruction set, best first


@functools.cache
def _chosen() -> tuple[str, ctypes.CDLL] | None:
    """The best kernel this CPU and toolchain run, by its instruction set's name, or None."""
    return cpu_native.best("packed_bf16", KERNELS)


def max_rows() -> int | None:
    """The most rows of x that ``linear`` puts on the kernel here: ``MAX_ROWS`` for AVX512-BF16 (oneDNN's native
    GEMM is as fast past it), None (any) for AVX2 (torch's bf16 is emulated there at every size)."""
    return MAX_ROWS if instruction_set() == "avx512_bf16" else None


def instruction_set() -> str | None:
    """``avx512_bf16`` or ``avx2``: which kernel ``linear`` takes here, or None (``F.linear`` everywhere)."""
    chosen = _chosen() if cpu_native.enabled() else None
    return None if chosen is None else chosen[0]


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The compiled kernel (``cpu_native.library``), or None where this CPU or toolchain cannot run it."""
    chosen = _chosen()
    if chosen is None:
        return None
    lib = chosen[1]
    lib.packed_bf16.restype = None
    lib.packed_bf16.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 5 + [ctypes.c_int]
    return lib


def available() -> bool:
    """Whether ``linear`` can take the kernel here (this CPU, this toolchain; not forced to the reference)."""
    return cpu_native.enabled() and _library() is not None


def _takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    if cpu_native.referenced() or x.device.type != "cpu" or x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False
    rows = x.numel() // max(1, x.shape[-1])
    limit = max_rows()
    if rows <= 0 or (limit is not None and rows > limit) or weight.dim() != 2 or not weight.is_contiguous():
        return False
    if bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()):
        return False
    return available()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] in the kernel's layout: [groups of 16 outputs][pairs of k][16][2], zero-padded to whole
    groups and pairs, so that one 64-byte load holds the next two weights of 16 outputs."""
    N, K = weight.shape
    Np, Kp = -(-N // 16) * 16, K + K % 2
    padded = F.pad(weight.detach(), (0, Kp - K, 0, Np - N))
    return padded.view(Np // 16, 16, Kp // 2, 2).transpose(1, 2).contiguous()


# packed copies of the weights the kernel has read, by the weight tensor's id: (a weak reference to it, its version
# counter when packed, the packed copy). An entry goes with its weight; an in-place change repacks it.
_PACKED: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}


def _packed(weight: torch.Tensor) -> torch.Tensor:
    """The packed copy of ``weight``, or of the rows of its base it views (``qkv_proj.weight[q_rows:]``: the
    base's packed groups from that row, when it starts a group), packed once and kept while the weight lives."""
    base, first = weight, 0
    if weight._base is not None and weight._base.dim() == 2 and weight._base.shape[1] == weight.shape[1]:
        offset = (weight.data_ptr() - weight._base.data_ptr()) // weight.element_size()
        if offset % (16 * weight.shape[1]) == 0:  # a view of whole rows from a group's first one
            base, first = weight._base, offset // (16 * weight.shape[1])
    entry = _PACKED.get(id(base))
    if entry is None or entry[0]() is not base or entry[1] != base._version:
        key = id(base)
        _PACKED[key] = entry = (weakref.ref(base, lambda _, k=key: _PACKED.pop(k, None)), base._version, pack(base))
    return entry[2][first : first + -(-weight.shape[0] // 16)]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: on the kernel where it can run (module docstring), else ``F.linear`` itself.
    x: ``[..., K]``; weight: ``[N, K]``; bias: ``[N]`` or None; returns ``[..., N]``."""
    if not _takes(x, weight, bias):
        return F.linear(x, weight, bias)
    K, N = x.shape[-1], weight.shape[0]
    flat = x.reshape(-1, K)
    if K % 2:  # the kernel reads x's columns in pairs: a zero column pairs the last
        flat = F.pad(flat, (0, 1))
    elif flat.stride(-1) != 1:
        flat = flat.contiguous()
    M = flat.shape[0]
    packed = _packed(weight)
    out = torch.empty(M, N, dtype=torch.bfloat16)
    _library().packed_bf16(
        flat.data_ptr(),
        packed.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        M,
        N,
        packed.shape[1],
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
