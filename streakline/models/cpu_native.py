"""Building and loading the project's small C kernels for CPU decoding (``cpu_linear.py``, ``cpu_attention.py``,
``cpu_ops.py``).

Each kernel's C source lives in its module, beside the torch reference it replaces; what the kernels of one
instruction set share (the includes, bf16 <-> fp32 in registers) is ``PRELUDE``, which ``best`` puts before each.
``library`` compiles a source once per machine with the system's ``gcc`` into ``~/.cache/streakline/kernels``
(``STREAKLINE_CACHE`` moves it), named by the source's hash so an edited kernel is built afresh, and loads it with
ctypes; torch's own libgomp serves its OpenMP threads. Where the CPU lacks the instructions a kernel needs, or the
build fails (no compiler), it returns None, with one warning for the second, and the caller keeps torch's op.
``STREAKLINE_CPU_LINEAR=torch`` (the name it was given first) turns every kernel off for a process.

    lib = library("packed_bf16", SOURCE, needs={"avx512_bf16", "avx512bw", "avx512vl"})   # a CDLL, or None
    isa, lib = best("packed_bf16", {"avx512_bf16": SOURCE, "avx2": SOURCE_AVX2})         # the best this CPU runs
    with use_reference(): ...                                                               # torch's ops there
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import hashlib
import os
import subprocess
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

from .precision import AVX2_FLAGS, cpu_flags

ENV = "STREAKLINE_CPU_LINEAR"  # "auto" (default) | "torch": torch's ops everywhere
COMMON = ("-O3", "-fopenmp", "-shared", "-fPIC")
AVX512_BF16 = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16")  # the flags of a kernel's instruction set
AVX2 = ("-mavx2", "-mfma")


# C helpers the kernels of one instruction set share, prepended to their sources by ``best``: the includes, and bf16
# <-> fp32 in registers (round to nearest, ties to even, NaNs kept quiet, as torch rounds; widening is exact)
PRELUDE = {
    "avx512_bf16": r"""
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* 16 fp32 -> 16 bf16 */
static inline __m256i to_bf16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(r);
}

/* 16 bf16 -> 16 fp32 */
static inline __m512 from_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
""",
    "avx2": r"""
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* 8 fp32 -> 8 bf16, each in the low half of its 32-bit lane */
static inline __m256i round_half(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
    const __m256i q = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    return _mm256_blendv_epi8(r, q, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}

/* 8 bf16 -> 8 fp32 */
static inline __m256 from_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
""",
}
ISA_FLAGS = {"avx512_bf16": AVX512_BF16, "avx2": AVX2}  # the compiler's flags of each
NEEDS = {"avx512_bf16": {"avx512_bf16", "avx512bw", "avx512vl"}, "avx2": set(AVX2_FLAGS)}  # the CPU's flags


_reference: contextvars.ContextVar[bool] = contextvars.ContextVar("streakline_cpu_reference", default=False)


@contextlib.contextmanager
def use_reference() -> Iterator[None]:
    """torch's own ops inside the block (``F.linear``, SDPA), whatever kernel the machine could run (tests,
    benchmarks)."""
    token = _reference.set(True)
    try:
        yield
    finally:
        _reference.reset(token)


def referenced() -> bool:
    """Whether a ``use_reference`` block is open here."""
    return _reference.get()


def enabled() -> bool:
    """Whether the kernels may run in this process (``STREAKLINE_CPU_LINEAR`` is not ``torch``)."""
    return os.environ.get(ENV, "auto") != "torch"


def cache_dir() -> Path:
    root = os.environ.get("STREAKLINE_CACHE") or Path.home() / ".cache" / "streakline"
    return Path(root) / "kernels"


def library(name: str, source: str, needs: set[str], isa: tuple[str, ...] = AVX512_BF16) -> ctypes.CDLL | None:
    """The compiled ``source`` (built on first use with ``isa``'s flags, reused after), or None where this CPU
    lacks a flag of ``needs`` or the build fails (with a warning saying why). Callers cache the result."""
    if not needs <= cpu_flags():
        return None
    flags = (*COMMON, *isa)
    digest = hashlib.sha256((source + " ".join(flags)).encode()).hexdigest()[:12]
    target = cache_dir() / f"{name}-{digest}.so"
    if not target.exists():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                src, out = Path(tmp) / f"{name}.c", Path(tmp) / f"{name}.so"
                src.write_text(source)
                cmd = ["gcc", *flags, str(src), "-o", str(out)]
                subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
                os.replace(out, target)  # whole or absent: a second process may build the same file
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", None) or e
            warnings.warn(f"the CPU kernel {name} did not build ({detail}); torch's op runs instead", stacklevel=3)
            return None
    return ctypes.CDLL(str(target))


def best(name: str, sources: dict[str, str]) -> tuple[str, ctypes.CDLL] | None:
    """The first of ``sources`` (instruction set -> C source, best first) this CPU and toolchain run, built with its
    set's prelude and flags (as ``name_<set>``), as ``(instruction set, library)``; None where none does."""
    for isa, source in sources.items():
        lib = library(f"{name}_{isa}", PRELUDE[isa] + source, NEEDS[isa], ISA_FLAGS[isa])
        if lib is not None:
            return isa, lib
    return None
