"""Fused kernels of the speculative decoder, each with a Triton implementation and a plain-torch reference.

The reference is the specification; the Triton path must agree with it (tests/decoding/kernels). This module is
the switch between the two:

    backend_for(t)                    # "triton" for CUDA tensors when triton is installed, else "torch"
    STREAKLINE_KERNELS=torch ...      # force one side for a whole process ("auto" | "torch" | "triton")
    with use_backend("torch"): ...    # force one side for a block (tests, benchmarks)
    verify_chains(..., backend="triton")   # force one side for one call

Triton is imported lazily, and the ``@triton.jit`` functions are built on first use, because ``triton.jit`` picks
the CPU interpreter or the compiler from ``TRITON_INTERPRET`` at decoration time: a test's conftest can set
``TRITON_INTERPRET=1`` after ``streakline.decoding`` was imported and still get interpreted kernels on CPU.

    TRITON_INTERPRET=1 STREAKLINE_KERNELS=triton python -m pytest tests/decoding/kernels -q
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from collections.abc import Iterator

import torch

BACKENDS = ("auto", "torch", "triton")

_override: contextvars.ContextVar[str | None] = contextvars.ContextVar("streakline_kernels_override", default=None)


@functools.cache
def available() -> bool:
    """Whether triton can be imported here (it is only installed on Linux x86-64)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for the CPU interpreter (read when the kernels are built)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def _check(name: str, where: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r} from {where}; valid: {', '.join(BACKENDS)}")
    return name


def backend_for(t: torch.Tensor, backend: str | None = None) -> str:
    """``"torch"`` or ``"triton"``: which implementation runs on tensor ``t`` (any shape; only its device counts).

    Precedence: the ``backend`` argument, then ``use_backend(...)``, then ``$STREAKLINE_KERNELS``, then "auto".
    "auto" means Triton for CUDA tensors when triton is importable, torch otherwise. Forcing "triton" raises a
    RuntimeError naming the fix when triton is missing, or when ``t`` is on the CPU without ``TRITON_INTERPRET=1``.
    """
    if backend is not None:
        name = _check(backend, "the backend argument")
    elif _override.get() is not None:
        name = _override.get()
    else:
        name = _check(os.environ.get("STREAKLINE_KERNELS", "auto").strip().lower() or "auto", "$STREAKLINE_KERNELS")
    if name == "auto":
        return "triton" if t.is_cuda and available() else "torch"
    if name == "triton":
        if not available():
            raise RuntimeError(
                "the Triton kernel backend was forced but triton is not importable; install it "
                "(`pip install triton`, Linux x86-64 only) or use backend='torch' / STREAKLINE_KERNELS=torch"
            )
        if not t.is_cuda and not interpreting():
            raise RuntimeError(
                f"the Triton kernel backend was forced for a tensor on {t.device}; Triton runs CPU tensors only "
                "under its interpreter: set TRITON_INTERPRET=1 in the environment before triton is imported, "
                "or use backend='torch' / STREAKLINE_KERNELS=torch"
            )
    return name


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Force ``name`` ("auto" | "torch" | "triton") for every kernel call without an explicit backend inside."""
    token = _override.set(_check(name, "use_backend"))
    try:
        yield
    finally:
        _override.reset(token)


# Imported last: verify/compact call backend_for at run time only, so the cycle is harmless.
from streakline.decoding.kernels.compact import compact_kv  # noqa: E402
from streakline.decoding.kernels.verify import VerifyOut, verify_chains  # noqa: E402

__all__ = [
    "BACKENDS",
    "VerifyOut",
    "available",
    "backend_for",
    "compact_kv",
    "interpreting",
    "use_backend",
    "verify_chains",
]
