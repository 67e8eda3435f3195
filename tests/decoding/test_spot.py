"""SPOT's tree drafter on the random float64 block target: output identical to the draft-free decoder at any
temperature, rule, budget and batch size; the trees are what section 8 specifies (checked node by node, and against
a one-row heap-based best-first reference); a trained order model saves forwards.
Run: ``python -m pytest tests/decoding/test_spot.py``."""

import heapq

import pytest
import torch

from streakline.alignment.block_traces import collect_traces
from streakline.alignment.spot import SpotTrainConfig, build_examples, train_order_model
from streakline.decoding.block_diffusion import BlockDecodeConfig, BlockDrafter, DraftContext, decode_blocks, stale_topk
from streakline.decoding.spot import OrderModelMismatchError, SpotDrafter
from streakline.models.order_model import OrderModel, OrderModelConfig, order_features
from tests.decoding.test_block_diffusion import MAX_NEW, _left_pad, _model, _prompts

MICRO = OrderModelConfig(top_k=4, d_model=32, layers=1, heads=4, ffn=64, max_block=8)
PROMPTS = (6, 3, 9, 5)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return _model()


@pytest.fixture(scope="module")
def order_model(model):
    """An order model trained on the random target's static traces (other prompts than the tests decode)."""
    prompts = [p.tolist() for p in _prompts((5, 6, 7, 9, 3, 4, 8, 2) * 3, seed=11)]
    traces = collect_traces(model, prompts, BlockDecodeConfig(max_new_tokens=16, rule="static"), batch_size=8, top_k=4)
    om, _ = train_order_model(
        build_examples(traces, horizon=4), None, MICRO, SpotTrainConfig(steps=60, lr=3e-3), progress=False
    )
    return om


class Recorder(BlockDrafter):
    """Delegates to a drafter and keeps every context it was asked about."""

    def __init__(self, inner: SpotDrafter):
        self.inner, self.contexts = inner, []

    def propose(self, ctx: DraftContext):
        self.contexts.append(ctx)
        return self.inner.propose(ctx)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["T0", "T1"])
@pytest.mark.parametrize("rule", ["static", "threshold"])
def test_spot_output_equals_the_draft_free_decoder(model, order_model, rule, temperature):
    cfg = BlockDecodeConfig(max_new_tokens=MAX_NEW, rule=rule, threshold=0.05, temperature=temperature, seed=3)
    prompts = _prompts(PROMPTS)
    for batch in (prompts[:1], prompts):
        ids, mask = _left_pad(batch)
        plain = decode_blocks(model, ids, mask, cfg)
        for budget, floor in ((1, None), (4, None), (8, None), (8, 0.02)):
            spec = decode_blocks(
                model, ids, mask, cfg, drafter=SpotDrafter(order_model, budget, prefix_mass_floor=floor)
            )
            assert spec.tokens == plain.tokens, (len(batch), budget, floor)
            assert sum(spec.commits_per_forward) == sum(plain.commits_per_forward)
            assert spec.nfe <= plain.nfe
            assert max(spec.drafts_per_forward) <= budget * len(batch)


def _reference_tree(om: OrderModel, ctx: DraftContext, r: int, budget: int, floor, second_below=0.6):
    """Row r's tree by a plain heap-based best-first search, one order-model forward per node: {state: mass}."""
    ids, probs = stale_topk(ctx.scores[r : r + 1], ctx.probs[r : r + 1], om.config.top_k)
    ids, probs = ids[0], probs[0]
    masked, real = ctx.masked[r], ~ctx.masked[r]
    heap, nodes = [], {}

    def push(j, state, path, mass):
        eligible = masked & ~path
        if not eligible.any():
            return
        f = order_features(probs[None].float(), real[None], path[None], torch.tensor([int(path.sum())]), top_k=4)
        q = torch.softmax(om(f, eligible[None]).detach().double(), -1)[0]
        for pos in eligible.nonzero().flatten().tolist():
            for h in (0, 1) if probs[pos, 0] < second_below else (0,):
                m = mass * float(q[pos]) * float(probs[pos, h])
                if floor is None or m >= floor:
                    heapq.heappush(heap, (-m, j, pos, h, state, path))

    seen = {tuple(ctx.root[r].tolist())}
    push(0, ctx.root[r], torch.zeros_like(masked), 1.0)
    while heap and len(nodes) < budget:
        neg, _, pos, h, state, path = heapq.heappop(heap)
        child, cpath = state.clone(), path.clone()
        child[pos], cpath[pos] = ids[pos, h], True
        key = tuple(child.tolist())
        if key in seen:
            continue
        seen.add(key)
        nodes[key] = -neg
        push(len(nodes), child, cpath, -neg)
    return nodes


@pytest.mark.parametrize("floor", [None, 0.02])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tree_invariants_and_best_first_order(model, order_model, temperature, floor):
    D = 6
    cfg = BlockDecodeConfig(max_new_tokens=MAX_NEW, rule="static", temperature=temperature, seed=1)
    ids, mask = _left_pad(_prompts(PROMPTS))
    drafter = SpotDrafter(order_model, D, prefix_mass_floor=floor)
    rec = Recorder(drafter)
    decode_blocks(model, ids, mask, cfg, drafter=rec)
    assert len(rec.contexts) > 3
    saw_inactive = saw_second = False
    for ctx in rec.contexts:
        tree = drafter.build_tree(ctx)
        top2 = stale_topk(ctx.scores, ctx.probs, 2)[0]
        drafts = tree.drafts()  # cut to the widest row: padding columns would cost verification compute
        width = int(tree.valid[:, 1:].sum(dim=1).max())
        assert drafts.tokens.shape[1] == width and (width == 0 or drafts.valid.any(dim=0).all())
        assert torch.equal(drafts.tokens, tree.tokens[:, 1 : 1 + width])
        for r in range(ctx.root.shape[0]):
            n = int(tree.valid[r, 1:].sum())
            assert n <= D and tree.valid[r, 1 : 1 + n].all()  # nodes fill slots 1..n
            if not ctx.active[r]:
                saw_inactive = True
                assert n == 0 and not tree.valid[r].any()
                continue
            states = {tuple(tree.tokens[r, i].tolist()) for i in range(n + 1)}
            assert len(states) == n + 1  # no duplicate states, none equal to the root
            for i in range(1, n + 1):
                p = int(tree.parent[r, i])
                assert 0 <= p < i and tree.valid[r, p]
                added = tree.path[r, i] & ~tree.path[r, p]
                assert int(added.sum()) == 1 and (tree.path[r, p] <= tree.path[r, i]).all()  # parent is a prefix
                pos = int(added.nonzero())
                assert ctx.masked[r, pos]  # commits only at positions the root has masked
                differ = (tree.tokens[r, i] != tree.tokens[r, p]).nonzero().flatten().tolist()
                assert differ == [pos]
                assert int(tree.tokens[r, i, pos]) in top2[r, pos].tolist()
                saw_second |= int(tree.tokens[r, i, pos]) == int(top2[r, pos, 1])
                # Root + commits: the root's committed positions are untouched.
                keep = ~tree.path[r, i]
                assert torch.equal(tree.tokens[r, i][keep], ctx.root[r][keep])
                assert int(tree.depth[r, i]) == int(tree.path[r, i].sum()) == int(tree.depth[r, p]) + 1
                assert 0 < tree.mass[r, i] <= tree.mass[r, p]  # masses decrease along paths
                assert floor is None or tree.mass[r, i] >= floor
            masses = tree.mass[r, 1 : 1 + n]
            assert (masses[1:] <= masses[:-1]).all()  # best-first: nodes are added heaviest first
            ref = _reference_tree(order_model, ctx, r, D, floor)
            got = {tuple(tree.tokens[r, i].tolist()): float(tree.mass[r, i]) for i in range(1, n + 1)}
            assert got.keys() == ref.keys()
            assert all(abs(got[s] - ref[s]) < 1e-5 for s in got)
    assert saw_inactive and saw_second, "the test should see finished rows and second token hypotheses"


def test_a_trained_order_model_saves_forwards(model, order_model):
    cfg = BlockDecodeConfig(max_new_tokens=3 * 4, rule="static")
    ids, mask = _left_pad(_prompts((4, 8, 5, 7), seed=9))
    plain = decode_blocks(model, ids, mask, cfg)
    spot = decode_blocks(model, ids, mask, cfg, drafter=SpotDrafter(order_model, 8))
    assert spot.tokens == plain.tokens
    assert spot.nfe < plain.nfe
    # At most one plain forward per block plus one verification forward per further step the tree missed.
    assert sum(spot.commits_per_forward) / spot.nfe > 1.3


def test_bad_settings_are_refused(order_model):
    with pytest.raises(ValueError, match="budget"):
        SpotDrafter(order_model, 0)
    with pytest.raises(ValueError, match="top_k"):
        SpotDrafter(order_model, 4, top_k=32)
    with pytest.raises(ValueError, match="prefix_mass_floor"):
        SpotDrafter(order_model, 4, prefix_mass_floor=1.5)


def test_an_order_model_for_another_rule_or_threshold_is_refused(model, order_model):
    """The commit order of static and of threshold at one tau are different things to learn: decoding with another
    one would stay exact but draft badly, so it is refused with the command that trains the right model."""
    ids, mask = _left_pad(_prompts((6,)))
    as_trained = OrderModel(OrderModelConfig(**{**vars(order_model.config), "rule": "threshold", "threshold": 0.05}))
    as_trained.load_state_dict(order_model.state_dict())
    drafter = SpotDrafter(as_trained, 4)
    same = BlockDecodeConfig(max_new_tokens=MAX_NEW, rule="threshold", threshold=0.05)
    assert decode_blocks(model, ids, mask, same, drafter=drafter).tokens == decode_blocks(model, ids, mask, same).tokens
    for cfg, what in (
        (BlockDecodeConfig(max_new_tokens=MAX_NEW, rule="threshold", threshold=0.1), "threshold 0.05 .decoding 0.1."),
        (
            BlockDecodeConfig(max_new_tokens=MAX_NEW, rule="static"),
            "rule 'threshold' .decoding 'static'.*stage.rule=static",
        ),
    ):
        with pytest.raises(OrderModelMismatchError, match=what):
            decode_blocks(model, ids, mask, cfg, drafter=SpotDrafter(as_trained, 4))
    # a model that recorded no rule (trained in memory, or saved before rules were recorded) is not checked
    assert order_model.config.rule is None
    decode_blocks(model, ids, mask, BlockDecodeConfig(max_new_tokens=MAX_NEW, rule="threshold", threshold=0.1),
                  drafter=SpotDrafter(order_model, 4))  # fmt: skip


def test_an_order_model_for_smaller_blocks_is_refused_before_it_drafts(model, order_model):
    ids, mask = _left_pad(_prompts((6,)))
    small = OrderModel(OrderModelConfig(**{**vars(order_model.config), "max_block": model.config.block_size - 1}))
    with pytest.raises(OrderModelMismatchError, match=rf"blocks have {model.config.block_size}.*stage.max_block="):
        decode_blocks(model, ids, mask, BlockDecodeConfig(max_new_tokens=MAX_NEW), drafter=SpotDrafter(small, 4))
