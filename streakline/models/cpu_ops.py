"""RMSNorm and rotary embedding of a bf16 decode step on a CPU, in C, with ``transformer.RMSNorm`` and
``transformer.apply_rotary`` as their references.

A SmolLM2 decode step calls RMSNorm 61 times and rotary 60 times on one row each. In torch those are 8 and 7 small
ops a call (a widening, ``pow``, ``mean``, ``rsqrt``, two products, two roundings; two slices, a negation, a ``cat``,
two products and a sum), 69 us and 43 us a call on 2 cores of an AMD EPYC without AVX-512: ~7 ms of a ~36 ms step,
all of it per-op overhead. Here each is one call. Both round where torch rounds: rotary gives torch's bf16 result bit
for bit (its products of two bf16 values are exact in fp32, each rounded to bf16, their sum rounded again); RMSNorm
sums the squares in fp32 in another order than torch (eight lanes, then pairwise), so a result may differ from
torch's by a rounding at a near-tie, never by more. Each row's result depends on that row alone, so a verify
window's rows give what the rows give one at a time.

``rms_norm`` and ``rotary`` return None where they do not take the call (not bf16, not a CPU, autograd, a layout
they do not read, a CPU without AVX2 and FMA, the kernels turned off), and the caller runs torch's ops.
``STREAKLINE_CPU_LINEAR=torch`` (a process) and ``cpu_native.use_reference()`` (a block) turn them off with the
other kernels.

    y = rms_norm(x, weight, eps)      # x [..., dim] contiguous bf16, weight [dim] bf16; or None
    y = rotary(x, cos, sin)           # x [B, H, T, D] bf16 (last axis contiguous), cos/sin [B | 1, 1, T, D]; or None
    python -m pytest tests/models/test_cpu_ops.py -q
"""

from __future__ import annotations

import ctypes
import functools

import torch

from . import cpu_native

SOURCE = r"""
/* after cpu_native.PRELUDE["avx2"] (its includes; these are scalar loops that gcc vectorises) */

static inline float widen(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* fp32 -> bf16, round to nearest, ties to even, NaNs kept quiet (as torch rounds) */
static inline uint16_t narrow(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* y[r] = bf16(w * bf16(x[r] / sqrt(mean(x[r]^2) + eps))) for each of the rows (contiguous, dim each): RMSNorm as
   transformer.RMSNorm computes it in bf16 (normalised in fp32, rounded, then the weight), the sum of squares in one
   fixed order a row, so a row's result is its own whatever rows are beside it. */
void rms_norm(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t rows, int64_t dim, float eps, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (rows > 8)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * dim;
        uint16_t *yr = y + r * dim;
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        int64_t i = 0;
        for (; i + 8 <= dim; i += 8)
            for (int j = 0; j < 8; j++) { const float v = widen(xr[i + j]); acc[j] += v * v; }
        for (int j = 0; i + j < dim; j++) { const float v = widen(xr[i + j]); acc[j] += v * v; }
        const float total = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
        const float scale = 1.0f / sqrtf(total / (float)dim + eps);
        for (int64_t k = 0; k < dim; k++) yr[k] = narrow(widen(w[k]) * widen(narrow(widen(xr[k]) * scale)));
    }
}

/* out = bf16(bf16(x * cos) + bf16(rotate(x) * sin)), rotate(x) = [-x[D/2:], x[:D/2]]: transformer.apply_rotary in
   bf16, rounding where torch rounds, so bit for bit what it gives. x, out: [B, H, T, D] with strides (the last
   contiguous); cos, sin: [B | 1, 1, T, D] with strides. */
void rotary(const uint16_t *x, const uint16_t *c, const uint16_t *s, uint16_t *out, int64_t B, int64_t H, int64_t T,
            int64_t D, int64_t xb, int64_t xh, int64_t xt, int64_t cb, int64_t ct, int64_t ob, int64_t oh, int64_t ot,
            int threads) {
    const int64_t half = D / 2, rows = B * H * T;
    #pragma omp parallel for schedule(static) num_threads(threads) if (rows > 64)
    for (int64_t row = 0; row < rows; row++) {
        const int64_t b = row / (H * T), h = (row / T) % H, t = row % T;
        const uint16_t *xr = x + b * xb + h * xh + t * xt;
        const uint16_t *cr = c + b * cb + t * ct, *sr = s + b * cb + t * ct;
        uint16_t *orow = out + b * ob + h * oh + t * ot;
        for (int64_t k = 0; k < D; k++) {
            const float rot = k < half ? -widen(xr[k + half]) : widen(xr[k - half]);
            const float a = widen(narrow(widen(xr[k]) * widen(cr[k])));
            const float bsin = widen(narrow(rot * widen(sr[k])));
            orow[k] = narrow(a + bsin);
        }
    }
}
"""


@functools.cache
def _library() -> ctypes.CDLL | None:
    chosen = cpu_native.best("row_ops", {"avx2": SOURCE})
    if chosen is None:
        return None
    lib = chosen[1]
    lib.rms_norm.restype = lib.rotary.restype = None
    lib.rms_norm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_float, ctypes.c_int]
    lib.rotary.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 12 + [ctypes.c_int]
    return lib


def available() -> bool:
    """Whether the kernels can run here (this CPU, this toolchain, not turned off)."""
    return cpu_native.enabled() and _library() is not None


def _bf16_cpu(*tensors: torch.Tensor) -> bool:
    if cpu_native.referenced() or not all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in tensors):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """``transformer.RMSNorm``'s bf16 forward over ``x``'s last axis on the kernel, or None where it does not take
    the call (module docstring)."""
    dim = x.shape[-1]
    if not _bf16_cpu(x, weight) or not x.is_contiguous() or weight.shape != (dim,) or not weight.is_contiguous():
        return None
    if not available():
        return None
    out = torch.empty_like(x)
    _library().rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // max(dim, 1), dim, eps,
                        torch.get_num_threads())  # fmt: skip
    return out


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """``transformer.apply_rotary(x, cos, sin)`` in bf16 on the kernel, bit for bit, or None where it does not take
    the call. x: ``[B, H, T, D]`` (any strides but a contiguous last axis); cos, sin: ``[B | 1, 1, T, D]`` alike."""
    if x.dim() != 4 or cos.dim() != 4 or not _bf16_cpu(x, cos, sin) or cos.stride() != sin.stride():
        return None
    B, H, T, D = x.shape
    if D % 2 or cos.shape[1] != 1 or cos.shape[2:] != (T, D) or cos.shape[0] not in (1, B) or sin.shape != cos.shape:
        return None
    if x.stride(-1) != 1 or cos.stride(-1) != 1 or not available():
        return None
    out = torch.empty_like(x)  # x's layout (a transposed [B, T, H, D] stays so)
    if out.stride(-1) != 1:
        out = torch.empty(B, H, T, D, dtype=x.dtype)
    _library().rotary(
        x.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), B, H, T, D,
        x.stride(0), x.stride(1), x.stride(2), cos.stride(0) if cos.shape[0] > 1 else 0, cos.stride(2),
        out.stride(0), out.stride(1), out.stride(2), torch.get_num_threads(),
    )  # fmt: skip
    return out
