"""Model-state memory against DeepSpeed's own estimators, and the other byte counts against what they count.

Run: python -m pytest tests/planning/test_memory.py -q
"""

import re
from functools import cache

import pytest
import torch
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_cold
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs_all_cold

from streakline.config import compose_config
from streakline.models import KVCache, Transformer, TransformerConfig
from streakline.planning import memory
from streakline.planning.shapes import build_meta, shape_of

# (overrides, role): DiffuCoder-7B and Qwen2.5-72B at their published shapes, built on the meta device
SHAPES = {"7b": (["model=diffucoder"], "drafter"), "72b": (["model=qwen2.5-72b"], "verifier")}
# world sizes: one GPU, one node, four nodes of eight
WORLDS = [(1, 1), (8, 1), (8, 4)]


@cache  # one compose and one meta build per shape for the whole module
def _meta(which):
    overrides, role = SHAPES[which]
    cfg = compose_config(["stage=plan", *overrides])
    model = build_meta(cfg, role)
    return model, shape_of(model, role, cfg.model[role].name)


def _reference_counts(model):
    """(total, largest module) from the config alone: the project's shape formula, and the larger of the
    vocabulary matrix and an MLP matrix. (DeepSpeed's ``model_to_params`` cannot count a meta model: it dedupes
    parameters by ``data_ptr()``, which is 0 for every meta tensor.)"""
    c = model.config
    return c.num_parameters(), max(c.vocab_size * c.hidden_size, c.hidden_size * c.intermediate_size)


def _deepspeed_gib(printed: str, options: str) -> float:
    """The per-GPU GB column of the estimator's printed row for ``options`` (DeepSpeed prints bytes / 2**30)."""
    for line in printed.splitlines():
        if line.strip().endswith(options):
            return float(re.findall(r"([\d.]+)GB", line)[1])
    raise AssertionError(f"no row {options!r} in {printed!r}")


@pytest.mark.parametrize("which", sorted(SHAPES))
def test_the_meta_build_has_the_published_parameter_count(which):
    model, shape = _meta(which)
    assert next(model.parameters()).device.type == "meta"
    # counted from the built modules, equal to what the config alone says
    assert (shape.params, shape.largest_module) == _reference_counts(model)
    expected = {"7b": 7.6e9, "72b": 72.7e9}[which]  # DiffuCoder-7B 7.62B, Qwen2.5-72B 72.7B
    assert abs(shape.params - expected) / expected < 0.01


@pytest.mark.parametrize("which", sorted(SHAPES))
@pytest.mark.parametrize(("gpus", "nodes"), WORLDS)
def test_zero2_model_states_match_deepspeed_within_5_percent(which, gpus, nodes, capsys):
    model, shape = _meta(which)
    total, _ = _reference_counts(model)
    estimate_zero2_model_states_mem_needs_all_cold(total_params=total, num_gpus_per_node=gpus, num_nodes=nodes)
    reference = _deepspeed_gib(capsys.readouterr().out, "offload_optimizer=none")
    ours = sum(memory.model_states(shape, zero_stage=2, world=gpus * nodes).values()) / 2**30
    assert abs(ours - reference) / reference < 0.05, (ours, reference)


@pytest.mark.parametrize("which", sorted(SHAPES))
@pytest.mark.parametrize(("gpus", "nodes"), WORLDS)
def test_zero3_model_states_match_deepspeed_within_5_percent(which, gpus, nodes, capsys):
    model, shape = _meta(which)
    total, largest = _reference_counts(model)
    estimate_zero3_model_states_mem_needs_all_cold(
        total_params=total, largest_layer_params=largest, num_gpus_per_node=gpus, num_nodes=nodes
    )
    reference = _deepspeed_gib(capsys.readouterr().out, "offload_param=none, offload_optimizer=none, zero_init=1")
    ours = sum(memory.model_states(shape, zero_stage=3, world=gpus * nodes).values()) / 2**30
    assert abs(ours - reference) / reference < 0.05, (ours, reference)


def test_zero_stages_partition_what_they_should():
    _, shape = _meta("7b")
    one, many = (memory.model_states(shape, zero_stage=z, world=32) for z in (0, 2))
    assert one["weights"] == many["weights"] == 2 * shape.params  # ZeRO-2 keeps whole weights
    assert many["optimizer"] * 32 >= one["optimizer"] > many["optimizer"] * 31
    three = memory.model_states(shape, zero_stage=3, world=32)
    # ZeRO-3 partitions them too, keeping only the gathered working set (two copies of the 545M-parameter head)
    assert three["weights"] < many["weights"] / 5
    lora = memory.model_states(shape, zero_stage=2, world=1, trainable=shape.params // 100)
    assert lora["optimizer"] == 12 * (shape.params // 100) and lora["weights"] == 2 * shape.params


def test_kv_cache_bytes_are_what_a_real_cache_allocates():
    """The formula against the project's own KVCache at a small shape, eager (the capacity asked for) and static
    (rounded up to its slot multiple)."""
    cfg = TransformerConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4, num_kv_heads=2
    )
    model = Transformer(cfg).to(torch.bfloat16)
    shape = shape_of(model, "verifier", "small")
    for engine, static in (("eager", False), ("static", True)):
        cache = KVCache.for_model(model, batch_size=5, capacity=40, engine=engine)
        allocated = sum(t.numel() * t.element_size() for t in (*cache.ks, *cache.vs))
        assert memory.kv_cache(shape, batch=5, positions=40, static=static) == allocated, engine


def test_checkpointing_keeps_fewer_activations():
    _, shape = _meta("7b")
    full = memory.activations(shape, tokens=4096, checkpointing=False)
    kept = memory.activations(shape, tokens=4096, checkpointing=True)
    assert kept < full / 5
    # linear in tokens: twice the tokens, twice the bytes
    assert memory.activations(shape, tokens=8192, checkpointing=False) == 2 * full


def _saved_bytes(model, ids, **kwargs):
    """Bytes of the tensors autograd keeps for backward in a training forward (storages counted once, the
    parameters left out): what the activation formula estimates."""
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.hidden(ids, **kwargs)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in seen.items() if ptr not in params)


def test_activations_are_what_autograd_saves():
    """A real bf16 training forward of the project's Transformer (GQA, q/k/v bias, SwiGLU), measured by autograd's
    saved-tensor hooks. 15%: the formula leaves out small tensors (the norms' rsqrt, the rotary tables) and the
    attention kernel's own statistics. (The checkpointed form, measured the same way, was 7% under the formula's
    inputs-only part too; it is not a test because torch's non-reentrant checkpoint imports torch._dynamo, seconds
    of CPU on every run.)"""
    cfg = TransformerConfig(
        vocab_size=256, hidden_size=128, intermediate_size=352, num_layers=4, num_heads=4, num_kv_heads=2, qkv_bias=True
    )
    model = Transformer(cfg).init_weights(0).to(torch.bfloat16).train()
    ids = torch.randint(0, cfg.vocab_size, (3, 50))
    shape = shape_of(model, "drafter", "small")
    planned = memory.activations(shape, tokens=ids.numel(), checkpointing=False)
    saved = _saved_bytes(model, ids)
    assert abs(planned - saved) / saved < 0.15, (planned, saved)


def test_an_explicit_mask_is_kept_as_a_bias_by_every_layer_on_cpu():
    """SDPA on CPU turns a boolean mask into a float bias at every layer's call and autograd keeps each one for that
    layer's backward: what the saved tensors gain with the mask is ``layers`` biases of ``[rows, 1, S, S]`` in the
    compute dtype (bench/plan_peaks.py found them as the gap between the plan and a CPU distill)."""
    cfg = TransformerConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4,
                            num_kv_heads=2)  # fmt: skip
    model = Transformer(cfg).init_weights(0).train()  # fp32, as trainer=cpu trains
    rows, length = 2, 40
    ids = torch.randint(0, cfg.vocab_size, (rows, length))
    mask = torch.ones(length, length, dtype=torch.bool).tril().expand(rows, length, length).contiguous()
    biases = _saved_bytes(model, ids, attn_mask=mask) - _saved_bytes(model, ids)
    planned = memory.attention_mask_bytes(rows=rows, length=length, explicit=True, bias_layers=3, bias_bytes=4)
    assert biases == planned - mask.numel()  # the boolean mask itself is the batch's, not autograd's
