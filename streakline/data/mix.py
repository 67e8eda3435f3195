"""The order of a weighted prompt mix: which source each prompt slot of a trajectory set draws from, such that every
prefix of the set is itself the mix at a smaller size (docs/data.md, "Prompt mix").

    counts = mix_counts([0.3, 0.1, 0.6], 1000)        # prompts per source at data.max_prompts=1000: [300, 100, 600]
    rows = interleave([math, chat, code], weights)     # every record, in the set's order

One fixed sequence of slots serves every size: the j-th prompt of source i (counting from 0) has the rank
``(j + 1/2) / w_i``, and the slots follow the ranks (ties to the earlier source). The first ``n`` slots are Webster's
apportionment of ``n`` seats by the weights, which is house-monotone: a source's count never falls as ``n`` grows.
So the set of ``max_prompts=n`` is the first rows of the set of any larger ``max_prompts`` (each source read from
its start, every row sampled with its own seed), and any prefix of a set mixes the sources by their weights, to
within a prompt each. That is what lets a data-scaling study build only the rows its largest size reads, and take
each size's subset as a prefix (``alignment/stopping.nested_rows``).

Tests: ``python -m pytest tests/data/test_mix.py``.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def rank(j: int, weight: float) -> float:
    """Where the ``j``-th prompt of a source of this weight falls in the mix; a source of weight 0 comes after all
    others (it is in a set only when every prompt of every source is, ``data.max_prompts=null``)."""
    return (j + 0.5) / weight if weight > 0 else math.inf


def mix_counts(weights: Sequence[float], total: int) -> list[int]:
    """Prompts per source in the first ``total`` slots of the mix (sources of weight 0 get none)."""
    counts = [0] * len(weights)
    heap = [(rank(0, w), i) for i, w in enumerate(weights) if w > 0]
    heapq.heapify(heap)
    for _ in range(total if heap else 0):
        _, i = heapq.heappop(heap)
        counts[i] += 1
        heapq.heappush(heap, (rank(counts[i], weights[i]), i))
    return counts


def interleave(lists: Sequence[Sequence[T]], weights: Sequence[float]) -> list[T]:
    """Every item of ``lists`` (one list per source, each in its own order) in the mix's slot order: the records of
    ``mix_counts(weights, n)`` for each source, interleaved, are the first rows of the same records for any larger
    ``n``, whatever a source that ran dry left out."""
    pairs = zip(lists, weights, strict=True)
    slots = [(rank(j, w), i, j) for i, (items, w) in enumerate(pairs) for j in range(len(items))]
    return [lists[i][j] for _, i, j in sorted(slots)]
