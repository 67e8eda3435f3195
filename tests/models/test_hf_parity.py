"""Parity of the transformer core with `transformers` for every supported family, both directions.

Export our random weights and load them with AutoModelForCausalLM; save a random `transformers` model and import
it here. Logits must agree within 1e-4 in fp32. Diffusion families (Dream: full attention; SDAR: block-causal) are
compared against the same weights loaded as their AR base class, given the equivalent 4D boolean mask.
"""

import json

import pytest
import torch
import transformers

from streakline.models import CheckpointError, Transformer, load_pretrained, read_config, save_pretrained
from tests.models.helpers import VOCAB, tiny_config

ATOL = 1e-4
HF_CONFIGS = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}


def _hf_load(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")


def _ids(B=2, T=13, seed=1):
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("tied", [False, True])
def test_export_loads_in_transformers_with_same_logits(tmp_path, family, tied):
    model = Transformer(tiny_config(family, tie_embeddings=tied)).init_weights(seed=3).eval()
    folder = save_pretrained(model, tmp_path / family)
    hf = _hf_load(folder).eval()
    ids = _ids()
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_import_of_transformers_checkpoint(tmp_path, family):
    c = tiny_config(family)
    kwargs = dict(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        rope_theta=c.rope_theta,
        rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=False,
    )
    if family == "qwen3":
        kwargs["head_dim"] = c.head_dim
    torch.manual_seed(5)
    hf = transformers.AutoModelForCausalLM.from_config(HF_CONFIGS[family](**kwargs), dtype=torch.float32).eval()
    # Sharded on purpose: the index path must work as well as the single file.
    hf.save_pretrained(tmp_path / "hf", max_shard_size="100KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    model = load_pretrained(tmp_path / "hf").eval()
    assert model.config.family == family
    assert model.config.rope_theta == c.rope_theta
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family,base", [("dream", "qwen2"), ("sdar", "qwen3")])
def test_diffusion_families_match_base_class_under_the_same_mask(tmp_path, family, base):
    cfg = tiny_config(family)
    model = Transformer(cfg).init_weights(seed=4).eval()
    hf = _hf_load(save_pretrained(model, tmp_path / "as_base", as_family=base)).eval()
    ids = _ids(T=10)
    T = ids.shape[1]
    if family == "dream":
        visible = torch.ones(T, T, dtype=torch.bool)
    else:
        blocks = torch.arange(T) // cfg.block_size
        visible = blocks[None, :] <= blocks[:, None]
    mask4d = visible.expand(ids.shape[0], 1, T, T)
    with torch.no_grad():
        ours = model(ids)
        theirs = hf(ids, attention_mask=mask4d).logits
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", ["dream", "sdar"])
def test_native_family_round_trip_keeps_behaviour(tmp_path, family):
    model = Transformer(tiny_config(family)).init_weights(seed=6).eval()
    folder = save_pretrained(model, tmp_path / family)
    raw = json.loads((folder / "config.json").read_text())
    assert raw["model_type"] == {"dream": "Dream", "sdar": "sdar"}[family]
    back = load_pretrained(folder).eval()
    assert back.config == model.config
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(back(ids), model(ids), atol=0, rtol=0)


def test_sharded_export_round_trip(tmp_path):
    model = Transformer(tiny_config("qwen2")).init_weights(seed=7).eval()
    folder = save_pretrained(model, tmp_path / "sharded", max_shard_bytes=40_000)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(load_pretrained(folder)(ids), model(ids), atol=0, rtol=0)
        torch.testing.assert_close(_hf_load(folder)(ids).logits, model(ids), atol=ATOL, rtol=0)


def test_export_replaces_folder_only_when_complete(tmp_path):
    good = Transformer(tiny_config("llama")).init_weights(seed=8)
    folder = save_pretrained(good, tmp_path / "ckpt")
    before = (folder / "model.safetensors").read_bytes()

    class Exploding:
        def save_pretrained(self, _):
            raise OSError("disk full")

    other = Transformer(tiny_config("llama")).init_weights(seed=9)
    with pytest.raises(OSError, match="disk full"):
        save_pretrained(other, folder, tokenizer=Exploding())
    assert (folder / "model.safetensors").read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temp folders left behind


def test_clear_errors_for_bad_folders(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(CheckpointError, match="not a supported family"):
        read_config(tmp_path)
    model = Transformer(tiny_config("qwen2")).init_weights(seed=1)
    folder = save_pretrained(model, tmp_path / "q")
    with pytest.raises(CheckpointError, match="lacks"):
        load_pretrained(folder, family="qwen3")
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_pretrained(folder)
    with pytest.raises(CheckpointError, match="qkv_bias"):
        save_pretrained(model, tmp_path / "as_llama", as_family="llama")


@pytest.mark.parametrize(
    "family,overrides",
    [("qwen2", {}), ("qwen2", {"attention": "prefix_causal"}), ("dream", {}), ("sdar", {}), ("llama", {})],
)
def test_transformers_max_diff_is_small_for_every_mode(family, overrides):
    from streakline.models import transformers_max_diff

    model = Transformer(tiny_config(family, **overrides)).init_weights(seed=12).eval()
    assert transformers_max_diff(model) < ATOL
    assert transformers_max_diff(model, seq_len=5, batch=1) < ATOL  # odd length: a block split mid-way
