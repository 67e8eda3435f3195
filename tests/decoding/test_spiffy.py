"""Spiffy's draft graph at inference: exactness against the draft-free decoder, instantiation, pruning, JSON, header
checks, and fewer forwards with a graph calibrated on the same random float64 target (block size 4) as
tests/decoding/test_block_diffusion.py. Run: ``python -m pytest tests/decoding/test_spiffy.py``."""

import dataclasses
import json
import math

import pytest
import torch

from streakline.alignment.block_traces import collect_traces
from streakline.alignment.spiffy import calibrate
from streakline.decoding.block_diffusion import BlockDecodeConfig, DraftContext, decode_blocks
from streakline.decoding.spiffy import (
    GraphError,
    GraphMismatchError,
    Instances,
    SpiffyDrafter,
    SpiffyGraph,
    graph_scores,
    instantiate,
    prune,
)
from tests.decoding.test_block_diffusion import _left_pad, _model, _prompts

CALIBRATION = (5, 7, 9, 3, 6, 8, 4, 10)  # prompt lengths of the calibration set (seed 11)
MAX_NEW = 12
# The random target is unsure; these taus make threshold steps commit 1 to many positions at each temperature.
TAU = {0.0: 0.05, 1.0: 0.015}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return _model()


def _cfg(rule: str, temperature: float) -> BlockDecodeConfig:
    return BlockDecodeConfig(
        max_new_tokens=MAX_NEW, rule=rule, threshold=TAU[temperature], temperature=temperature, seed=2
    )


@pytest.fixture(scope="module")
def traces(model):
    cache = {}

    def get(rule, temperature):
        if (rule, temperature) not in cache:
            prompts = [p.tolist() for p in _prompts(CALIBRATION, seed=11)]
            cache[rule, temperature] = collect_traces(model, prompts, _cfg(rule, temperature), top_k=8)
        return cache[rule, temperature]

    return get


def _graph(traces, rule, temperature, budget=10):
    header = {"target": "random-sdar", "rule": rule, "temperature": temperature, "seed": 2}
    return calibrate(traces(rule, temperature), horizon=4, budget=budget, header=header)[0]


# Every (temperature, rule) with two (D, D*, batch) settings: D* < D on a batch of 4, D* > D (all kept) on one row,
# and D* = 1 on one row.
SETTINGS = [(10, 3, 4), (4, 6, 1), (10, 1, 1)]


@pytest.mark.parametrize("budget,keep,batch", SETTINGS, ids=[f"D{d}-{k}-B{b}" for d, k, b in SETTINGS])
@pytest.mark.parametrize("rule", ["static", "threshold"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["T0", "T1"])
def test_spiffy_reproduces_the_draft_free_decoder(model, traces, temperature, rule, budget, keep, batch):
    graph = _graph(traces, rule, temperature, budget)
    assert graph.size == budget
    cfg = _cfg(rule, temperature)
    prompts = _prompts((6, 3, 9, 5))[:batch]  # held-out prompts (seed 1), not the calibration ones
    ids, mask = _left_pad(prompts)
    plain = decode_blocks(model, ids, mask, cfg)
    spec = decode_blocks(model, ids, mask, cfg, drafter=SpiffyDrafter(graph, keep, target="random-sdar"))
    assert spec.tokens == plain.tokens
    assert sum(spec.commits_per_forward) == sum(plain.commits_per_forward)
    assert max(spec.drafts_per_forward) <= batch * min(keep, budget) and sum(spec.drafts_per_forward) > 0
    assert sum(spec.nfe_per_row) <= sum(plain.nfe_per_row)
    if rule == "threshold" and batch > 1:
        assert max(plain.commits_per_forward) > batch, "the test should exercise multi-commit steps"


@pytest.mark.parametrize("rule", ["static", "threshold"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["T0", "T1"])
def test_calibrated_graph_saves_forwards_on_its_calibration_prompts(model, traces, temperature, rule):
    """The draft-free decode of the calibration prompts is in the traces: its output (the blocks' final states) and
    its per-row forwards (one per trace step)."""
    graph = _graph(traces, rule, temperature)
    ids, mask = _left_pad(_prompts(CALIBRATION, seed=11))
    spec = decode_blocks(model, ids, mask, _cfg(rule, temperature), drafter=SpiffyDrafter(graph, 3))
    blocks = traces(rule, temperature)
    for p, out in enumerate(spec.tokens):
        mine = [t for t in blocks if t.prompt == p]
        decoded = [int(x) for t in mine for x in t.states[-1][max(0, -t.out_start) :]]
        assert out == decoded[: len(out)]
    # Per-row forwards (the lock-step batch count hides savings of rows that wait for the slowest one).
    assert sum(spec.nfe_per_row) < sum(len(t.steps) for t in blocks)


def _ctx(probs: torch.Tensor, root: torch.Tensor, mask_id: int, active=None) -> DraftContext:
    B, L, _ = probs.shape
    masked = root == mask_id
    return DraftContext(
        root=root,
        masked=masked,
        active=masked.any(dim=1) if active is None else active,
        stale_logits=probs.log(),
        stale_masked=torch.ones_like(masked),
        probs=probs,
        scores=probs.log(),  # temperature 0: token_scores are the log-probs
        out_positions=torch.arange(L).repeat(B, 1),
        mask_id=mask_id,
        cfg=BlockDecodeConfig(max_new_tokens=L),
    )


def _hand_graph(header=None) -> SpiffyGraph:
    #       root
    #      /    \
    #   {00}    {10}
    #    |  \  /
    #  {00,11} {00,10}    {00,10,20}  <- child of {00,10};   {30}: invalid when fewer than 4 masked positions
    nodes = [
        [],
        [(0, 0)],
        [(1, 0)],
        [(0, 0), (1, 1)],
        [(0, 0), (1, 0)],
        [(0, 0), (1, 0), (2, 0)],
        [(3, 0)],
    ]
    parents = [[], [0], [0], [1], [1, 2], [4], [0]]
    header = header or {"target": "hand", "rule": "static", "temperature": 0.0, "top_k": 3}
    return SpiffyGraph(nodes=[frozenset(q) for q in nodes], parents=parents, header=header)


def _hand_probs() -> torch.Tensor:
    """Two rows, L = 5, V = 4: per position a distribution whose token ranking is spelled out below."""
    rows = [
        # row 0: confidences 0.5, 0.7, 0.7, 0.9 (committed), 0.4 -> masked order by confidence: 1, 2 (tie: lower), 0, 4
        [[0.5, 0.3, 0.1, 0.1], [0.1, 0.7, 0.15, 0.05], [0.05, 0.15, 0.1, 0.7], [0.9, 0.05, 0.03, 0.02],
         [0.3, 0.2, 0.1, 0.4]],
        # row 1: only positions 0, 2, 4 masked; order 4 (0.6), 0 (0.55), 2 (0.4)
        [[0.05, 0.55, 0.3, 0.1], [0.97, 0.01, 0.01, 0.01], [0.4, 0.3, 0.2, 0.1], [0.1, 0.1, 0.1, 0.7],
         [0.1, 0.2, 0.6, 0.1]],
    ]  # fmt: skip
    return torch.tensor(rows, dtype=torch.float64)


def test_instantiation_reads_positions_by_stale_confidence_and_tokens_by_rank():
    M = 9  # mask id (outside V; the drafter only copies it)
    root = torch.tensor([[M, M, M, 3, M], [M, 2, M, 1, M]])
    probs = _hand_probs()
    inst = instantiate(_hand_graph(), _ctx(probs, root, M))
    # Row 0: i -> position 1, 2, 0, 4 (1 and 2 tie at 0.7: the lower position first); tokens by rank:
    # pos1 [1, 2, 0], pos2 [3, 1, 2], pos0 [0, 1, ...], pos4 [3, 0, 1].  Row 1: i -> position 4, 0, 2;
    # pos4 [2, 1, ...], pos0 [1, 2, 3], pos2 [0, 1, 2].
    want = [
        [
            [M, 1, M, 3, M],  # {00}
            [M, M, 3, 3, M],  # {10}
            [M, 1, 1, 3, M],  # {00,11}
            [M, 1, 3, 3, M],  # {00,10}
            [0, 1, 3, 3, M],  # {00,10,20}
            [M, M, M, 3, 3],  # {30}: position 4, its rank-0 token
        ],
        # {30} is invalid in row 1 (3 masked positions): it stays the root.
        [[M, 2, M, 1, 2], [1, 2, M, 1, M], [2, 2, M, 1, 2], [1, 2, M, 1, 2], [1, 2, 0, 1, 2], [M, 2, M, 1, M]],
    ]
    assert inst.tokens.tolist() == want
    assert inst.valid.tolist() == [[True] * 6, [True] * 5 + [False]]  # row 1 has 3 masked positions: no i = 3
    p = probs
    local0 = [p[0, 1, 1], p[0, 2, 3], (p[0, 1, 1] * p[0, 2, 1]) ** 0.5, (p[0, 1, 1] * p[0, 2, 3]) ** 0.5]
    local0.append((p[0, 1, 1] * p[0, 2, 3] * p[0, 0, 0]) ** (1 / 3))
    local0.append(p[0, 4, 3])
    torch.testing.assert_close(inst.local[0], torch.stack(local0))
    # An inactive row gets nothing, whatever its state.
    off = instantiate(_hand_graph(), _ctx(probs, root, M, active=torch.tensor([True, False])))
    assert off.valid[1].tolist() == [False] * 6 and off.valid[0].equal(inst.valid[0])


def test_pruning_scores_are_geometric_means_over_the_dag():
    graph = _hand_graph()
    local = torch.tensor([[0.6, 0.5, 0.2, 0.4, 0.3, 0.9], [0.6, 0.5, 0.2, 0.4, 0.3, 0.9]], dtype=torch.float64)
    valid = torch.tensor([[True] * 6, [True, True, True, True, False, True]])
    got = graph_scores(graph, local, valid)

    def gm(*xs):
        return math.prod(xs) ** (1 / len(xs))

    # Row 0: leaves {00,11}=0.2, {00,10,20}=0.3, {30}=0.9; {00,10} has child {00,10,20}; {00} children {00,11}, {00,10}
    s5, s3, s6 = 0.3, 0.2, 0.9
    s4 = gm(0.4, s5)
    s1 = gm(0.6, gm(s3, s4))
    s2 = gm(0.5, s4)
    torch.testing.assert_close(got[0], torch.tensor([s1, s2, s3, s4, s5, s6], dtype=torch.float64))
    # Row 1: {00,10,20} is invalid, so {00,10} is a leaf (score = local) and its parents see that.
    r4 = 0.4
    want1 = [gm(0.6, gm(0.2, r4)), gm(0.5, r4), 0.2, r4, 0.3, 0.9]
    torch.testing.assert_close(got[1, [0, 1, 2, 3, 5]], torch.tensor(want1, dtype=torch.float64)[[0, 1, 2, 3, 5]])

    tokens = torch.arange(12 * 5).view(2, 6, 5)
    kept = prune(Instances(tokens, valid, local, got), 3)
    order0 = sorted(range(6), key=lambda n: (-float(got[0, n]), n))[:3]
    assert kept.tokens[0].equal(tokens[0, order0]) and kept.valid.all()
    # Fewer valid states than D*: padding comes back with valid=False.
    few = prune(Instances(tokens, torch.tensor([[True] + [False] * 5] * 2), local, got), 3)
    assert few.valid.tolist() == [[True, False, False]] * 2 and few.tokens[:, 0].equal(tokens[:, 0])


def test_json_round_trip_and_malformed_graphs(tmp_path, traces):
    graph = _graph(traces, "static", 0.0)
    path = graph.save(tmp_path / "graph.json")
    back = SpiffyGraph.load(path)
    assert back.nodes == graph.nodes and back.parents == graph.parents and back.counts == graph.counts
    assert back.header == graph.header and back.stats == graph.stats
    data = json.loads(path.read_text())
    assert data["format"] == "streakline-spiffy-graph" and data["nodes"][0] == {
        "id": 0,
        "pairs": [],
        "parents": [],
        "count": 0,
    }
    assert {"target", "rule", "temperature", "top_k", "horizon", "budget", "seed"} <= data["header"].keys()
    # A parent that is not a subset of its child is refused.
    data["nodes"][2]["parents"] = [2]
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="parent"):
        SpiffyGraph.load(tmp_path / "bad.json")
    with pytest.raises(GraphError, match="stage=spiffy"):
        SpiffyGraph.load(tmp_path / "missing.json")


def test_a_graph_for_another_target_rule_or_temperature_is_refused(model, traces):
    graph = _graph(traces, "static", 0.0)
    with pytest.raises(GraphMismatchError, match="target 'random-sdar'.*stage=spiffy"):
        SpiffyDrafter(graph, 3, target="tiny-target")
    ids, mask = _left_pad(_prompts((6,)))
    for cfg, what in ((_cfg("threshold", 0.0), "stage.rule=threshold"), (_cfg("static", 1.0), "temperature=1.0")):
        with pytest.raises(GraphMismatchError, match=what):
            decode_blocks(model, ids, mask, cfg, drafter=SpiffyDrafter(graph, 3))
    # the threshold rule at another tau commits in another order: refused too, and a static graph ignores tau
    by_threshold = _graph(traces, "threshold", 0.0)
    by_threshold.header["threshold"] = TAU[0.0]
    other = dataclasses.replace(_cfg("threshold", 0.0), threshold=0.2)
    with pytest.raises(GraphMismatchError, match=r"threshold 0.05 \(decoding 0.2\).*stage.threshold=0.2"):
        decode_blocks(model, ids, mask, other, drafter=SpiffyDrafter(by_threshold, 3))
    decode_blocks(model, ids, mask, _cfg("threshold", 0.0), drafter=SpiffyDrafter(by_threshold, 3))
    decode_blocks(
        model, ids, mask, dataclasses.replace(_cfg("static", 0.0), threshold=0.2), drafter=SpiffyDrafter(graph, 3)
    )
