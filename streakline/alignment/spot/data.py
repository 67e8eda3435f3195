"""SPOT training examples from draft-free block traces, as tensors, and the deterministic split by prompt.

    from streakline.alignment.spot.data import build_examples, split_by_prompt
    data = build_examples(traces, horizon=8)              # traces from alignment.block_traces.collect_traces
    train, heldout = split_by_prompt(data, heldout_fraction=0.2, seed=0)

The pairing is the one the SPOT drafter sees at inference (``decode_blocks(..., drafter=...)``): the drafter is
called with the stale distribution of the last real forward, computed on state S_t, and the root S_{t+1}; the
verification forward computes the root's logits itself, so the tree's first level must predict step t+1's commit.
With a trace's states S_0..S_n and steps 0..n-1 (step t's top-k computed on S_t, its commit turning S_t into
S_{t+1}), every step t with t + 1 < n and depth d in 0..H-1 with t + 1 + d <= n - 1 gives one example:

* stale = step t's top-k probabilities (``[L, k]``, rank order);
* real-committed = positions not masked in S_{t+1} (step t+1's ``masked`` complement);
* path = positions committed by steps t+1 .. t+d (the true commits replayed on top of the root);
* label = the position step t+1+d committed; when a step committed several (``rule=threshold`` traces) the
  label is the most confident of them (highest rule confidence, ties to the lowest position), and the path of
  deeper examples holds all of them;
* eligible = masked in S_{t+1} and not on the path (the label always is).

The stale top-k is stored once per step and indexed by the examples (``step``), so H examples share it.
Tests: ``python -m pytest tests/alignment/test_spot.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch

from streakline.alignment.block_traces import BlockTrace


@dataclass
class SpotExamples:
    """Examples as tensors. ``N`` examples, ``S`` distinct stale steps, block size ``L``, top-k ``k``."""

    topk_probs: torch.Tensor  # [S, L, k] float32, stale probabilities in rank order
    step: torch.Tensor  # [N] long, index into topk_probs
    real: torch.Tensor  # [N, L] bool, committed in the root S_{t+1}
    path: torch.Tensor  # [N, L] bool, committed along the replayed path
    depth: torch.Tensor  # [N] long, d = number of path commits
    label: torch.Tensor  # [N] long, the position committed next
    prompt: torch.Tensor  # [N] long, the trace's prompt index (the split key)

    def __len__(self) -> int:
        return int(self.step.shape[0])

    @property
    def eligible(self) -> torch.Tensor:
        """``[N, L]`` bool: masked in the root and not on the path."""
        return ~(self.real | self.path)

    def subset(self, index: torch.Tensor) -> SpotExamples:
        """The examples at ``index`` (long or bool ``[N]``); the stale table is shared, not copied."""
        per_example = {f.name: getattr(self, f.name)[index] for f in fields(self) if f.name != "topk_probs"}
        return SpotExamples(topk_probs=self.topk_probs, **per_example)

    def stale(self, index: torch.Tensor | None = None) -> torch.Tensor:
        """``[n, L, k]`` stale probabilities of the examples at ``index`` (all when None)."""
        return self.topk_probs[self.step if index is None else self.step[index]]


def _trace_examples(trace: BlockTrace, horizon: int) -> dict[str, np.ndarray] | None:
    """The examples of one trace as arrays (``step`` relative to the trace's first step), or None if it has none."""
    n = len(trace.steps)
    if n < 2:
        return None
    commit = np.stack([s.commit for s in trace.steps])  # [n, L]
    masked = np.stack([s.masked for s in trace.steps])  # [n, L], masked before each step
    conf = np.stack([s.confidence for s in trace.steps]).astype(np.float64)
    # prefix[j] = positions committed by steps 0..j-1, so steps a..b-1 committed prefix[b] & ~prefix[a].
    prefix = np.concatenate([np.zeros_like(commit[:1]), np.cumsum(commit, axis=0) > 0])
    label_of_step = np.where(commit, conf, -np.inf).argmax(axis=1)  # most confident commit, ties to lowest
    t, d = np.meshgrid(np.arange(n - 1), np.arange(horizon), indexing="ij")
    keep = t + 1 + d <= n - 1
    t, d = t[keep], d[keep]
    root = t + 1
    path = prefix[root + d] & ~prefix[root]
    return {
        "step": t,
        "real": ~masked[root],
        "path": path,
        "depth": d,
        "label": label_of_step[root + d],
    }


def build_examples(traces: Sequence[BlockTrace], horizon: int = 8) -> SpotExamples:
    """Every (step, depth) example of ``traces`` (see the module docstring), in trace, step, depth order."""
    if horizon < 1:
        raise ValueError(f"horizon must be >= 1, got {horizon}")
    if not traces:
        raise ValueError("no traces to build SPOT examples from")
    L, k = traces[0].steps[0].topk_probs.shape
    stale, parts, offset = [], [], 0
    for trace in traces:
        probs = np.stack([s.topk_probs for s in trace.steps]).astype(np.float32)
        if probs.shape[1:] != (L, k):
            raise ValueError(f"trace of prompt {trace.prompt} has top-k shape {probs.shape[1:]}, expected {(L, k)}")
        ex = _trace_examples(trace, horizon)
        stale.append(probs)
        if ex is not None:
            ex["step"] = ex["step"] + offset
            ex["prompt"] = np.full(len(ex["step"]), trace.prompt)
            parts.append(ex)
        offset += len(trace.steps)
    if not parts:
        raise ValueError("the traces have no block with two or more steps, so no SPOT example")
    cat = {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
    return SpotExamples(
        topk_probs=torch.from_numpy(np.concatenate(stale)),
        step=torch.from_numpy(cat["step"]).long(),
        real=torch.from_numpy(cat["real"]).bool(),
        path=torch.from_numpy(cat["path"]).bool(),
        depth=torch.from_numpy(cat["depth"]).long(),
        label=torch.from_numpy(cat["label"]).long(),
        prompt=torch.from_numpy(cat["prompt"]).long(),
    )


def heldout_prompts(prompts: Sequence[int], heldout_fraction: float, seed: int) -> set[int]:
    """The held-out prompt indices: a seeded permutation of the distinct prompts, its first
    ``round(fraction * n)`` (at least one, and at least one left for training when there are two or more)."""
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    unique = sorted(set(int(p) for p in prompts))
    if len(unique) < 2:
        raise ValueError(f"a split by prompt needs at least 2 prompts with examples, got {len(unique)}")
    n = min(max(1, round(heldout_fraction * len(unique))), len(unique) - 1)
    order = np.random.default_rng(seed).permutation(len(unique))
    return {unique[i] for i in order[:n]}


def split_by_prompt(data: SpotExamples, heldout_fraction: float, seed: int) -> tuple[SpotExamples, SpotExamples]:
    """(train, held-out): every example of a prompt lands on the same side; deterministic for a seed."""
    held = heldout_prompts(data.prompt.tolist(), heldout_fraction, seed)
    is_held = torch.tensor([int(p) in held for p in data.prompt.tolist()], dtype=torch.bool)
    return data.subset(~is_held), data.subset(is_held)


def confidence_baseline(data: SpotExamples) -> torch.Tensor:
    """``[N]`` the stale-confidence ranking's prediction: the eligible position with the highest rank-0 stale
    probability (ties to the lowest position)."""
    top = data.stale()[..., 0].masked_fill(~data.eligible, float("-inf"))
    return top.argmax(dim=1)
