"""Presets to models (tiny from scratch, local folders, hub ids that are not cached, DFlash drafters from a preset
or a folder) and tokenizer helpers."""

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from streakline.models import CheckpointError, Transformer, build, dflash_config, is_dflash, locate, save_pretrained
from streakline.models.dflash import DFlashModel, block_inputs
from streakline.models.dflash_checkpoint import save_dflash
from streakline.models.tokenizer import add_mask_token, load_tokenizer, mask_token_id, tokenizer_hash
from tests.models.helpers import tiny_config

TINY = {
    "name": "tiny-drafter",
    "family": "qwen2",
    "attention": "prefix_causal",
    "shift": False,
    "dtype": "float32",
    "arch": {
        "vocab_size": 300,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "qkv_bias": True,
        "tie_embeddings": True,
    },
}


def test_tiny_preset_builds_deterministically_with_its_behaviour():
    a, b = build(TINY, "drafter", seed=3), build(TINY, "drafter", seed=3)
    assert a.config.attention == "prefix_causal" and a.config.vocab_size == 300
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    assert not torch.equal(build(TINY, "drafter", seed=4).embed.weight, a.embed.weight)
    assert sum(p.numel() for p in a.parameters()) == a.config.num_parameters()


def test_local_folder_preset_applies_preset_behaviour(tmp_path):
    model = Transformer(tiny_config("qwen2")).init_weights(seed=1)
    folder = save_pretrained(model, tmp_path / "ckpt")
    preset = {"path": str(folder), "family": "auto", "attention": "full", "shift": True, "dtype": "float32"}
    loaded = build(preset, "drafter")
    assert loaded.config.attention == "full" and loaded.config.shift and loaded.config.family == "qwen2"
    ids = torch.randint(0, 97, (1, 6))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), model(ids, mode="full"), atol=0, rtol=0)


def test_a_folder_declares_its_own_family(tmp_path):
    """model.<role>.path=<folder>: the folder's config.json decides the layout, whatever the preset's family."""
    model = Transformer(tiny_config("qwen3")).init_weights(seed=2)
    folder = save_pretrained(model, tmp_path / "q3")
    preset = {"path": str(folder), "family": "qwen2", "attention": "causal", "dtype": "float32"}
    assert build(preset).config.family == "qwen3"


def test_locate_errors_name_the_fix(tmp_path):
    with pytest.raises(CheckpointError, match="model.verifier.path"):
        locate({"path": str(tmp_path)}, "verifier")
    with pytest.raises(CheckpointError, match="huggingface-cli download streakline-tests/absent"):
        locate({"hub_id": "streakline-tests/absent"}, "target")
    with pytest.raises(CheckpointError, match="no path, hub_id or arch"):
        locate({}, "drafter")


def _tokenizer_folder(tmp_path, with_mask=True):
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<unk>", "<|endoftext|>"] + (["<|mask|>"] if with_mask else [])
    tok.train_from_iterator(
        ["def f(x): return x + 1", "two plus two is four"] * 20,
        trainers.BpeTrainer(vocab_size=120, special_tokens=specials),
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|endoftext|>")
    fast.save_pretrained(tmp_path / "tok")
    return tmp_path / "tok"


def test_mask_token_lookup_and_errors(tmp_path):
    tok = load_tokenizer(_tokenizer_folder(tmp_path))
    assert tok.convert_ids_to_tokens(mask_token_id(tok, "<|mask|>")) == "<|mask|>"
    with pytest.raises(CheckpointError, match="model.drafter.mask_token"):
        mask_token_id(tok, "<|MASK|>")
    with pytest.raises(CheckpointError, match="no mask token"):
        mask_token_id(tok, None)
    with pytest.raises(CheckpointError, match="cannot load a tokenizer"):
        load_tokenizer(tmp_path / "nowhere")


def test_add_mask_token_uses_mean_embedding_and_changes_identity(tmp_path):
    tok = load_tokenizer(_tokenizer_folder(tmp_path, with_mask=False))
    before = tokenizer_hash(tok)
    assert tokenizer_hash(load_tokenizer(tmp_path / "tok")) == before
    model = Transformer(tiny_config("llama", vocab_size=len(tok))).init_weights(seed=2)
    mean_in, mean_out = model.embed.weight.mean(0).clone(), model.lm_head.weight.mean(0).clone()
    new_id = add_mask_token(model, tok, "<|mask|>")
    assert new_id == len(tok) - 1 and model.config.vocab_size == len(tok) and model.config.mask_token_id == new_id
    torch.testing.assert_close(model.embed.weight[new_id], mean_in)
    torch.testing.assert_close(model.lm_head.weight[new_id], mean_out)
    assert tokenizer_hash(tok) != before
    with torch.no_grad():
        assert model(torch.tensor([[new_id, 0]])).shape == (1, 2, len(tok))


# ------------------------------------------------------------------------------------------------- DFlash drafters
DFLASH = {
    "name": "test-dflash",
    "kind": "dflash",
    "family": "qwen3",
    "attention": "full",
    "shift": False,
    "mask_token": "<|mask|>",
    "block_size": 5,
    "target_layer_ids": [1, 2],
    "dtype": "float32",
    "arch": {
        "vocab_size": 120,
        "hidden_size": 64,
        "intermediate_size": 48,
        "num_layers": 1,
        "num_heads": 4,
        "num_kv_heads": 2,
        "qk_norm": True,
    },
}


def _dflash_verifier() -> Transformer:
    return Transformer(tiny_config("qwen2", vocab_size=120)).init_weights(seed=5)


def test_a_dflash_preset_builds_a_seeded_drafter_that_drafts_once_shared(tmp_path):
    tok = _tokenizer_folder(tmp_path)
    preset = {**DFLASH, "tokenizer": str(tok)}
    assert is_dflash(preset) and not is_dflash(TINY)
    a, b = build(preset, "drafter", seed=3), build(preset, "drafter", seed=3)
    assert isinstance(a, DFlashModel)
    assert a.dflash.target_layer_ids == (1, 2) and a.dflash.block_size == 5
    assert a.dflash.mask_token_id == load_tokenizer(tok).convert_tokens_to_ids("<|mask|>")
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    assert not torch.equal(build(preset, "drafter", seed=4).fc.weight, a.fc.weight)
    block = block_inputs(torch.tensor([7]), 5, a.dflash.mask_token_id)  # [1, 5]: the token, 4 masks
    with pytest.raises(RuntimeError, match=r"drafter.share\(verifier\)"):  # no embedding of its own
        a(block, torch.arange(5)[None])
    verifier = _dflash_verifier()
    with torch.no_grad():
        assert a.share(verifier)(block, torch.arange(5)[None]).shape == (1, 5, 120)
    frozen = build(preset, "drafter", inference=True)
    assert not frozen.training and not any(p.requires_grad for p in frozen.parameters())


def test_a_dflash_preset_without_the_verifiers_tokenizer_names_the_fix():
    with pytest.raises(CheckpointError, match="model.drafter.tokenizer"):
        build(DFLASH, "drafter")


def test_a_dflash_folder_builds_whatever_the_preset_and_a_wrong_folder_is_refused(tmp_path):
    preset = {**DFLASH, "tokenizer": str(_tokenizer_folder(tmp_path))}
    drafter = build(preset, "drafter", seed=1)
    folder = save_dflash(drafter, tmp_path / "dflash", verifier_name="test/verifier")
    plain = {**TINY, "path": str(folder)}  # a plain drafter preset pointed at a DFlash export: the folder decides
    for p in (plain, {**preset, "path": str(folder)}):
        assert is_dflash(p)
        loaded = build(p, "drafter")
        assert isinstance(loaded, DFlashModel) and loaded.dflash.verifier == "test/verifier"
        for (n, a), (_, b) in zip(loaded.state_dict().items(), drafter.state_dict().items(), strict=True):
            assert torch.equal(a, b), n
    with pytest.raises(CheckpointError, match=r"block_size=9 \(the folder: 5\)"):
        build({**preset, "path": str(folder), "block_size": 9}, "drafter")
    with pytest.raises(CheckpointError, match=r"target_layer_ids=\(0, 2\)"):
        dflash_config({**preset, "path": str(folder), "target_layer_ids": [0, 2]})
    transformer = save_pretrained(_dflash_verifier(), tmp_path / "plain")
    with pytest.raises(CheckpointError, match="holds no DFlash drafter"):
        build({**preset, "path": str(transformer)}, "drafter")
