"""``Transformer.fuse_projections``: one q/k/v matrix and one gate/up matrix per layer give the unfused model's
outputs and tokens, and the state dict, a saved checkpoint and a loaded one keep the checkpoint's names.
Run: ``python -m pytest tests/models/test_fused.py``."""

import copy

import pytest
import torch

from streakline.decoding.speculative import SpecConfig, generate
from streakline.models import Transformer, load_pretrained, save_pretrained
from tests.models.helpers import tiny_config


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])  # no bias / q,k,v bias / per-head q,k norms
def test_fused_model_gives_the_same_logits_and_tokens(family):
    model = Transformer(tiny_config(family)).init_weights(seed=2, std=0.1).eval()
    fused = copy.deepcopy(model).fuse_projections()
    layer = fused.layers[0]
    assert layer.attn.qkv_proj is not None and not hasattr(layer.attn, "q_proj")
    assert layer.mlp.gate_up_proj is not None and not hasattr(layer.mlp, "up_proj")
    assert sum(p.numel() for p in fused.parameters()) == sum(p.numel() for p in model.parameters())  # no copy kept
    ids = torch.randint(0, 90, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(fused(ids), model(ids), rtol=1e-5, atol=1e-5)
    cfg = SpecConfig(max_new_tokens=12)
    assert generate(fused, ids.tolist(), cfg).tokens == generate(model, ids.tolist(), cfg).tokens


def test_fused_state_dict_saves_and_loads_under_the_checkpoint_names(tmp_path):
    model = Transformer(tiny_config("qwen2")).init_weights(seed=3).eval()
    fused = copy.deepcopy(model).fuse_projections()
    want, got = model.state_dict(), fused.state_dict()
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name
    save_pretrained(fused, tmp_path / "fused")
    back = load_pretrained(tmp_path / "fused")
    for name, t in want.items():
        assert torch.equal(back.state_dict()[name], t), name
    # an unfused state dict loads into a fused model
    other = Transformer(tiny_config("qwen2")).init_weights(seed=9).eval().fuse_projections()
    other.load_state_dict(model.state_dict())
    ids = torch.arange(1, 9)[None]
    with torch.no_grad():
        torch.testing.assert_close(other(ids), model(ids), rtol=1e-5, atol=1e-5)
