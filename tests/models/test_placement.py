"""models/placement.py: a model split over devices gives the one-device logits and tokens, and the plan is sized by
free memory. On CPU the two "devices" are ``cpu`` and ``cpu:0``: torch treats them as different devices, so every
hop between layer runs, the per-device KV-cache segments and their bookkeeping run as they would across GPUs (only
the copies are free)."""

import copy

import pytest
import torch

from streakline.config import compose_config
from streakline.decoding.drafters import DiffusionDrafter
from streakline.decoding.speculative import SpecConfig, generate
from streakline.decoding.vanilla import greedy_generate
from streakline.models import KVCache, build
from streakline.models.placement import place, plan_for, plan_layers
from tests.decoding.helpers import shifted_copy, verifier
from tests.models.helpers import tiny_config

TWO = [torch.device("cpu"), torch.device("cpu", 0)]


def test_layers_are_split_by_free_memory_with_at_least_one_each():
    cfg = tiny_config("qwen2", num_layers=8)
    layer = plan_layers(cfg, TWO, 4).layer_bytes
    plan = plan_layers(cfg, ["cuda:0", "cuda:1"], 4, free=[6 * layer, 2 * layer])
    assert plan.layer_devices == (torch.device("cuda:0"),) * 6 + (torch.device("cuda:1"),) * 2
    lopsided = plan_layers(cfg, ["cuda:0", "cuda:1", "cuda:2"], 4, free=[100 * layer, 0, 0])
    assert [lopsided.layer_devices.count(torch.device(f"cuda:{i}")) for i in range(3)] == [6, 1, 1]
    assert plan_layers(cfg, TWO, 4).layer_devices == (TWO[0],) * 4 + (TWO[1],) * 4  # unknown free memory: halves
    assert plan.describe().startswith("layers 0-5 on cuda:0 (") and "layers 6-7 on cuda:1" in plan.describe()
    with pytest.raises(ValueError, match="9 devices for 8 layers"):
        plan_layers(cfg, ["cpu"] * 9, 4)


def test_a_model_over_two_devices_gives_the_same_logits_cache_and_tokens():
    model = verifier(seed=3).eval()
    placed = place(copy.deepcopy(model), plan_layers(model.config, TWO, 4))
    assert placed.layer_devices.count(TWO[1]) == model.config.num_layers // 2
    cache = KVCache.for_model(placed, 2, capacity=8)
    assert [d for _, d in cache.segments] == TWO  # one key/value tensor per device
    ids = torch.tensor([[0, 5, 9, 2, 7], [3, 1, 4, 1, 5]])
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    with torch.no_grad():
        assert torch.equal(placed(ids, attention_mask=mask), model(ids, attention_mask=mask))
    prompts = [[5, 9, 2], [3, 1, 4, 1, 5, 9]]
    assert greedy_generate(placed, prompts, 12) == greedy_generate(model, prompts, 12)
    # speculative decoding with K > 1 commits draft-tree paths through the cache's gather, segment by segment
    spec = SpecConfig(max_new_tokens=12, gamma=3, K=3)
    drafter = shifted_copy(model)
    got = generate(placed, prompts, spec, drafter=DiffusionDrafter(drafter)).tokens
    assert got == generate(model, prompts, spec, drafter=DiffusionDrafter(drafter)).tokens


def test_a_preset_with_devices_is_built_placed_and_refused_when_it_cannot_fit(micro_world, capsys):
    root = micro_world[0]
    cfg = compose_config(["stage=decode", "model=micro", f"run_root={root}", "model.verifier.devices=[cpu,cpu]"])
    from streakline.world import attach_world

    attach_world(cfg, progress=False)
    placed = build(cfg.model.verifier, "verifier")
    assert "model.verifier: layers 0-1 on cpu (0.0 GB)" in capsys.readouterr().out  # one device named twice: one run
    assert placed.layer_devices == [torch.device("cpu")] * 2
    cfg.model.verifier.devices = None
    alone = build(cfg.model.verifier, "verifier")
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.equal(placed(ids), alone(ids))
    from streakline.models.kv_cache import MemoryLimitError

    huge = tiny_config("qwen2", num_layers=4, hidden_size=2**15, intermediate_size=2**17, num_heads=64, num_kv_heads=8)
    with pytest.raises(MemoryLimitError, match="the weights need .* GiB but the 1 devices have"):
        plan_for(huge, ["cpu", "cpu"], torch.float32)
