"""SPOT's order model: features equal a direct computation, the size is the paper's, ineligible positions are
excluded, and checkpoints round-trip or fail clearly. Run: ``python -m pytest tests/models/test_order_model.py``."""

import math

import pytest
import torch

from streakline.models import CheckpointError
from streakline.models.order_model import OrderModel, OrderModelConfig, order_features

SMALL = OrderModelConfig(top_k=4, d_model=16, layers=1, heads=2, ffn=32, max_block=8)


def test_features_of_a_hand_made_distribution():
    # One block of L=3 positions, k=3 stale probabilities each (rank order; position 2's tail is empty).
    probs = torch.tensor([[[0.5, 0.3, 0.1], [0.2, 0.4, 0.0], [0.7, 0.2, 0.1]]])
    real = torch.tensor([[True, False, False]])
    path = torch.tensor([[False, True, False]])
    f = order_features(probs, real, path, torch.tensor([1]))
    assert f.shape == (1, 3, 2 * 3 + 10)
    for i in range(3):
        p = probs[0, i].tolist()
        logs = [math.log(max(x, 1e-6)) for x in p]
        entropy = -sum(x * lx for x, lx in zip(p, logs, strict=True))
        masked = float(i == 2)  # neither really committed nor on the path
        want = [
            *p,
            *logs,
            entropy,
            p[0] - p[1],  # margin of the ranked candidates (position 1: negative, its rank 0 is not the max)
            max(0.0, 1 - sum(p)),
            max(p),
            masked,
            i / 2,  # relative position
            1 / 3,  # fraction of the block masked in the hypothetical state
            1 / 8,  # depth 1 / DEPTH_SCALE
            float(i == 0),
            float(i == 1),
        ]
        torch.testing.assert_close(f[0, i], torch.tensor(want), atol=1e-6, rtol=0)


def test_features_pad_a_short_top_k():
    probs = torch.tensor([[[0.6, 0.4], [0.9, 0.1]]])
    no = torch.zeros(1, 2, dtype=torch.bool)
    f = order_features(probs, no, no, torch.tensor([0]), top_k=4)
    assert f.shape == (1, 2, 2 * 4 + 10)
    assert f[0, 0, :4].tolist() == pytest.approx([0.6, 0.4, 0.0, 0.0])
    assert f[0, 0, 6].item() == pytest.approx(math.log(1e-6))  # the padded probability's log is clamped


def test_default_size_is_about_0_6m_parameters():
    n = OrderModel(OrderModelConfig()).num_parameters()
    assert 550_000 < n < 650_000, n  # 612,993: the paper's ~0.6M
    assert OrderModelConfig().n_features == 74


def test_ineligible_positions_get_minus_inf_and_the_rest_a_distribution():
    torch.manual_seed(0)
    model = OrderModel(SMALL).eval()
    N, L = 3, 6
    probs = torch.rand(N, L, 4).softmax(-1)
    eligible = torch.rand(N, L) > 0.4
    eligible[:, 0] = True
    real = ~eligible & (torch.rand(N, L) > 0.5)
    path = ~eligible & ~real
    logits = model(order_features(probs, real, path, torch.tensor([0, 1, 2])), eligible)
    assert logits.shape == (N, L)
    assert torch.isneginf(logits[~eligible]).all() and torch.isfinite(logits[eligible]).all()
    q = logits.softmax(-1)
    torch.testing.assert_close(q.sum(-1), torch.ones(N))
    with pytest.raises(ValueError, match="max_block"):
        model(torch.zeros(1, 9, SMALL.n_features), torch.ones(1, 9, dtype=torch.bool))
    with pytest.raises(ValueError, match="width"):
        model(torch.zeros(1, 4, SMALL.n_features + 1), torch.ones(1, 4, dtype=torch.bool))


def test_save_load_round_trip_and_damaged_folders(tmp_path):
    torch.manual_seed(1)
    model = OrderModel(SMALL).eval()
    model.set_normalisation(torch.randn(50, SMALL.n_features) * 3 + 1)  # the standardisation travels too
    assert not torch.equal(model.feature_std, torch.ones(SMALL.n_features))
    model.save(tmp_path / "om")
    back = OrderModel.load(tmp_path / "om")
    assert back.config == SMALL and not back.training
    x = order_features(torch.rand(2, 5, 4), torch.zeros(2, 5, dtype=torch.bool), torch.zeros(2, 5, dtype=torch.bool),
                       torch.tensor([0, 3]))  # fmt: skip
    eligible = torch.ones(2, 5, dtype=torch.bool)
    torch.testing.assert_close(back(x, eligible), model(x, eligible), rtol=0, atol=0)

    with pytest.raises(CheckpointError, match="config.json is missing.*stage=spot"):
        OrderModel.load(tmp_path / "nowhere")
    (tmp_path / "om" / "model.safetensors").write_bytes(b"\x00" * 20)
    with pytest.raises(CheckpointError, match="damaged.*stage=spot"):
        OrderModel.load(tmp_path / "om")
    (tmp_path / "om" / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="weights.*missing"):
        OrderModel.load(tmp_path / "om")
    (tmp_path / "om" / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot be read"):
        OrderModel.load(tmp_path / "om")
    (tmp_path / "om" / "config.json").write_text('{"format": "something else"}')
    with pytest.raises(CheckpointError, match="not describe"):
        OrderModel.load(tmp_path / "om")
