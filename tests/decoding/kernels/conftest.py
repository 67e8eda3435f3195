"""Kernel tests run the Triton code on CPU through Triton's interpreter when there is no GPU.

``triton.jit`` reads ``TRITON_INTERPRET`` when a kernel is decorated; ``streakline.decoding.kernels`` decorates on
first use, so setting it here (at collection, before any kernel runs) is early enough even when other test modules
imported ``streakline.decoding`` (or triton itself) first. An explicit ``TRITON_INTERPRET`` in the environment wins.
"""

import os

import pytest
import torch

from streakline.decoding.kernels import available, interpreting

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def triton_skip_reason() -> str | None:
    if not available():
        return "triton is not installed (it only exists for Linux x86-64)"
    if DEVICE == "cpu" and not interpreting():
        return "no GPU and TRITON_INTERPRET is not 1, so Triton cannot run here"
    return None


@pytest.fixture
def triton_backend() -> str:
    """``"triton"``, or skip the test with the reason Triton cannot run here."""
    reason = triton_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    return "triton"
