"""Attention of a few bf16 queries over a KV cache on a CPU, with ``F.scaled_dot_product_attention`` as its reference.

A decode step attends one query per head (a verify window a few) over the cached keys. SDPA's CPU kernel spends
about 170 us a call on that at SmolLM2's shapes (9 heads, 3 key/value heads, ~250 keys; 2 cores of an AMD EPYC),
most of it set-up, not arithmetic: 30 calls are ~5 ms of a ~27 ms step. This kernel does each query row's work in
one pass, the rows split over torch's OpenMP threads: the scores ``q . k / sqrt(D)`` with AVX512-BF16's pairwise
dot product (bf16 products summed in fp32), masked keys left out, a softmax in fp32 (its max subtracted; ``exp``
from a Cephes-style polynomial, within a few fp32 steps), the weighted sum of the values in fp32, rounded to bf16.
Each query row's result depends only on that row (not on the rows beside it, the batch or the thread count), so a
verify window's rows give what the same rows give one at a time.

A CPU with AVX2 and FMA but no AVX-512 runs ``SOURCE_AVX2``, the same contract: q widened to fp32 once a row, k and
v 8 lanes at a time, fp32 FMAs (there SDPA's bf16 call is ~155 us, ~4.6 ms of a step on 2 cores of an AMD EPYC
without AVX-512).

``attend`` takes a call only when it can (a CPU with AVX512-BF16, or AVX2 and FMA, and the kernel built, bf16
q/k/v, at most ``MAX_QUERIES`` queries a head, a head size that is a multiple of 32 up to 256, a boolean mask or
none, not ``is_causal`` over several queries, no autograd) and returns None otherwise, so ``attention.attend``
calls SDPA. A query row with no key to attend gives zeros. ``STREAKLINE_CPU_LINEAR=torch`` (a process) and
``cpu_native.use_reference()`` (a block) turn it off with the other kernels.

    out = attend(q, k, v, mask)     # q [B, H, T, D], k/v [B, Hkv, S, D], mask [B, 1, T, S] bool or None; or None
    python -m pytest tests/models/test_cpu_attention.py -q
"""

from __future__ import annotations

import ctypes
import functools
import math

import torch

from . import cpu_native

MAX_QUERIES = 16  # queries a head: a decode step's or a verify window's; a prefill stays on SDPA
MAX_HEAD = 256

SOURCE = r"""
/* after cpu_native.PRELUDE["avx512_bf16"]: to_bf16, from_bf16 */

/* exp(x) for x <= 0: x = n ln2 + r, exp(r) by Cephes' expf polynomial, times 2^n (scalef) */
static inline __m512 exp_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* out[b, h, t] = softmax(q[b, h, t] . k[b, h / G, s] * scale over the keys s the mask allows) . v[b, h / G, s].
   Strides are in elements; each tensor's last axis is contiguous, the mask's key axis too. scratch: rows x S fp32. */
void decode_attention(const uint16_t *q, const uint16_t *k, const uint16_t *v, const uint8_t *mask, uint16_t *out,
                      float *scratch, int64_t B, int64_t H, int64_t Hkv, int64_t T, int64_t S, int64_t D,
                      int64_t qb, int64_t qh, int64_t qt, int64_t kb, int64_t kh, int64_t ks, int64_t vb, int64_t vh,
                      int64_t vs, int64_t mb, int64_t mt, int64_t ob, int64_t oh, int64_t ot, float scale,
                      int threads) {
    const int64_t rows = B * H * T, G = H / Hkv, C = D / 32;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t row = 0; row < rows; row++) {
        const int64_t b = row / (H * T), h = (row / T) % H, t = row % T, g = h / G;
        const uint16_t *qp = q + b * qb + h * qh + t * qt;
        const uint16_t *kp = k + b * kb + g * kh;
        const uint16_t *vp = v + b * vb + g * vh;
        const uint8_t *mp = mask ? mask + b * mb + t * mt : 0;
        uint16_t *op = out + b * ob + h * oh + t * ot;
        float *sc = scratch + row * S;
        __m512i qv[8];
        for (int64_t c = 0; c < C; c++) qv[c] = _mm512_loadu_si512((const void *)(qp + 32 * c));
        float mx = -INFINITY;
        for (int64_t s = 0; s < S; s++) {
            if (mp && !mp[s]) { sc[s] = -INFINITY; continue; }
            __m512 acc = _mm512_setzero_ps();
            for (int64_t c = 0; c < C; c++) {
                const __m512i kv = _mm512_loadu_si512((const void *)(kp + s * ks + 32 * c));
                acc = _mm512_dpbf16_ps(acc, (__m512bh)qv[c], (__m512bh)kv);
            }
            const float d = _mm512_reduce_add_ps(acc) * scale;
            sc[s] = d;
            if (d > mx) mx = d;
        }
        const int64_t V = D / 16;
        if (mx == -INFINITY) {  /* no key to attend: zeros */
            for (int64_t c = 0; c < V; c++) _mm256_storeu_si256((__m256i *)(op + 16 * c), _mm256_setzero_si256());
            continue;
        }
        __m512 total = _mm512_setzero_ps();
        const __m512 top = _mm512_set1_ps(mx);
        for (int64_t s = 0; s < S; s += 16) {
            const __mmask16 lanes = (S - s >= 16) ? (__mmask16)0xffff : (__mmask16)((1u << (S - s)) - 1u);
            const __m512 x = _mm512_maskz_loadu_ps(lanes, sc + s);
            const __mmask16 live = _mm512_mask_cmp_ps_mask(lanes, x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
            const __m512 e = _mm512_maskz_mov_ps(live, exp_ps(_mm512_sub_ps(x, top)));
            _mm512_mask_storeu_ps(sc + s, lanes, e);
            total = _mm512_add_ps(total, e);
        }
        __m512 o[16];
        for (int64_t c = 0; c < V; c++) o[c] = _mm512_setzero_ps();
        for (int64_t s = 0; s < S; s++) {
            const float p = sc[s];
            if (p == 0.0f) continue;
            const __m512 pb = _mm512_set1_ps(p);
            for (int64_t c = 0; c < V; c++) o[c] = _mm512_fmadd_ps(pb, from_bf16(vp + s * vs + 16 * c), o[c]);
        }
        const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total));
        for (int64_t c = 0; c < V; c++)
            _mm256_storeu_si256((__m256i *)(op + 16 * c), to_bf16(_mm512_mul_ps(o[c], inv)));
    }
}
"""


SOURCE_AVX2 = r"""
/* after cpu_native.PRELUDE["avx2"]: round_half, from_bf16 */

/* 8 fp32 -> 8 bf16 in a 128-bit register */
static inline __m128i to_bf16(__m256 v) {
    const __m256i r = round_half(v);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

/* exp(x) for x <= 0: x = n ln2 + r, exp(r) by Cephes' expf polynomial, times 2^n (built in the exponent bits) */
static inline __m256 exp_ps(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The AVX512-BF16 kernel's contract with AVX2 and FMA: q widened to fp32 once a row, k and v 8 lanes at a time. */
void decode_attention(const uint16_t *q, const uint16_t *k, const uint16_t *v, const uint8_t *mask, uint16_t *out,
                      float *scratch, int64_t B, int64_t H, int64_t Hkv, int64_t T, int64_t S, int64_t D,
                      int64_t qb, int64_t qh, int64_t qt, int64_t kb, int64_t kh, int64_t ks, int64_t vb, int64_t vh,
                      int64_t vs, int64_t mb, int64_t mt, int64_t ob, int64_t oh, int64_t ot, float scale,
                      int threads) {
    const int64_t rows = B * H * T, G = H / Hkv, C = D / 8;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t row = 0; row < rows; row++) {
        const int64_t b = row / (H * T), h = (row / T) % H, t = row % T, g = h / G;
        const uint16_t *qp = q + b * qb + h * qh + t * qt;
        const uint16_t *kp = k + b * kb + g * kh;
        const uint16_t *vp = v + b * vb + g * vh;
        const uint8_t *mp = mask ? mask + b * mb + t * mt : 0;
        uint16_t *op = out + b * ob + h * oh + t * ot;
        float *sc = scratch + row * S;
        __m256 qv[32];
        for (int64_t c = 0; c < C; c++) qv[c] = from_bf16(qp + 8 * c);
        float mx = -INFINITY;
        for (int64_t s = 0; s < S; s++) {
            if (mp && !mp[s]) { sc[s] = -INFINITY; continue; }
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
            for (int64_t c = 0; c < C; c += 2) {
                a0 = _mm256_fmadd_ps(qv[c], from_bf16(kp + s * ks + 8 * c), a0);
                a1 = _mm256_fmadd_ps(qv[c + 1], from_bf16(kp + s * ks + 8 * c + 8), a1);
            }
            const float d = hsum(_mm256_add_ps(a0, a1)) * scale;
            sc[s] = d;
            if (d > mx) mx = d;
        }
        if (mx == -INFINITY) {  /* no key to attend: zeros */
            memset(op, 0, (size_t)D * 2);
            continue;
        }
        __m256 total = _mm256_setzero_ps();
        const __m256 top = _mm256_set1_ps(mx);
        int64_t s = 0;
        for (; s + 8 <= S; s += 8) {
            const __m256 x = _mm256_loadu_ps(sc + s);
            const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ);
            const __m256 e = _mm256_and_ps(live, exp_ps(_mm256_sub_ps(x, top)));
            _mm256_storeu_ps(sc + s, e);
            total = _mm256_add_ps(total, e);
        }
        if (s < S) {  /* the tail through a padded copy, so it is summed as a whole register is */
            float tail[8];
            for (int i = 0; i < 8; i++) tail[i] = (s + i < S) ? sc[s + i] : -INFINITY;
            const __m256 x = _mm256_loadu_ps(tail);
            const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ);
            const __m256 e = _mm256_and_ps(live, exp_ps(_mm256_sub_ps(x, top)));
            _mm256_storeu_ps(tail, e);
            for (int i = 0; s + i < S; i++) sc[s + i] = tail[i];
            total = _mm256_add_ps(total, e);
        }
        __m256 o[32];
        for (int64_t c = 0; c < C; c++) o[c] = _mm256_setzero_ps();
        for (int64_t j = 0; j < S; j++) {
            const float p = sc[j];
            if (p == 0.0f) continue;
            const __m256 pb = _mm256_set1_ps(p);
            for (int64_t c = 0; c < C; c++) o[c] = _mm256_fmadd_ps(pb, from_bf16(vp + j * vs + 8 * c), o[c]);
        }
        const __m256 inv = _mm256_set1_ps(1.0f / hsum(total));
        for (int64_t c = 0; c < C; c++) _mm_storeu_si128((__m128i *)(op + 8 * c), to_bf16(_mm256_mul_ps(o[c], inv)));
    }
}
"""

KERNELS = {"avx512_bf16": SOURCE, "avx2": SOURCE_AVX2}  # by instruction set, best first


@functools.cache
def _library() -> ctypes.CDLL | None:
    chosen = cpu_native.best("decode_attention", KERNELS)
    if chosen is None:
        return None
    lib = chosen[1]
    lib.decode_attention.restype = None
    lib.decode_attention.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 20 + [ctypes.c_float, ctypes.c_int]
    return lib


def available() -> bool:
    """Whether ``attend`` can run the kernel here (this CPU, this toolchain, not turned off)."""
    return cpu_native.enabled() and _library() is not None


def _takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool) -> bool:
    if cpu_native.referenced() or q.device.type != "cpu" or not (q.dtype == k.dtype == v.dtype == torch.bfloat16):
        return False
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return False
    B, H, T, D = q.shape
    if T > MAX_QUERIES or (is_causal and T > 1) or D % 32 or D > MAX_HEAD or k.shape[1] == 0 or H % k.shape[1]:
        return False
    if k.shape[0] != B or v.shape[:3] != k.shape[:3] or k.shape[-1] != D or v.shape[-1] != D:
        return False
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        return False
    if mask is not None and (mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1):
        return False
    return available()


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool = False
) -> torch.Tensor | None:
    """SDPA of ``q`` over ``k, v`` (default scale) on the kernel, or None where it does not take the call (module
    docstring). mask: boolean ``[B | 1, 1, T | 1, S]``, True = may attend."""
    if not _takes(q, k, v, mask, is_causal):
        return None
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    m = None
    if mask is not None:
        m = mask.expand(B, 1, T, S)
        if m.stride(-1) != 1:
            m = m.contiguous()
    out = torch.empty(B, T, H, D, dtype=torch.bfloat16).transpose(1, 2)  # [B, H, T, D] over the caller's layout
    scratch = torch.empty(B * H * T * max(S, 1), dtype=torch.float32)
    _library().decode_attention(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), None if m is None else m.data_ptr(), out.data_ptr(),
        scratch.data_ptr(), B, H, Hkv, T, S, D,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        0 if m is None else m.stride(0), 0 if m is None else m.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        1.0 / math.sqrt(D), torch.get_num_threads(),
    )  # fmt: skip
    return out
