"""Wall-clock timing shared by the benchmark scripts (a helper module, not a benchmark: ``make bench`` skips it).

result, seconds = timed(lambda: model(x), device="cuda")   # synchronises a GPU before and after
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


def sync(device: str) -> None:
    """Wait for queued GPU work, so a timer around it measures the work and not its launch."""
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: str) -> tuple[Any, float]:
    """``(fn(), seconds it took)``, synchronised on a GPU."""
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0
