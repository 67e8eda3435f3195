"""Spiffy calibration on hand-made traces: what is counted, which graph greedy growth picks, its shape, determinism.
Run: ``python -m pytest tests/alignment/test_spiffy.py``."""

from collections import Counter

import numpy as np
import pytest

from streakline.alignment.block_traces import BlockTrace, TraceStep, collect_traces
from streakline.alignment.spiffy import calibrate, count_states, select_nodes
from streakline.decoding.block_diffusion import BlockDecodeConfig
from tests.decoding.test_block_diffusion import _model, _prompts

MASK = 99
L, K = 4, 3


pytestmark = pytest.mark.usefixtures("one_thread")


def _trace(steps: list[tuple[dict, dict, dict]]) -> BlockTrace:
    """``steps``: per step (commits {pos: token}, top-k ids {pos: [k ids]}, rank-0 probability {pos: p}); positions
    left out get ids [0, 1, 2] and probability 0.1."""
    state = np.full(L, MASK, dtype=np.int64)
    out = []
    for commits, ids, conf in steps:
        masked = state == MASK
        commit = np.zeros(L, dtype=bool)
        for pos, tok in commits.items():
            assert masked[pos]
            commit[pos], state[pos] = True, tok
        topk_ids = np.array([ids.get(p, [0, 1, 2]) for p in range(L)], dtype=np.int64)
        p0 = np.array([conf.get(p, 0.1) for p in range(L)], dtype=np.float32)
        topk_probs = np.stack([p0, p0 / 2, p0 / 4], axis=1)
        out.append(TraceStep(masked, commit, state.copy(), p0, topk_ids, topk_probs))
    return BlockTrace(prompt=0, block=0, out_start=0, initial=np.full(L, MASK, dtype=np.int64), steps=out)


# Trace A (one commit per step). t=0: root masked {0, 1, 3} ranked by step 0's confidence: pos 3 (0.6) i=0, pos 0
# (0.5) i=1, pos 1 (0.2) i=2; then pos 0 commits 6 (j=0), pos 3 commits 7 (j=1), pos 1 commits 8 (not in the top-k:
# the path stops). t=1: root masked {1, 3}, tie at 0.3 -> pos 1 i=0, pos 3 i=1; pos 3 gets 7 (j=0), pos 1 gets 8 (j=2).
# t=2: pos 1 (i=0) gets 8 (j=0).
A = _trace(
    [
        ({2: 5}, {0: [6, 1, 2], 1: [0, 1, 2], 3: [3, 7, 4]}, {0: 0.5, 1: 0.2, 2: 0.9, 3: 0.6}),
        ({0: 6}, {3: [7, 0, 1], 1: [2, 3, 8]}, {1: 0.3, 3: 0.3}),
        ({3: 7}, {1: [8, 0, 1]}, {1: 0.5}),
        ({1: 8}, {}, {}),
    ]
)
# Trace B (two commits in one step). t=0: root masked {0, 2, 3}: pos 2 i=0, pos 0 i=1, pos 3 i=2; step 1 commits pos 0
# = 6 (j=1) and pos 2 = 7 (j=0); step 2 commits pos 3 = 8 (j=0). t=1: pos 3 (i=0) gets 8 (j=0).
B = _trace(
    [
        ({1: 5}, {0: [1, 6, 2], 2: [7, 0, 1], 3: [8, 0, 1]}, {0: 0.4, 2: 0.7, 3: 0.1}),
        ({0: 6, 2: 7}, {3: [8, 0, 1]}, {}),
        ({3: 8}, {}, {}),
    ]
)
R = frozenset()
a1, a2, a3 = frozenset({(1, 0)}), frozenset({(1, 0), (0, 1)}), frozenset({(1, 0), (0, 2)})
b1, b2, c1 = frozenset({(0, 0), (1, 1)}), frozenset({(0, 0), (1, 1), (2, 0)}), frozenset({(0, 0)})


def test_realised_states_and_edges_are_counted_as_specified():
    obs = count_states([A, B, A], horizon=3)
    assert obs.counts == Counter({a1: 4, a2: 2, a3: 2, c1: 3, b1: 1, b2: 1})
    assert obs.edges == Counter({(R, a1): 4, (a1, a2): 2, (a1, a3): 2, (R, c1): 3, (R, b1): 1, (b1, b2): 1})
    assert (obs.steps, obs.stopped) == (8, 2)  # A's t=0 path meets a token outside the top-k at h=3, twice
    assert obs.paths[:3] == [[a1, a2], [a1, a3], [c1]]
    short = count_states([A, B, A], horizon=1)
    assert short.counts == Counter({a1: 4, c1: 3, b1: 1}) and short.stopped == 0
    assert short.edges == Counter({(R, a1): 4, (R, c1): 3, (R, b1): 1})
    with pytest.raises(ValueError, match="horizon"):
        count_states([A], horizon=0)


def test_greedy_growth_maximises_counts_plus_parent_counts_in_the_documented_order():
    obs = count_states([A, B, A], horizon=3)
    # root children: a1 (4) > c1 (3) > b1 (1); then a2 and a3 gain 2 + 4 = 6 each (tie: sorted pairs, (0,1) first).
    assert select_nodes(obs.counts, obs.edges, 3) == [a1, a2, a3]
    assert select_nodes(obs.counts, obs.edges, 10) == [a1, a2, a3, c1, b1, b2]
    graph, stats = calibrate([A, B, A], horizon=3, budget=3, header={"target": "hand", "rule": "static"})
    assert graph.nodes == [R, a1, a2, a3] and graph.parents == [[], [0], [1], [1]] and graph.counts == [0, 4, 2, 2]
    assert graph.header == {"target": "hand", "rule": "static", "top_k": K, "horizon": 3, "budget": 3}
    assert stats["steps"] == 8 and stats["realised_states"] == 13 and stats["distinct_states"] == 6
    assert stats["coverage"] == 4 / 8  # A's t=0 and t=1 (twice) start at a1
    assert stats["state_coverage"] == 8 / 13
    assert stats["mean_walk_depth"] == (2 + 2) * 2 / 8
    assert stats["objective"] == 4 + (2 + 4) + (2 + 4)
    assert stats["nodes_by_depth"] == {"1": 1, "2": 2} and stats["unrepresentable_paths"] == 2


def test_fewer_observed_states_than_the_budget_give_a_smaller_graph():
    graph, stats = calibrate([A, B, A], horizon=3, budget=10)
    assert graph.size == 6 == stats["nodes"]  # documented: D is an upper bound
    assert calibrate([A], horizon=3, budget=0)[0].nodes == [R]


def test_a_state_reached_from_two_parents_keeps_both():
    # C commits positions 1, 2 in that order after position 0; D commits 2 then 1; step 0 ranks pos 1 (i=0) over
    # pos 2 (i=1), so {(0,0),(1,0)} is reached from {(0,0)} in C and from {(1,0)} in D.
    s0 = ({0: 1}, {1: [2, 0, 1], 2: [3, 0, 1], 3: [4, 0, 1]}, {1: 0.9, 2: 0.8, 3: 0.7})
    C = _trace([s0, ({1: 2}, {}, {}), ({2: 3}, {}, {}), ({3: 4}, {}, {})])
    D = _trace([s0, ({2: 3}, {}, {}), ({1: 2}, {}, {}), ({3: 4}, {}, {})])
    graph, _ = calibrate([C, D], horizon=2, budget=3)
    both = frozenset({(0, 0), (1, 0)})
    k = graph.nodes.index(both)
    assert sorted(graph.nodes[p] for p in graph.parents[k]) == sorted(
        [frozenset({(0, 0)}), frozenset({(1, 0)})], key=sorted
    )


def _check_shape(graph, budget, distinct):
    assert graph.nodes[0] == frozenset() and graph.parents[0] == []
    assert graph.size == min(budget, distinct)
    assert len(set(graph.nodes)) == len(graph.nodes)
    assert all(d >= 1 for d in graph.depths()[1:])  # connected: every node reachable from the root
    for q, ps in zip(graph.nodes[1:], graph.parents[1:], strict=True):
        assert ps and all(graph.nodes[p] < q for p in ps)


@pytest.mark.parametrize("rule", ["static", "threshold"])
def test_calibration_on_real_traces_is_connected_and_deterministic(rule):
    cfg = BlockDecodeConfig(max_new_tokens=12, rule=rule, threshold=0.05)
    traces = collect_traces(_model(), [p.tolist() for p in _prompts((5, 7, 9, 3, 6))], cfg, top_k=6)
    for budget in (1, 5, 12, 40):
        graph, stats = calibrate(traces, horizon=4, budget=budget)
        _check_shape(graph, budget, stats["distinct_states"])
        again, _ = calibrate(traces, horizon=4, budget=budget)
        backwards, _ = calibrate(traces[::-1], horizon=4, budget=budget)  # other insertion order, same counts
        assert again.to_json() == graph.to_json()
        assert (backwards.nodes, backwards.parents) == (graph.nodes, graph.parents)
        # Greedy growth: the first n nodes are the graph of budget n (what decoder.budget < spiffy.budget uses).
        smaller, _ = calibrate(traces, horizon=4, budget=budget // 2)
        cut = graph.prefix(budget // 2)
        assert (cut.nodes, cut.parents, cut.counts) == (smaller.nodes, smaller.parents, smaller.counts)
    with pytest.raises(ValueError, match="no traces"):
        calibrate([], horizon=4, budget=3)
