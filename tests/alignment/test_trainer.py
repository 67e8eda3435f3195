"""The training module: online teacher logits per window equal the verifier on the trajectory, and on-policy windows
really replace the labels by drafter samples that the verifier then scores."""

import datasets
import torch

from streakline.alignment.data import TrajectoryWindows
from streakline.alignment.losses import LossSettings
from streakline.alignment.trainer import DraftTrainModule
from streakline.models import Transformer
from tests.models.helpers import VOCAB, tiny_config

MASK = VOCAB - 1


def _batch():
    g = torch.Generator().manual_seed(0)
    rows = {
        "prompt_id": [],
        "sample_index": [],
        "seed": [],
        "finish_reason": [],
        "prompt_ids": [],
        "completion_ids": [],
    }
    for i, (p, c) in enumerate([(5, 9), (3, 4), (7, 12)]):
        rows["prompt_id"].append(f"p{i}")
        rows["sample_index"].append(0)
        rows["seed"].append(0)
        rows["finish_reason"].append("eos")
        rows["prompt_ids"].append(torch.randint(0, MASK, (p,), generator=g).tolist())
        rows["completion_ids"].append(torch.randint(0, MASK, (c,), generator=g).tolist())
    windows = TrajectoryWindows(datasets.Dataset.from_dict(rows), gamma=4, mask_id=MASK, windows_per_seq=4)
    return next(windows.batches(3))


def _module(onpolicy_mix):
    drafter = Transformer(tiny_config("qwen2", attention="prefix_causal", mask_token_id=MASK)).init_weights(seed=1)
    verifier = Transformer(tiny_config("qwen2")).init_weights(seed=2, std=0.1).eval()
    settings = LossSettings(name="distillspec", divergence="fkl")
    return DraftTrainModule(drafter, settings, mask_id=MASK, verifier=verifier, onpolicy_mix=onpolicy_mix)


def test_per_window_teacher_equals_the_verifier_on_the_trajectory():
    module, batch = _module(0.0), _batch()
    keep = batch.window_valid.flatten()
    labels = batch.labels.flatten(0, 1)[keep]
    valid = batch.valid.flatten(0, 1)[keep]
    per_window = module._window_teacher_logits(batch, labels)
    whole = module._teacher_logits(batch)[keep]
    torch.testing.assert_close(per_window[valid], whole[valid], rtol=1e-5, atol=1e-5)


def test_onpolicy_windows_are_resampled_and_offpolicy_ones_are_not():
    batch = _batch()
    off, on = _module(0.0), _module(1.0)
    losses_off = [float(off(batch)[0].detach()) for _ in range(2)]
    assert losses_off[0] == losses_off[1]  # P's labels: nothing random
    torch.manual_seed(1)
    a = float(on(batch)[0].detach())
    torch.manual_seed(2)
    b = float(on(batch)[0].detach())
    assert a != b and a != losses_off[0]  # drafter samples as labels, a fresh draw each time
    torch.manual_seed(1)
    assert float(on(batch)[0].detach()) == a  # and seeded like everything else, so resume stays exact
