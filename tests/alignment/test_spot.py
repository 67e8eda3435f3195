"""SPOT training data and order-model training: examples from hand-made traces are exactly the specified ones, the
split is by prompt and deterministic, and a small order model learns a commit order the stale confidence misses.
Run: ``python -m pytest tests/alignment/test_spot.py``."""

import numpy as np
import pytest
import torch

from streakline.alignment.block_traces import BlockTrace, TraceStep, collect_traces
from streakline.alignment.spot import (
    SpotTrainConfig,
    build_examples,
    confidence_baseline,
    evaluate,
    split_by_prompt,
    train_order_model,
)
from streakline.decoding.block_diffusion import BlockDecodeConfig
from streakline.models.order_model import OrderModelConfig
from tests.decoding.test_block_diffusion import _model, _prompts

MASK = 99
MICRO = OrderModelConfig(top_k=4, d_model=32, layers=1, heads=4, ffn=64, max_block=8)


pytestmark = pytest.mark.usefixtures("one_thread")


def _trace(order: list[list[int]], probs: np.ndarray, prompt: int = 0, conf: np.ndarray | None = None) -> BlockTrace:
    """A trace of one block whose steps commit the positions ``order[t]`` (token = 10 + position), with stale
    top-k ``probs[t]`` ``[L, k]``; ``conf[t]`` the rule's confidences (default: all 0.5)."""
    L = probs.shape[1]
    state = np.full(L, MASK, dtype=np.int64)
    masked = np.ones(L, dtype=bool)
    steps = []
    for t, positions in enumerate(order):
        commit = np.zeros(L, dtype=bool)
        commit[positions] = True
        after = state.copy()
        after[positions] = 10 + np.asarray(positions)
        steps.append(
            TraceStep(
                masked=masked.copy(),
                commit=commit,
                tokens=after,
                confidence=np.full(L, 0.5, np.float32) if conf is None else conf[t].astype(np.float32),
                topk_ids=np.zeros((L, probs.shape[2]), dtype=np.int64),
                topk_probs=probs[t].astype(np.float32),
            )
        )
        state, masked = after, masked & ~commit
    return BlockTrace(prompt=prompt, block=0, out_start=0, initial=np.full(L, MASK, dtype=np.int64), steps=steps)


def test_examples_of_a_hand_made_static_trace():
    L, k = 4, 2
    probs = np.random.default_rng(0).random((4, L, k))
    order = [[2], [0], [3], [1]]  # steps 0..3: S_0 -> S_4
    data = build_examples([_trace(order, probs, prompt=7)], horizon=2)
    # t in 0..2 (root S_{t+1} must still have a step), d in 0..1 with t + 1 + d <= 3.
    want = [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)]
    assert list(zip(data.step.tolist(), data.depth.tolist(), strict=True)) == want
    assert data.label.tolist() == [0, 3, 3, 1, 1]  # the commit of step t + 1 + d
    real = {0: [2], 1: [2, 0], 2: [2, 0, 3]}  # committed in the root S_{t+1}
    path = {(0, 0): [], (0, 1): [0], (1, 0): [], (1, 1): [3], (2, 0): []}  # steps t+1 .. t+d
    for i, (t, d) in enumerate(want):
        assert data.real[i].nonzero().flatten().tolist() == sorted(real[t])
        assert data.path[i].nonzero().flatten().tolist() == sorted(path[(t, d)])
        eligible = [p for p in range(L) if p not in real[t] and p not in path[(t, d)]]
        assert data.eligible[i].nonzero().flatten().tolist() == eligible
        assert data.eligible[i, data.label[i]]
        # The stale distribution is step t's (computed on S_t, one commit behind the root).
        np.testing.assert_array_equal(data.stale(torch.tensor([i]))[0].numpy(), probs[t].astype(np.float32))
    assert set(data.prompt.tolist()) == {7}
    # The stale-confidence baseline: the eligible position with the highest rank-0 probability.
    for i in range(len(data)):
        top = np.where(data.eligible[i].numpy(), probs[data.step[i].item(), :, 0], -np.inf)
        assert confidence_baseline(data)[i].item() == int(np.argmax(top))


def test_multi_commit_steps_label_their_most_confident_position():
    L, k = 5, 2
    probs = np.full((3, L, k), 0.1)
    conf = np.zeros((3, L))
    conf[1, [1, 3]] = [0.4, 0.9]  # step 1 commits 1 and 3; 3 is the more confident
    conf[2, [2, 4]] = [0.7, 0.7]  # a tie goes to the lower position
    data = build_examples([_trace([[0], [1, 3], [2, 4]], probs, conf=conf)], horizon=3)
    assert list(zip(data.step.tolist(), data.depth.tolist(), strict=True)) == [(0, 0), (0, 1), (1, 0)]
    assert data.label.tolist() == [3, 2, 2]
    assert data.path[1].nonzero().flatten().tolist() == [1, 3]  # a multi-commit step puts all it commits on the path
    assert data.real[2].nonzero().flatten().tolist() == [0, 1, 3]


def test_examples_from_real_traces_and_the_split():
    cfg = BlockDecodeConfig(max_new_tokens=10, rule="static")
    prompts = [p.tolist() for p in _prompts((6, 3, 9, 5, 7, 4), seed=2)]
    traces = collect_traces(_model(), prompts, cfg, top_k=4)
    data = build_examples(traces, horizon=8)
    n_expected = sum(len(range(max(0, len(t.steps) - 1 - d))) for t in traces for d in range(8))
    assert len(data) == n_expected
    assert data.eligible[torch.arange(len(data)), data.label].all()
    train, held = split_by_prompt(data, 0.34, seed=3)
    assert len(train) + len(held) == len(data)
    assert not set(train.prompt.tolist()) & set(held.prompt.tolist())
    assert len(set(held.prompt.tolist())) == 2  # round(0.34 * 6)
    again, _ = split_by_prompt(data, 0.34, seed=3)
    assert torch.equal(again.prompt, train.prompt)
    with pytest.raises(ValueError, match="heldout_fraction"):
        split_by_prompt(data, 1.0, seed=0)


def _left_to_right_traces(n_prompts: int, L: int = 8, k: int = 4, seed: int = 0) -> list[BlockTrace]:
    """Blocks decoded strictly left to right while the stale probabilities are random: a commit order that the
    stale-confidence ranking gets right only by chance and that a model reading masks and positions can learn."""
    rng = np.random.default_rng(seed)
    traces = []
    for p in range(n_prompts):
        for _ in range(2):
            probs = np.sort(rng.dirichlet(np.ones(16), size=(L, L)), axis=-1)[..., ::-1][..., :k]
            traces.append(_trace([[i] for i in range(L)], probs, prompt=p))
    return traces


def test_a_micro_order_model_beats_the_confidence_ranking_on_a_learnable_order():
    data = build_examples(_left_to_right_traces(24), horizon=4)
    train, held = split_by_prompt(data, 0.25, seed=0)
    cfg = SpotTrainConfig(steps=60, batch_size=64, lr=3e-3, seed=0)
    model, metrics = train_order_model(train, held, MICRO, cfg, progress=False)
    h = metrics["heldout"]
    assert h["examples"] == len(held) and set(h["by_depth"]) == {"0", "1", "2", "3"}
    # Chance level: about 1 / (eligible positions), high only near the end of a block.
    assert h["baseline_accuracy"] < 0.6, "the stale confidence should not know this order"
    assert h["accuracy"] > 0.95 and h["accuracy"] > h["baseline_accuracy"] + 0.4
    for d in h["by_depth"].values():
        assert d["accuracy"] > d["baseline_accuracy"]
    assert metrics["parameters"] == model.num_parameters()
    assert evaluate(model, held) == h
    # Deterministic for a seed.
    twin, _ = train_order_model(train, None, MICRO, SpotTrainConfig(steps=5, seed=4), progress=False)
    again, _ = train_order_model(train, None, MICRO, SpotTrainConfig(steps=5, seed=4), progress=False)
    assert all(torch.equal(a, b) for a, b in zip(twin.state_dict().values(), again.state_dict().values(), strict=True))


def test_the_order_model_trains_on_the_device_it_is_given_from_cpu_draws():
    """``device`` moves only tensors: on the CPU a run equals one without the argument, bit for bit (the same
    initialisation, standardisation and batches), and a batch's features are built from the examples on the CPU and
    handed to the model where it is (``meta`` stands in for a GPU)."""
    from streakline.alignment.spot.train import _features
    from streakline.models.order_model import OrderModel

    train = build_examples(_left_to_right_traces(4), horizon=4)
    cfg = SpotTrainConfig(steps=5, seed=4)
    plain, _ = train_order_model(train, None, MICRO, cfg, progress=False)
    placed, _ = train_order_model(train, None, MICRO, cfg, progress=False, device=torch.device("cpu"))
    pairs = zip(plain.state_dict().values(), placed.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    features, eligible = _features(OrderModel(MICRO).to("meta"), train, torch.arange(3))
    assert features.device.type == eligible.device.type == "meta"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_order_model_learns_on_a_gpu():
    data = build_examples(_left_to_right_traces(24), horizon=4)
    train, held = split_by_prompt(data, 0.25, seed=0)
    cfg = SpotTrainConfig(steps=60, batch_size=64, lr=3e-3, seed=0)
    model, metrics = train_order_model(train, held, MICRO, cfg, progress=False, device="cuda")
    assert all(p.device.type == "cuda" for p in model.parameters())
    assert metrics["heldout"]["accuracy"] > 0.95 and evaluate(model, held) == metrics["heldout"]
