"""DFlash training from stored verifier features (``method.features=stored``, docs/dflash.md, Offline features):
features written with ``data.features.write_features`` beside real shards, read back by ``StoredFeatures`` into
``TrajectoryWindows`` batches, give ``DFlashTrainModule`` the loss and gradients of online training (exactly with
float32 features, within float16 rounding with half precision) without a verifier forward; wrong files are refused.

    python -m pytest tests/alignment/test_dflash_offline.py -q
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from streakline.alignment.data import TrajectoryWindows
from streakline.alignment.dflash import DFlashTrainModule, verifier_features
from streakline.alignment.losses import LossSettings
from streakline.data.features import (
    FeatureMeta,
    StoredFeatures,
    check_features,
    feature_bytes,
    feature_name,
    write_features,
)
from streakline.data.trajectories import (
    ShardMeta,
    TrajectoryError,
    load_trajectories,
    write_shard,
)
from tests.alignment.test_dflash_training import BLOCK, MASK, _drafter, _rows, _verifier

pytestmark = pytest.mark.usefixtures("one_thread")

TOK = "0123456789ab"


def _store(folder, rows: dict[str, list], verifier, layers, dtype, *, num_shards: int = 2, batch_size: int = 3):
    """The rows as ``num_shards`` real trajectory shards with their feature files, as stage=trajectories writes
    them; returns the metas of the feature files."""
    n = len(rows["prompt_ids"])
    metas = []
    for s in range(num_shards):
        idx = range(s * n // num_shards, (s + 1) * n // num_shards)
        shard_rows = [
            {"prompt_id": f"p{i}", "sample_index": 0, "seed": 0, "finish_reason": "length",
             "prompt_ids": rows["prompt_ids"][i], "completion_ids": rows["completion_ids"][i]}
            for i in idx
        ]  # fmt: skip
        meta = ShardMeta(s, num_shards, len(idx), TOK, "hand-built", 0, "cfg")
        seqs = [r["prompt_ids"] + r["completion_ids"] for r in shard_rows]
        feats = verifier_features(verifier, seqs, layers, batch_size=batch_size, dtype=dtype)
        fmeta = FeatureMeta(s, num_shards, len(idx), tuple(layers), verifier.config.hidden_size, "cfg")
        write_features(folder, feats, fmeta)
        write_shard(folder, shard_rows, meta)
        metas.append(fmeta)
    return metas


def _loss_and_grads(module, batch):
    module.zero_grad()
    loss, _ = module(batch)
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in module.drafter.named_parameters()}


# float32, one shard, every trajectory one whole example: the stored features come from a verifier forward of the
# same shapes as the online one, so training must agree bit for bit. float16, two shards and other batching: within
# the rounding of half precision (the verifier forwards of other shapes differ by ~1e-7 besides).
CASES = [(torch.float32, 0.0, 1, 20), (torch.float16, 2e-3, 2, 5)]


@pytest.mark.parametrize(("dtype", "tol", "shards", "per_seq"), CASES)
@pytest.mark.parametrize("loss", ["dflash_ce", "ce_streak"])
def test_stored_features_train_like_the_online_verifier(tmp_path, monkeypatch, dtype, tol, shards, per_seq, loss):
    verifier = _verifier()
    module = DFlashTrainModule(_drafter(verifier), verifier, LossSettings(name=loss, chunk=13), temperature=0.8)
    layers = module.drafter.dflash.target_layer_ids
    _store(tmp_path, _rows(), verifier, layers, dtype, num_shards=shards, batch_size=4 if shards == 1 else 3)
    dataset = load_trajectories(tmp_path)
    online_windows = TrajectoryWindows(dataset, gamma=BLOCK - 1, mask_id=MASK, windows_per_seq=per_seq)
    stored = StoredFeatures(tmp_path)
    offline_windows = TrajectoryWindows(
        dataset, gamma=BLOCK - 1, mask_id=MASK, windows_per_seq=per_seq, features=stored
    )
    examples = list(range(len(online_windows)))
    online_batch, offline_batch = online_windows.collate(examples), offline_windows.collate(examples)
    assert online_batch.features is None and offline_batch.features.dtype == dtype
    assert offline_batch.features.shape == (*offline_batch.clean.shape, len(layers) * verifier.config.hidden_size)
    # padding carries zeros, real tokens the verifier's states
    assert not offline_batch.features[~offline_batch.pad_valid].any()

    online = _loss_and_grads(module, online_batch)
    # offline, the verifier never runs: its forward would fail here
    monkeypatch.setattr(verifier, "hidden", lambda *a, **k: pytest.fail("a verifier forward in offline training"))
    offline = _loss_and_grads(module, offline_batch)
    torch.testing.assert_close(offline[0], online[0], rtol=tol, atol=tol)
    for name, grad in online[1].items():
        torch.testing.assert_close(offline[1][name], grad, rtol=tol * 10, atol=tol, msg=name)
    if dtype == torch.float16:  # the comparison can fail: fp16 rounding moves the loss, a little
        assert offline[0].item() != online[0].item()


@pytest.mark.parametrize("loss", ["dflash_ce", "ce_streak"])
def test_padding_to_a_multiple_trains_like_the_longest_row(tmp_path, loss):
    """Stored features padded with zeros to trainer.pad_multiple: the loss and every gradient are the unpadded
    batch's, to float32 rounding (padding is never attended and never labelled)."""
    verifier = _verifier()
    module = DFlashTrainModule(_drafter(verifier), verifier, LossSettings(name=loss, chunk=13), temperature=0.8)
    _store(tmp_path, _rows(), verifier, module.drafter.dflash.target_layer_ids, torch.float32)
    dataset, stored = load_trajectories(tmp_path), StoredFeatures(tmp_path)
    batches = []
    for multiple in (1, 32):
        windows = TrajectoryWindows(dataset, gamma=BLOCK - 1, mask_id=MASK, windows_per_seq=5, features=stored,
                                    pad_multiple=multiple)  # fmt: skip
        batches.append(windows.collate(list(range(len(windows)))))
    plain, padded = batches
    assert padded.clean.shape[1] == 32 > plain.clean.shape[1]
    assert padded.features.shape[:2] == padded.clean.shape and not padded.features[~padded.pad_valid].any()
    want, got = _loss_and_grads(module, plain), _loss_and_grads(module, padded)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    for name, grad in want[1].items():
        torch.testing.assert_close(got[1][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_features_of_other_layers_or_rows_are_refused(tmp_path):
    verifier = _verifier()
    layers = (1, 3)
    metas = _store(tmp_path, _rows(), verifier, layers, torch.float16)
    stored = StoredFeatures(tmp_path)
    assert stored.layers == layers and stored.rows == 4 and stored.hidden == verifier.config.hidden_size
    assert check_features(tmp_path / feature_name(0, 2), metas[0]) is None
    other = FeatureMeta(0, 2, 2, (1, 2), metas[0].hidden, "cfg")
    assert "other settings (layers" in check_features(tmp_path / feature_name(0, 2), other)
    # a drafter of other layers cannot read them (the width says so)
    module = DFlashTrainModule(_drafter(verifier), verifier, LossSettings(name="dflash_ce"))
    windows = TrajectoryWindows(load_trajectories(tmp_path), gamma=BLOCK - 1, mask_id=MASK, features=stored)
    batch = windows.collate([0, 1])
    batch.features = batch.features[..., : verifier.config.hidden_size]
    with pytest.raises(ValueError, match=r"store those layers \(data.feature_layers\)"):
        module(batch)
    # a teacher loss needs the verifier's logits, which features do not give
    module.settings = LossSettings(name="distillspec")
    with pytest.raises(ValueError, match="data.topk_logprobs"):
        module(windows.collate([0, 1]))
    # a truncated file is corrupt, a missing one leaves the set incomplete
    path = tmp_path / feature_name(1, 2)
    path.write_bytes(path.read_bytes()[:-7])
    assert check_features(path, metas[1]).startswith("corrupt")
    path.unlink()
    assert check_features(path, metas[1]) == "missing"
    with pytest.raises(TrajectoryError, match=r"features of shards \[1\] are missing.*data.feature_layers"):
        StoredFeatures(tmp_path)
    # bad arrays are refused before anything is written
    with pytest.raises(TrajectoryError, match="not finite"):
        write_features(tmp_path, [np.full((3, 64), np.inf, np.float16)] * 2, metas[0])
    with pytest.raises(TrajectoryError, match=r"expected \(tokens, 64\)"):
        write_features(tmp_path, [np.zeros((3, 32), np.float16)] * 2, metas[0])


def test_no_features_is_refused_with_the_fix(tmp_path):
    rows = _rows()
    write_shard(
        tmp_path,
        [{"prompt_id": "p", "sample_index": 0, "seed": 0, "finish_reason": "eos", "prompt_ids": p,
          "completion_ids": c} for p, c in zip(rows["prompt_ids"], rows["completion_ids"], strict=True)],
        ShardMeta(0, 1, 4, TOK, "hand-built", 0, "cfg"),
    )  # fmt: skip
    with pytest.raises(TrajectoryError, match=r"hold no verifier features; rerun stage=trajectories with data\."):
        StoredFeatures(tmp_path)


def test_feature_bytes_is_tokens_layers_hidden_two_bytes():
    # the worked sizes of docs/dflash.md: per token, 3 layers of SmolLM2-135M, 5 layers of a 72B verifier
    assert feature_bytes(1, 3, 576) == 3456
    assert feature_bytes(1, 5, 8192) == 81920
    assert feature_bytes(1000, 5, 8192, itemsize=4) == 2 * feature_bytes(1000, 5, 8192)
