"""When a distill run has seen enough: a cap in epochs and a stop on a held-out plateau (docs/alignment.md).

A data-scaling point has to measure what that much data buys, not how many steps fit in a budget. So a run can
(``trainer`` settings):

- read only part of its trajectories (``train_tokens``): the set's first rows whose completions hold that many
  tokens; a larger value's rows hold every row of a smaller one (nested subsets, ``nested_rows``);
- stop after ``max_epochs`` passes over its examples (``max_steps`` stays the cap above it, and sets the schedule);
- stop when the held-out check has not improved for ``patience`` checks in a row spanning a whole pass (and never
  before the end of the warmup). The value watched is the mean over
  the held-out sources of ``eval/<source>/<stop_metric>``; the run's ``drafter/`` is then the export of the best
  check, which is saved when it happens.

    rows, tokens = nested_rows(completion_lengths, 30_000)        # the rows of a 30k-token subset
    steps = epoch_steps(max_steps=2000, max_epochs=3, examples=len(windows), per_step=batch * accum * ranks)
    stop = Plateau(patience=3, metric="sim_streak")
    verdict = stop.update(step, result)                           # "best", "wait" or "stop"
    budget = Deadline(minutes=9.0); budget.passed()               # True once 9 minutes have gone since it was made

Tests: ``python -m pytest tests/alignment/test_stopping.py``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np


def nested_rows(completion_lengths: np.ndarray, tokens: int) -> tuple[np.ndarray, int]:
    """``(rows, tokens held)``: the rows of a trajectory set that a run with ``trainer.train_tokens=tokens`` reads:
    its first rows whose completion lengths sum to at least ``tokens``. A larger size's rows hold every row of a
    smaller one, and since a set lists its prompt sources interleaved (``data/mix.py``), every size mixes them as the
    whole set does and is the same rows in any set that holds it: a set of fewer prompts is the first rows of a
    larger one. Every row when the whole set holds fewer tokens; the caller says so."""
    if tokens < 1:
        raise ValueError(f"trainer.train_tokens={tokens} must be at least 1")
    total = np.cumsum(np.asarray(completion_lengths, dtype=np.int64))
    n = min(int(np.searchsorted(total, tokens)) + 1, len(total))  # the first count at which the sum reaches tokens
    return np.arange(n), int(total[n - 1]) if n else 0


def step_examples(trainer, world_size: int) -> int:
    """Examples one optimizer step reads: ``micro_batch_size x grad_accum`` on each of ``world_size`` ranks."""
    return trainer.micro_batch_size * trainer.grad_accum * world_size


def pass_steps(examples: int, per_step: int) -> int:
    """Optimizer steps in one pass over ``examples`` at ``per_step`` a step (the last one partial)."""
    return -(-examples // per_step)


def epoch_steps(*, max_steps: int, max_epochs: float | None, examples: int, per_step: int) -> int:
    """Optimizer steps for ``max_epochs`` passes over ``examples`` at ``per_step`` examples a step (at least one),
    capped at ``max_steps``; ``max_steps`` itself without an epoch cap."""
    if max_epochs is None:
        return max_steps
    return max(1, min(max_steps, math.ceil(max_epochs * examples / per_step)))


def heldout_value(result: dict[str, Any], metric: str) -> float | None:
    """The mean over held-out sources of ``eval/<source>/<metric>`` in a check's result (None without any)."""
    values = [float(v) for k, v in result.items() if k.startswith("eval/") and k.endswith(f"/{metric}")
              and isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)]  # fmt: skip
    return sum(values) / len(values) if values else None


class Plateau:
    """Counts held-out checks since the best one. ``update`` says ``best`` (a new best: keep this step's weights),
    ``wait`` or ``stop``: ``patience`` checks in a row without a new best, spanning at least ``min_gap`` steps since
    the best (the trainer's one pass over the data), and not before step ``min_steps`` (the end of the warmup). So a
    run stops when a whole pass brings nothing new, whatever its size: a small set's checks come every few steps, and
    three of them in a row are noise, not a plateau (at 3k tokens a check comes every 6 steps). A check without the
    metric is a ``wait`` that does not count. Its state goes into checkpoints, so a resumed run keeps counting."""

    def __init__(self, patience: int, metric: str, min_steps: int = 0, min_gap: int = 0) -> None:
        if patience < 1:
            raise ValueError(f"trainer.patience={patience} must be at least 1 (null: no early stop)")
        self.patience, self.metric, self.min_steps, self.min_gap = patience, metric, min_steps, min_gap
        self.best: float | None = None
        self.best_step: int | None = None
        self.since = 0

    def update(self, step: int, result: dict[str, Any]) -> str:
        value = heldout_value(result, self.metric)
        if value is None:
            return "wait"
        if self.best is None or value > self.best:
            self.best, self.best_step, self.since = value, step, 0
            return "best"
        self.since += 1
        stalled = self.since >= self.patience and step - self.best_step >= self.min_gap
        return "stop" if stalled and step >= self.min_steps else "wait"

    def state(self) -> dict[str, Any]:
        return {"best": self.best, "best_step": self.best_step, "since": self.since}

    def load(self, state: dict[str, Any] | None) -> None:
        if state:
            self.best, self.best_step, self.since = state["best"], state["best_step"], state["since"]


class Deadline:
    """``trainer.max_minutes``: a wall-clock budget that starts when it is made (None: no budget). ``passed`` reads
    the clock; the trainer asks at its logging steps and takes the main rank's answer, so every rank stops at the
    same step."""

    def __init__(self, minutes: float | None, clock: Callable[[], float] = time.monotonic) -> None:
        if minutes is not None and not minutes > 0:
            raise ValueError(f"trainer.max_minutes={minutes} must be above 0 (null: no time budget)")
        self.seconds = None if minutes is None else 60.0 * float(minutes)
        self.clock = clock
        self.start = clock()

    def passed(self) -> bool:
        return self.seconds is not None and self.clock() - self.start >= self.seconds

    def elapsed_minutes(self) -> float:
        return (self.clock() - self.start) / 60.0
