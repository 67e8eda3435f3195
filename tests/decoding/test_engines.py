"""The static KV cache engine gives the eager engine's tokens, token for token, in every decoder that uses a cache.

``engine="static"`` keeps a fixed capacity and fixed shapes (the layout the CUDA graphs replay, ``models/graphs.py``):
keys past the cache length are masked instead of sliced off, slots are written by ``index_copy_``. The graphs
themselves need a GPU (``bench/gpu.sh`` runs them); what they replay is exactly the static forward tested here.
Checked at temperature 0 and, with the same seeds, at temperature 1; ragged batches whose rows finish at different
times (eos) leave the batch mid-decode. Run: ``python -m pytest tests/decoding/test_engines.py``.
"""

import copy

import pytest
import torch

from streakline.decoding.block_diffusion import BlockDecodeConfig, decode_blocks
from streakline.decoding.drafters import ARDrafter, DiffusionDrafter
from streakline.decoding.speculative import SpecConfig, generate
from streakline.decoding.spot import SpotDrafter
from streakline.decoding.vanilla import greedy_generate
from streakline.models import KVCache
from streakline.models.kv_cache import STATIC_ROUND, resolve_engine
from streakline.models.order_model import OrderModel
from tests.decoding.helpers import V, causal_copy, random_drafter, shifted_copy, verifier
from tests.decoding.test_block_diffusion import MAX_NEW, _left_pad, _model
from tests.decoding.test_block_diffusion import _prompts as _block_prompts
from tests.decoding.test_spot import MICRO

N_NEW = 16


def _prompts(batch: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, V - 1, (n,), generator=g).tolist() for n in [6, 1, 9, 3][:batch]]


def _drafters(model):
    yield "vanilla", None, 1, "greedy_acceptance"
    yield "ar_draft", ARDrafter(causal_copy(model, seed=7), temperature=1.0), 1, "leviathan"
    yield "diffusion_K1", DiffusionDrafter(shifted_copy(model), temperature=1.5), 1, "greedy_acceptance"
    yield "diffusion_K4", DiffusionDrafter(shifted_copy(model), temperature=1.5), 4, "greedy_acceptance"
    yield "diffusion_K4_multidraft", DiffusionDrafter(random_drafter(seed=5)), 4, "multidraft_leviathan"
    yield "diffusion_full_K2", DiffusionDrafter(shifted_copy(model, "full")), 2, "greedy_acceptance"


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["T0", "T1"])
@pytest.mark.parametrize("batch", [1, 4])
def test_static_engine_gives_the_eager_tokens(batch, temperature):
    model = verifier(seed=0)
    prompts = _prompts(batch)
    eos = 4  # a common token of this vocabulary: rows stop at different cycles and leave the batch
    for name, drafter, K, acceptance in _drafters(model):
        runs = {}
        for engine in ("eager", "static"):
            cfg = SpecConfig(max_new_tokens=N_NEW, gamma=4, K=K, temperature=temperature, acceptance=acceptance,
                             eos_token_id=eos, seed=11, engine=engine)  # fmt: skip
            runs[engine] = generate(model, prompts, cfg, drafter=drafter)
        eager, static = runs["eager"], runs["static"]
        assert static.tokens == eager.tokens, (name, batch, temperature)
        assert static.finish_reasons == eager.finish_reasons
        assert static.metrics.nfe == eager.metrics.nfe and static.metrics.cycles == eager.metrics.cycles
    if batch == 4 and temperature == 0.0:  # the eos really made rows leave early, so that path was exercised
        assert "eos" in eager.finish_reasons and "length" in eager.finish_reasons


def test_static_engine_greedy_generate_and_padding():
    model = verifier(seed=1)
    prompts = _prompts(4)
    assert greedy_generate(model, prompts, 12, engine="static") == greedy_generate(model, prompts, 12, engine="eager")


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["T0", "T1"])
@pytest.mark.parametrize("rule", ["static", "threshold"])
def test_static_engine_block_decoders(rule, temperature):
    model = _model()
    ids, mask = _left_pad(_block_prompts())
    torch.manual_seed(0)
    order_model = OrderModel(MICRO).double().eval()  # untrained: its trees are poor, the output must not care
    out = {}
    for engine in ("eager", "static"):
        cfg = BlockDecodeConfig(max_new_tokens=MAX_NEW, rule=rule, threshold=0.05, temperature=temperature, seed=3,
                                engine=engine)  # fmt: skip
        plain = decode_blocks(model, ids, mask, cfg)
        # SPOT's tree verification (an explicit mask over the cached prefix plus the copies of the block)
        spot = decode_blocks(model, ids, mask, cfg, drafter=SpotDrafter(order_model, budget=4))
        out[engine] = (plain.tokens, plain.nfe, spot.tokens, spot.nfe)
    assert out["static"] == out["eager"]
    assert out["static"][2] == out["static"][0]  # and SPOT stays lossless on the static engine


def test_static_cache_is_fixed_pooled_and_grows_only_when_outgrown():
    model = verifier(seed=0)
    cache = KVCache.for_model(model, 2, capacity=10, engine="static")
    assert cache.static and cache.capacity == STATIC_ROUND  # rounded up: similar prompts share a pooled cache
    k_before = cache.k
    pos = torch.arange(3).expand(2, 3)
    model.hidden(torch.ones(2, 3, dtype=torch.long), position_ids=pos, cache=cache)
    assert cache.length == 3 and cache.k is k_before  # written in place, never reallocated
    # in use: a second request gets another cache; released: the same one comes back, emptied
    other = KVCache.for_model(model, 2, capacity=100, engine="static")
    assert other is not cache
    cache.release()
    again = KVCache.for_model(model, 2, capacity=100, engine="static")
    assert again is cache and again.length == 0 and not bool(again.valid.any())
    assert KVCache.for_model(model, 3, capacity=100, engine="static") is not cache  # another batch size
    assert copy.deepcopy(model).__dict__["_cache_pool"] == []  # a copy of the model starts without the original's
    # outgrown (a speculative batch whose rows keep different lengths): new, doubled tensors and a new version, so
    # graphs recorded on the old tensors are dropped; what was cached is kept
    model.hidden(torch.ones(2, 3, dtype=torch.long), position_ids=pos, cache=again)
    k3 = again.k[:, :, :, :3].clone()
    again.begin(torch.zeros(2, STATIC_ROUND, dtype=torch.long), None)
    assert again.capacity == 2 * STATIC_ROUND and again.version == 1 and again.k is not k_before
    assert torch.equal(again.k[:, :, :, :3], k3)
    eager = KVCache.for_model(model, 2, capacity=10, engine="eager")
    assert not eager.static and eager.capacity == 10


def test_engine_resolution():
    model = verifier(seed=0)
    assert resolve_engine(model, "auto") == "eager"  # a CPU model
    assert resolve_engine(model, "static") == "static"
    with pytest.raises(ValueError, match="needs the model on one CUDA device"):
        resolve_engine(model, "graphs")
    with pytest.raises(ValueError, match="unknown decoder engine"):
        resolve_engine(model, "turbo")
    model.engine = "static"  # what a stage sets from decoder.engine
    assert resolve_engine(model) == "static" and resolve_engine(model, "eager") == "eager"


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (bench/gpu.sh runs it)")


@cuda
@pytest.mark.parametrize("batch", [1, 4])
def test_cuda_graphs_give_the_eager_tokens(batch):
    """On a GPU: every decoder replays CUDA graphs (verify forwards, AR steps, prefix-causal windows, the bucketed
    full-attention window) and must give the eager engine's tokens; graphs were really captured and reused."""
    model = verifier(seed=0).cuda()
    prompts = _prompts(batch)
    for name, drafter, K, acceptance in _drafters(model):
        if drafter is not None:
            drafter.model.cuda()
        runs = {}
        for engine in ("eager", "graphs", "graphs"):  # the second graphs run reuses the pooled cache's graphs
            cfg = SpecConfig(max_new_tokens=N_NEW, gamma=4, K=K, temperature=0.0, acceptance=acceptance,
                             eos_token_id=4, seed=11, engine=engine)  # fmt: skip
            runs.setdefault(engine, []).append(generate(model, prompts, cfg, drafter=drafter).tokens)
        assert runs["graphs"][0] == runs["graphs"][1] == runs["eager"][0], name
    pool = model.__dict__["_cache_pool"]
    assert any(c.graphs is not None and c.graphs.captures > 0 for c in pool)


@cuda
def test_cuda_graphs_block_decoders():
    model = _model().float().cuda()
    ids, mask = (t.cuda() for t in _left_pad(_block_prompts()))
    out = {}
    for engine in ("eager", "graphs"):
        cfg = BlockDecodeConfig(max_new_tokens=MAX_NEW, rule="threshold", threshold=0.05, engine=engine)
        out[engine] = decode_blocks(model, ids, mask, cfg).tokens
    assert out["graphs"] == out["eager"]
