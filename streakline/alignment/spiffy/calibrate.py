"""Calibrate a Spiffy draft graph from draft-free block traces (docs/algorithms.md section 9; docs/spiffy.md).

For every trace step t whose result S_{t+1} still has masked positions (t + 1 < n), step t's top-k (computed on S_t)
is the stale distribution and S_{t+1} the root. Each realised future state S_{t+1+h}, h = 1..H, is written as the set
of (i, j) pairs of the positions committed since the root: i = rank of the position among the root's masked ones by
stale confidence (``topk_probs[:, 0]`` descending, ties to the lower position), j = rank of its token in the stale
top-k. A token outside the top-k makes that state, and every later one of the path, unrepresentable: the path stops.
Consecutive states of a path (the root first) are the observed edges.

The graph is the connected set Q of ``budget`` states (plus the root) that greedy frontier growth finds for
``sum_{q in Q} [count(q) + sum_{parent p of q in Q} count(p)]``. The root's count is taken as 0: it is in every graph,
so counting it would only push depth-1 states ahead of deeper chains. Ties: larger count, then smaller state, then
the sorted pairs. Deterministic for a given trace list.

    graph, stats = calibrate(traces, horizon=8, budget=10, header={"target": "tiny-target", "rule": "static", ...})

Tests: ``python -m pytest tests/alignment/test_spiffy.py``.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from streakline.alignment.block_traces import BlockTrace
from streakline.decoding.spiffy import Node, SpiffyGraph

ROOT: Node = frozenset()


def root_ranks(confidence: np.ndarray, masked: np.ndarray) -> dict[int, int]:
    """Position -> i for the root's masked positions: ``confidence`` ``[L]`` (stale rank-0 probability) descending,
    ties to the lower position (the order ``streakline.decoding.spiffy.root_order`` gives at inference)."""
    order = sorted(np.flatnonzero(masked).tolist(), key=lambda p: (-float(confidence[p]), p))
    return {pos: i for i, pos in enumerate(order)}


def realised_paths(trace: BlockTrace, horizon: int) -> Iterator[tuple[int, list[Node], bool]]:
    """Per step t with t + 1 < n: ``(t, [state h=1, ..., state h=H'], stopped)``; H' < H when the block ends first or
    a token falls outside step t's top-k (then ``stopped`` is True)."""
    steps = trace.steps
    n = len(steps)
    for t in range(n - 1):
        stale = steps[t]
        rank = root_ranks(stale.topk_probs[:, 0], steps[t + 1].masked)
        pairs: set[tuple[int, int]] = set()
        path: list[Node] = []
        stopped = False
        for s in range(t + 1, min(t + horizon, n - 1) + 1):  # step s turns S_s into S_{s+1}
            for pos in np.flatnonzero(steps[s].commit).tolist():
                hits = np.flatnonzero(stale.topk_ids[pos] == steps[s].tokens[pos])
                if len(hits) == 0:
                    stopped = True
                    break
                pairs.add((rank[pos], int(hits[0])))
            if stopped:
                break
            path.append(frozenset(pairs))
        yield t, path, stopped


@dataclass
class Observations:
    """What the traces show: how often each state was realised, the observed edges (parent, child) with counts, and
    each step's realised path (for the coverage statistics)."""

    counts: Counter
    edges: Counter
    paths: list[list[Node]]
    steps: int
    stopped: int


def count_states(traces: Sequence[BlockTrace], horizon: int) -> Observations:
    """Count every realised (i, j)-set (h = 1..H per step t with t + 1 < n) and every edge between consecutive sets
    of a path (the root -> the h = 1 set included)."""
    if horizon < 1:
        raise ValueError(f"horizon must be >= 1, got {horizon}")
    counts: Counter = Counter()
    edges: Counter = Counter()
    paths: list[list[Node]] = []
    stopped = 0
    for trace in traces:
        for _, path, cut in realised_paths(trace, horizon):
            paths.append(path)
            stopped += int(cut)
            counts.update(path)
            edges.update(zip([ROOT, *path], path, strict=False))
    return Observations(counts, edges, paths, len(paths), stopped)


def _sort_key(q: Node) -> tuple:
    return (len(q), sorted(q))


def select_nodes(counts: Counter, edges: Counter, budget: int) -> list[Node]:
    """Greedy frontier growth from the root: repeatedly add the frontier state (a child of a chosen one along an
    observed edge) with the largest gain of ``sum_q [count(q) + sum_{p in parents(q) & Q} count(p)]``. Returns up to
    ``budget`` states in the order they were chosen (fewer when fewer are reachable)."""
    parents_of: dict[Node, set[Node]] = defaultdict(set)
    children_of: dict[Node, set[Node]] = defaultdict(set)
    for p, c in edges:
        parents_of[c].add(p)
        children_of[p].add(c)

    def count(q: Node) -> int:
        return 0 if q == ROOT else counts[q]

    chosen: set[Node] = {ROOT}
    order: list[Node] = []
    frontier = set(children_of[ROOT])
    while len(order) < budget and frontier:

        def key(c: Node) -> tuple:
            # Adding c adds its own term, its chosen parents' counts, and its count to each chosen child's term.
            gain = count(c) * (1 + sum(1 for k in children_of[c] if k in chosen))
            gain += sum(count(p) for p in parents_of[c] if p in chosen)
            return (-gain, -count(c), _sort_key(c))

        best = min(frontier, key=key)
        order.append(best)
        chosen.add(best)
        frontier.discard(best)
        frontier |= children_of[best] - chosen
    return order


def objective(nodes: Sequence[Node], counts: Counter, edges: Counter) -> int:
    """``sum_{q in Q} [count(q) + sum_{parent p of q in Q} count(p)]`` (root count 0), Q = ``nodes``."""
    chosen = set(nodes)
    parents_of: dict[Node, set[Node]] = defaultdict(set)
    for p, c in edges:
        parents_of[c].add(p)
    return sum(counts[q] + sum(counts[p] for p in parents_of[q] if p in chosen and p != ROOT) for q in chosen)


def calibrate(
    traces: Sequence[BlockTrace], *, horizon: int, budget: int, header: dict[str, Any] | None = None
) -> tuple[SpiffyGraph, dict[str, Any]]:
    """The graph of ``budget`` states calibrated on ``traces``, and its statistics (also stored in ``graph.stats``).

    ``header``: the target name and decoding config (rule, temperature, seed, ...); ``top_k`` (from the traces),
    ``horizon`` and ``budget`` are filled in here.

    Statistics: ``steps`` (stale/root pairs seen), ``realised_states``, ``distinct_states``, ``edges``,
    ``unrepresentable_paths`` (stopped by a token outside the top-k), ``coverage`` (fraction of steps whose next
    realised state, h = 1, is a node), ``state_coverage`` (fraction of all realised states that are nodes),
    ``mean_walk_depth`` (mean number of leading realised states that are nodes: the extra commit steps a verification
    forward would walk with every node verified, D* = D), ``objective``, ``nodes_by_depth``."""
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    if not traces or not any(t.steps for t in traces):
        raise ValueError("no traces to calibrate on; decode some prompts first (collect_traces)")
    k = int(next(t for t in traces if t.steps).steps[0].topk_ids.shape[1])
    header = dict(header or {})
    if header.get("top_k", k) != k:
        raise ValueError(f"header top_k {header['top_k']} differs from the traces' top-k {k}")
    header.update(top_k=k, horizon=horizon, budget=budget)

    obs = count_states(traces, horizon)
    picked = select_nodes(obs.counts, obs.edges, budget)
    nodes = [ROOT, *picked]
    index = {q: n for n, q in enumerate(nodes)}
    parents_of: dict[Node, set[Node]] = defaultdict(set)
    for p, c in obs.edges:
        parents_of[c].add(p)
    parents = [[]] + [sorted(index[p] for p in parents_of[q] if p in index) for q in picked]
    graph = SpiffyGraph(nodes=nodes, parents=parents, header=header, counts=[0] + [obs.counts[q] for q in picked])

    in_graph = set(picked)
    depth_walked = []
    for path in obs.paths:
        d = 0
        while d < len(path) and path[d] in in_graph:
            d += 1
        depth_walked.append(d)
    realised = sum(obs.counts.values())
    stats = {
        "traces": len(traces),
        "steps": obs.steps,
        "realised_states": realised,
        "distinct_states": len(obs.counts),
        "edges": len(obs.edges),
        "unrepresentable_paths": obs.stopped,
        "nodes": graph.size,
        "coverage": sum(1 for p in obs.paths if p and p[0] in in_graph) / max(1, obs.steps),
        "state_coverage": sum(obs.counts[q] for q in picked) / max(1, realised),
        "mean_walk_depth": float(np.mean(depth_walked)) if depth_walked else 0.0,
        "objective": objective(picked, obs.counts, obs.edges),
        "nodes_by_depth": {str(d): n for d, n in graph.nodes_by_depth().items()},
    }
    graph.stats = stats
    return graph, stats
