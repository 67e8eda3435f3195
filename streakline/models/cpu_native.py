"""Building and loading the project's small C kernels for CPU decoding (``cpu_linear.py``, ``cpu_attention.py``,
``cpu_ops.py``).

Each kernel's C source lives in its module, beside the torch reference it replaces. ``library`` compiles a source
once per machine with the system's ``gcc`` into ``~/.cache/streakline/kernels`` (``STREAKLINE_CACHE`` moves it),
named by the source's hash so an edited kernel is built afresh, and loads it with ctypes; torch's own libgomp serves
its OpenMP threads. Where the CPU lacks the instructions a kernel needs, or the build fails (no compiler), it
returns None, with one warning for the second, and the caller keeps torch's op. ``STREAKLINE_CPU_LINEAR=torch``
(the name it was given first) turns every kernel off for a process.

    lib = library("packed_bf16", SOURCE, needs={"avx512_bf16", "avx512bw", "avx512vl"})   # a CDLL, or None
    lib = library("packed_bf16_avx2", SOURCE_AVX2, needs={"avx2", "fma"}, isa=AVX2)        # a kernel's AVX2 source
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

from .precision import cpu_flags

ENV = "STREAKLINE_CPU_LINEAR"  # "auto" (default) | "torch": torch's ops everywhere
COMMON = ("-O3", "-fopenmp", "-shared", "-fPIC")
AVX512_BF16 = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16")  # the flags of a kernel's instruction set
AVX2 = ("-mavx2", "-mfma")


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
