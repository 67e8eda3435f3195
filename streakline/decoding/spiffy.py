"""Spiffy (docs/algorithms.md section 9): a calibrated draft graph that a block-diffusion target verifies, no training.

A *node* is a hypothetical future state of the current block written relative to the stale distribution (the
target's distributions from the last real forward): a set of ``(i, j)`` pairs, i = rank of a root-masked position by
its stale confidence, j = rank of a token at that position in the stale top-k. The root is the empty set. The graph
(a DAG: a node can be reached from several parents, each parent being a state one commit step earlier) is fixed
offline by ``streakline.alignment.spiffy.calibrate`` and stored as JSON; at every verification forward the
``SpiffyDrafter`` instantiates its nodes against the live stale distribution, scores them, keeps the best D* and hands
them to ``decode_blocks`` as draft states. Any proposal is safe: the walk only follows states equal to the target's
own (tests/decoding/test_spiffy.py checks that the output equals the draft-free decoder's at T = 0 and T = 1).

    graph = SpiffyGraph.load("runs/default/spiffy/<hash>/graph.json")
    res = decode_blocks(target, ids, mask, BlockDecodeConfig(rule="static", max_new_tokens=64),
                        drafter=SpiffyDrafter(graph, prune=3, target="tiny-target"))

Pairing (docs/spiffy.md): the drafter is called with the stale distribution of state S_t (``ctx.probs``,
``ctx.scores``) and the root S_{t+1} (``ctx.root``, ``ctx.masked``); i ranks only the root's masked positions, by the
stale rank-0 probability, descending, ties to the lower position.
Tests: ``python -m pytest tests/decoding/test_spiffy.py``.
"""

from __future__ import annotations

import json
import math
import os
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from streakline.artifacts import write_json_atomic
from streakline.errors import UserError

from .block_rules import BlockDrafter, DraftContext, Drafts, stale_topk

FORMAT = "streakline-spiffy-graph"
VERSION = 1
# Keys every graph header carries; "target", "rule" and "temperature" must match the decode that uses the graph.
HEADER_KEYS = ("target", "rule", "temperature", "top_k", "horizon", "budget", "seed")

Pair = tuple[int, int]
Node = frozenset  # frozenset[Pair]


class GraphError(UserError, ValueError):
    """A graph file that is missing, not JSON, or not a Spiffy graph this code reads; the message says the fix."""


class GraphMismatchError(GraphError):
    """A graph calibrated for another target or decoding config than the decode that wants to use it."""


@dataclass
class SpiffyGraph:
    """The draft graph. ``nodes[0]`` is the root (the empty set); ``parents[k]`` are indices into ``nodes`` of the
    states one commit step before node k (each a strict subset of it); ``counts[k]`` how often calibration saw node k
    as a realised future state (informational). ``header`` says which target and decoding config it was made for."""

    nodes: list[Node]
    parents: list[list[int]]
    header: dict[str, Any]
    counts: list[int] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.nodes = [frozenset((int(i), int(j)) for i, j in q) for q in self.nodes]
        self.parents = [sorted(int(p) for p in ps) for ps in self.parents]
        self.counts = [int(c) for c in self.counts] or [0] * len(self.nodes)
        problem = self._problem()
        if problem is not None:
            raise ValueError(f"not a valid Spiffy graph: {problem}")

    def _problem(self) -> str | None:
        if not self.nodes or self.nodes[0] != frozenset():
            return "nodes[0] must be the root (the empty set)"
        if len(self.parents) != len(self.nodes) or len(self.counts) != len(self.nodes):
            return f"{len(self.nodes)} nodes but {len(self.parents)} parent lists and {len(self.counts)} counts"
        if len(set(self.nodes)) != len(self.nodes):
            return "a state appears twice"
        if self.parents[0]:
            return "the root has parents"
        for k, (q, ps) in enumerate(zip(self.nodes, self.parents, strict=True)):
            if any(i < 0 or j < 0 for i, j in q):
                return f"node {k} has a negative rank"
            if len({i for i, _ in q}) != len(q):
                return f"node {k} commits one position twice"
            if k and not ps:
                return f"node {k} has no parent"
            for p in ps:
                if not 0 <= p < len(self.nodes) or not self.nodes[p] < q:
                    return f"node {k}'s parent {p} is not a state strictly inside it"
        return None

    # --------------------------------------------------------------------------------------------- structure
    @property
    def size(self) -> int:
        """D: nodes besides the root."""
        return len(self.nodes) - 1

    @property
    def children(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in self.nodes]
        for k, ps in enumerate(self.parents):
            for p in ps:
                kids[p].append(k)
        return kids

    def depths(self) -> list[int]:
        """Shortest number of parent edges from the root to each node (commit steps to reach it)."""
        depth = [0] + [-1] * self.size
        kids = self.children
        todo = deque([0])
        while todo:
            p = todo.popleft()
            for c in kids[p]:
                if depth[c] < 0:
                    depth[c] = depth[p] + 1
                    todo.append(c)
        return depth

    def nodes_by_depth(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for d in self.depths()[1:]:
            out[d] = out.get(d, 0) + 1
        return dict(sorted(out.items()))

    def prefix(self, n: int) -> SpiffyGraph:
        """The root and the first ``n`` nodes, parent edges to dropped nodes removed. Calibration grows the graph
        greedily, so its first n nodes are what calibrating with budget n would give (ValueError if a node would lose
        every parent, i.e. the graph was not stored in growth order)."""
        keep = min(n, self.size) + 1
        return SpiffyGraph(
            nodes=self.nodes[:keep],
            parents=[[p for p in ps if p < keep] for ps in self.parents[:keep]],
            header={**self.header, "budget": keep - 1},
            counts=self.counts[:keep],
        )

    # ------------------------------------------------------------------------------------------------ JSON
    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "header": self.header,
            "nodes": [
                {"id": k, "pairs": sorted([i, j] for i, j in q), "parents": ps, "count": c}
                for k, (q, ps, c) in enumerate(zip(self.nodes, self.parents, self.counts, strict=True))
            ],
            "stats": self.stats,
        }

    @classmethod
    def from_json(cls, data: Any, source: str = "graph") -> SpiffyGraph:
        fix = "recalibrate it with `python launch.py stage=spiffy model=...`"
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise GraphError(f"{source} is not a Spiffy graph (no format {FORMAT!r}); {fix}")
        if data.get("version") != VERSION:
            raise GraphError(
                f"{source} has graph format version {data.get('version')}, this code reads {VERSION}; {fix}"
            )
        header = data.get("header")
        if not isinstance(header, dict) or (missing := [k for k in HEADER_KEYS if k not in header]):
            raise GraphError(f"{source}'s header lacks {missing if isinstance(header, dict) else 'everything'}; {fix}")
        try:
            rows = sorted(data["nodes"], key=lambda n: n["id"])
            if [n["id"] for n in rows] != list(range(len(rows))):
                raise ValueError("node ids are not 0..n-1")
            return cls(
                nodes=[frozenset(tuple(p) for p in n["pairs"]) for n in rows],
                parents=[n["parents"] for n in rows],
                header=header,
                counts=[n.get("count", 0) for n in rows],
                stats=data.get("stats", {}),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise GraphError(f"{source} holds a malformed graph ({e}); {fix}") from e

    def save(self, path: str | os.PathLike) -> Path:
        write_json_atomic(path, self.to_json())
        return Path(path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> SpiffyGraph:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise GraphError(f"no Spiffy graph at {path}; run `python launch.py stage=spiffy` first") from None
        except ValueError as e:
            raise GraphError(f"{path} is not JSON ({e}); delete it and rerun `python launch.py stage=spiffy`") from e
        return cls.from_json(data, source=str(path))

    # --------------------------------------------------------------------------------------------- checking
    def check(
        self,
        *,
        target: str | None = None,
        rule: str | None = None,
        temperature: float | None = None,
        threshold: float | None = None,
    ) -> None:
        """Raise GraphMismatchError when the graph was calibrated for another target, rule, temperature, or (for the
        threshold rule) another threshold.

        The (i, j) statistics depend on all of them (the commit order, and at T > 0 the noisy token ranking), so a
        graph from another setting would still decode exactly but draft badly; refusing says how to get the right one.
        """
        h = self.header
        wrong = []
        # A key the header lacks is not checked: only an in-memory graph calibrated without a header has none
        # (a loaded graph.json always has all three).
        if target is not None and h.get("target", target) != target:
            wrong.append(f"target {h['target']!r} (decoding {target!r})")
        if rule is not None and h.get("rule", rule) != rule:
            wrong.append(f"rule {h['rule']!r} (decoding {rule!r})")
        if temperature is not None and not math.isclose(
            float(h.get("temperature", temperature)), float(temperature), abs_tol=1e-9
        ):
            wrong.append(f"temperature {h['temperature']} (decoding {temperature})")
        calibrated_rule = h.get("rule", rule)
        if (
            threshold is not None
            and calibrated_rule == "threshold"
            and (rule is None or rule == "threshold")
            and not math.isclose(float(h.get("threshold", threshold)), float(threshold), abs_tol=1e-9)
        ):
            wrong.append(f"threshold {h['threshold']} (decoding {threshold})")
        if wrong:
            raise GraphMismatchError(
                f"this Spiffy graph was calibrated for {', '.join(wrong)}; calibrate one for this decode with "
                f"`python launch.py stage=spiffy model=... stage.rule={rule or h.get('rule')} "
                f"stage.temperature={h.get('temperature') if temperature is None else temperature}"
                + (
                    f" stage.threshold={threshold}"
                    if threshold is not None and (rule or h.get("rule")) == "threshold"
                    else ""
                )
                + "` "
                "or point decoder.artifact at a matching graph.json"
            )


# ------------------------------------------------------------------------------------------------- inference
@dataclass
class Instances:
    """The graph's non-root nodes instantiated on a batch: ``tokens`` ``[B, N, L]`` full block states, ``valid``
    ``[B, N]``, ``local`` ``[B, N]`` (geometric mean of the nodes' stale token probabilities), ``score`` ``[B, N]``."""

    tokens: torch.Tensor
    valid: torch.Tensor
    local: torch.Tensor
    score: torch.Tensor


@dataclass
class GraphPlan:
    """A graph's structure as index tensors for batched instantiation; built once per graph and device.

    ``ri``, ``rj``, ``real``: ``[N, M]`` ranks of the non-root nodes' pairs, padded to the largest node (real = not
    padding). ``levels``: per node size, largest first, the node columns of that size that have children and their
    child matrix ``[n, N]`` (1 where column c is a child), so scores are computed level by level, children first."""

    ri: torch.Tensor
    rj: torch.Tensor
    real: torch.Tensor
    levels: list[tuple[torch.Tensor, torch.Tensor]]


def graph_plan(graph: SpiffyGraph, device: torch.device | str = "cpu") -> GraphPlan:
    nodes = [sorted(q) for q in graph.nodes[1:]]
    N, M = len(nodes), max((len(q) for q in nodes), default=1)
    ri = torch.zeros(N, M, dtype=torch.long)
    rj = torch.zeros(N, M, dtype=torch.long)
    real = torch.zeros(N, M, dtype=torch.bool)
    for n, q in enumerate(nodes):
        for m, (i, j) in enumerate(q):
            ri[n, m], rj[n, m], real[n, m] = i, j, True
    kids = graph.children
    levels = []
    # Children are strict supersets of their parents: a level only reads scores of larger, already scored nodes.
    for size in sorted({len(q) for q in nodes}, reverse=True):
        cols = [n for n, q in enumerate(nodes) if len(q) == size and kids[n + 1]]
        if cols:
            adj = torch.zeros(len(cols), N, dtype=torch.float64)
            for r, n in enumerate(cols):
                adj[r, [c - 1 for c in kids[n + 1]]] = 1.0
            levels.append((torch.tensor(cols, device=device), adj.to(device)))
    return GraphPlan(ri.to(device), rj.to(device), real.to(device), levels)


def root_order(probs_top: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
    """``[B, L]`` positions by stale confidence: ``probs_top`` ``[B, L, k]`` (rank 0 first), only ``masked``
    positions ranked (descending, ties to the lower position); unmasked ones come last. Index i = rank i."""
    conf = probs_top[..., 0].masked_fill(~masked, float("-inf"))
    return torch.sort(conf, dim=1, descending=True, stable=True).indices


def instantiate(graph: SpiffyGraph, ctx: DraftContext, plan: GraphPlan | None = None) -> Instances:
    """Read every non-root node's positions and tokens from the live stale distribution (see the module docstring).

    A node is invalid in a row when one of its i is not below the root's number of masked positions, one of its j is
    beyond the top-k the vocabulary allows, or the row is inactive. ``plan``: ``graph_plan(graph)``, to reuse."""
    B, L = ctx.root.shape
    dev = ctx.root.device
    k = int(graph.header["top_k"])
    ids, probs = stale_topk(ctx.scores, ctx.probs, k)  # [B, L, k'] with k' = min(k, V)
    k = ids.shape[-1]
    N = graph.size
    if N == 0:
        empty = torch.zeros(B, 0, dtype=torch.bool, device=dev)
        return Instances(ctx.root.new_zeros(B, 0, L), empty, probs.new_zeros(B, 0), probs.new_zeros(B, 0))
    plan = plan or graph_plan(graph, dev)
    ri, rj, real = plan.ri, plan.rj, plan.real
    order = root_order(probs, ctx.masked)
    n_masked = ctx.masked.sum(dim=1)
    fits = (ri[None] < n_masked[:, None, None]) & (rj[None] < k)
    valid = (fits | ~real[None]).all(dim=-1) & ctx.active[:, None]
    rows = torch.arange(B, device=dev)[:, None, None]
    ic, jc = ri.clamp(max=L - 1), rj.clamp(max=k - 1)  # out-of-range ranks make the node invalid; clamp to index
    pos = order[:, ic]  # [B, N, M]
    tok = ids[rows, pos, jc[None]]
    p = probs[rows, pos, jc[None]]
    logp = torch.where(real[None], torch.log(p), torch.zeros_like(p)).sum(dim=-1)
    local = torch.exp(logp / real.sum(dim=-1)[None])
    # Padding writes go to an extra column L that is dropped, so they never clash with a real commit.
    states = torch.cat([ctx.root, ctx.root[:, :1]], dim=1)[:, None].repeat(1, N, 1)
    states.scatter_(2, torch.where(real[None], pos, L), tok)
    # An invalid node read clamped ranks: show it as the root so nothing downstream mistakes it for a state.
    tokens = torch.where(valid[..., None], states[..., :L], ctx.root[:, None])
    score = graph_scores(graph, local, valid, plan)
    return Instances(tokens, valid, local, score)


def graph_scores(
    graph: SpiffyGraph, local: torch.Tensor, valid: torch.Tensor, plan: GraphPlan | None = None
) -> torch.Tensor:
    """``[B, N]`` pruning scores of the non-root nodes: ``score(q) = sqrt(local(q) * child(q))`` with child(q) the
    geometric mean of the scores of q's valid children; a node without valid children scores ``local(q)``."""
    plan = plan or graph_plan(graph, local.device)
    score = local.clone()
    tiny = torch.finfo(score.dtype).tiny  # a zero probability must not turn 0 * log(0) into NaN below
    for cols, adj in plan.levels:
        weights = adj.to(score.dtype)
        logs = torch.where(valid, torch.log(score.clamp_min(tiny)), torch.zeros_like(score))
        n = valid.to(score.dtype) @ weights.T  # [B, len(cols)] valid children
        child = torch.exp((logs @ weights.T) / n.clamp(min=1))
        mine = local[:, cols]
        score[:, cols] = torch.where(n > 0, torch.sqrt(mine * child), mine)
    return score


def prune(inst: Instances, keep: int) -> Drafts:
    """The ``keep`` best valid nodes per row by score (ties to the lower node index): ``Drafts`` ``[B, keep, L]``;
    rows with fewer valid nodes are padded with ``valid=False``."""
    B, N, L = inst.tokens.shape
    keep = min(keep, N)
    key = inst.score.masked_fill(~inst.valid, float("-inf"))
    pick = torch.sort(key, dim=1, descending=True, stable=True).indices[:, :keep]
    tokens = inst.tokens.gather(1, pick[..., None].expand(-1, -1, L))
    return Drafts(tokens, inst.valid.gather(1, pick))


class SpiffyDrafter(BlockDrafter):
    """Proposes the graph's D* best-scoring states per forward. ``target``: the name to check the header against."""

    def __init__(self, graph: SpiffyGraph, prune: int, *, target: str | None = None) -> None:
        if prune < 0:
            raise ValueError(f"prune (D*) must be >= 0, got {prune}")
        graph.check(target=target)
        self.graph, self.prune = graph, prune
        self._checked: tuple[str, float, float] | None = None
        self._plans: dict[torch.device, GraphPlan] = {}

    def propose(self, ctx: DraftContext) -> Drafts | None:
        setting = (ctx.cfg.rule, ctx.cfg.temperature, ctx.cfg.threshold)
        if setting != self._checked:
            self.graph.check(rule=ctx.cfg.rule, temperature=ctx.cfg.temperature, threshold=ctx.cfg.threshold)
            self._checked = setting
        if self.prune == 0 or self.graph.size == 0:
            return None
        dev = ctx.root.device
        if dev not in self._plans:
            self._plans[dev] = graph_plan(self.graph, dev)
        return prune(instantiate(self.graph, ctx, self._plans[dev]), self.prune)
