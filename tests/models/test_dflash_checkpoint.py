"""DFlash checkpoints (``streakline/models/dflash_checkpoint.py``): the ``speculators`` layout written and read back
exactly, the keys and weight names vLLM and ``speculators`` expect, the paper authors' layout read with its layer ids
shifted, clear refusals of what the drafter cannot run, and exports that never leave a half-written folder. No
network; the comparison with the ``speculators`` package itself is ``tests/models/test_dflash_speculators.py``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from streakline.models import Transformer, TransformerConfig, save_pretrained
from streakline.models.checkpoint import CheckpointError
from streakline.models.dflash import DFlashConfig, DFlashModel, packed_blocks
from streakline.models.dflash_checkpoint import (
    MOVING_NOTE,
    SPECULATORS_VERSION,
    is_dflash_folder,
    load_dflash,
    read_dflash_config,
    save_dflash,
    weight_names,
)

V, H = 97, 32
MASK = V - 1
BLOCK = 5
AUX = (1, 3)

pytestmark = pytest.mark.usefixtures("one_thread")


def _verifier(seed: int = 0) -> Transformer:
    cfg = TransformerConfig(
        vocab_size=V, hidden_size=H, intermediate_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
        family="qwen3", qk_norm=True, tie_embeddings=False,
    )  # fmt: skip
    return Transformer(cfg).init_weights(seed=seed).eval()


def _shapes(**overrides) -> TransformerConfig:
    # built the way read_dflash_config builds it, so a read-back config compares equal as a whole; head_dim != H /
    # heads, rope_theta and eps not the defaults, so a value lost on the way shows
    base = dict(
        vocab_size=V, hidden_size=H, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=12,
        rope_theta=5000.0, rms_norm_eps=1e-5, max_position_embeddings=256, qk_norm=True, tie_embeddings=False,
        attention="full", family="qwen3", mask_token_id=MASK,
    )  # fmt: skip
    base.update(overrides)
    return TransformerConfig(**base)


def _drafter(seed: int = 1, *, verifier_name: str | None = "Qwen/Qwen3-8B", **overrides) -> DFlashModel:
    cfg = DFlashConfig(
        layers=_shapes(**overrides), target_layer_ids=AUX, block_size=BLOCK, mask_token_id=MASK, verifier=verifier_name
    )
    model = DFlashModel(cfg).init_weights(seed=seed, std=0.2)
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():  # every norm different and away from 1: a swapped or dropped norm changes the logits
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
    return model.eval()


def _packed_logits(drafter: DFlashModel, verifier: Transformer) -> torch.Tensor:
    """Logits of three packed blocks (one at anchor 0, without context) over a 16-token context."""
    ids = torch.randint(0, V - 1, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        feats = verifier.hidden(ids, aux_layers=drafter.dflash.target_layer_ids)[1]
        anchors = torch.tensor([[0, 6, 10], [2, 7, 11]])
        block_ids, block_pos, mask = packed_blocks(
            ids, anchors, drafter.dflash.block_size, drafter.dflash.mask_token_id
        )
        pos = torch.arange(16).expand(2, 16)
        return drafter(block_ids, block_pos, features=feats, feature_pos=pos, attn_mask=mask)


def _config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def _edit_config(folder: Path, edit) -> None:
    raw = _config(folder)
    edit(raw)
    (folder / "config.json").write_text(json.dumps(raw))


def _edit_weights(folder: Path, edit) -> None:
    state = load_file(folder / "model.safetensors")
    edit(state)
    save_file(state, folder / "model.safetensors")


@pytest.fixture
def export(tmp_path) -> Path:
    return save_dflash(_drafter(), tmp_path / "dflash", verifier_name="Qwen/Qwen3-8B")


# ------------------------------------------------------------------------------------------------ round trip
def test_save_load_round_trip_is_exact(tmp_path):
    verifier = _verifier()
    drafter = _drafter(verifier_name="Qwen/Qwen3-8B")
    folder = save_dflash(drafter, tmp_path / "dflash")  # the verifier name comes from the config
    assert folder == (tmp_path / "dflash").absolute()
    loaded = load_dflash(folder)
    assert loaded.dflash.layers == drafter.dflash.layers  # every shape, rope theta, eps, ...
    for key in ("target_layer_ids", "block_size", "mask_token_id", "target_hidden_size", "verifier"):
        assert getattr(loaded.dflash, key) == getattr(drafter.dflash, key), key
    assert loaded.dflash.verifier == "Qwen/Qwen3-8B"
    ours, theirs = drafter.state_dict(), loaded.state_dict()
    assert ours.keys() == theirs.keys()
    # built on the meta device and given the file's tensors: nothing left unloaded, every parameter still trainable
    assert all(p.device.type == "cpu" and p.requires_grad for p in loaded.parameters())
    assert not list(loaded.buffers()) and loaded.training
    for name in ours:
        assert ours[name].dtype == theirs[name].dtype == torch.float32
        assert torch.equal(ours[name], theirs[name]), name
    loaded.share(verifier).eval()
    drafter.share(verifier)
    assert torch.equal(_packed_logits(loaded, verifier), _packed_logits(drafter, verifier))


def test_the_weights_are_an_ordinary_file(tmp_path):
    """Not safetensors' 0600: a serving container running as another user reads the export."""
    import os
    import stat

    umask = os.umask(0o022)
    try:
        folder = save_dflash(_drafter(), tmp_path / "dflash")
    finally:
        os.umask(umask)
    assert stat.S_IMODE((folder / "model.safetensors").stat().st_mode) == 0o644


def test_a_verifier_named_by_a_local_path_says_how_to_rename_it(tmp_path):
    """A hub id travels with the folder; a local path does not, so the export says how to set another."""
    hub = save_dflash(_drafter(), tmp_path / "hub", verifier_name="Qwen/Qwen3-8B")
    assert not (hub / MOVING_NOTE).exists()
    verifier_folder = tmp_path / "verifier"
    verifier_folder.mkdir()
    local = save_dflash(_drafter(), tmp_path / "local", verifier_name=str(verifier_folder))
    note = (local / MOVING_NOTE).read_text()
    assert str(verifier_folder) in note and "speculators_config" in note and "name_or_path" in note
    # the command it gives works: pasted into the export folder, it names the new verifier
    command = next(line.strip() for line in note.splitlines() if line.strip().startswith("python -c"))
    subprocess.run(command.replace("python", sys.executable, 1), shell=True, cwd=local, check=True)
    config = json.loads((local / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert load_dflash(local).dflash.verifier == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_dtype_is_kept_or_converted(tmp_path):
    folder = save_dflash(_drafter().to(torch.bfloat16), tmp_path / "bf16")
    assert _config(folder)["dtype"] == "bfloat16"
    assert load_dflash(folder).fc.weight.dtype == torch.bfloat16
    assert load_dflash(folder, dtype=torch.float32).fc.weight.dtype == torch.float32


def test_saving_again_replaces_the_export(tmp_path):
    folder = save_dflash(_drafter(seed=1), tmp_path / "dflash")
    second = _drafter(seed=2)
    save_dflash(second, folder)
    assert torch.equal(load_dflash(folder).fc.weight, second.fc.weight)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dflash"]  # nothing left beside it


# ------------------------------------------------------------------------------------------------ the format
def test_config_has_the_speculators_keys(tmp_path):
    folder = save_dflash(
        _drafter(), tmp_path / "dflash", verifier_name="Qwen/Qwen3-8B", verifier_architecture="Qwen3ForCausalLM"
    )
    raw = _config(folder)
    assert raw["architectures"] == ["DFlashDraftModel"]
    assert raw["speculators_model_type"] == "dflash"
    assert raw["speculators_version"] == SPECULATORS_VERSION
    assert raw["aux_hidden_state_layer_ids"] == list(AUX)
    assert "target_layer_ids" not in raw and "dflash_config" not in raw  # the authors' keys, not speculators'
    assert raw["block_size"] == BLOCK
    assert raw["mask_token_id"] == MASK
    assert raw["draft_vocab_size"] == V  # the whole vocabulary: no t2d/d2t
    assert raw["target_hidden_size"] == H
    assert raw["sample_from_anchor"] is False and raw["tie_word_embeddings"] is False
    assert raw["dtype"] == "float32"
    spec = raw["speculators_config"]
    assert spec["algorithm"] == "dflash"
    assert spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"] == [
        {"proposal_type": "greedy", "speculative_tokens": BLOCK - 1, "verifier_accept_k": 1, "accept_tolerance": 0.0}
    ]
    assert spec["verifier"] == {"name_or_path": "Qwen/Qwen3-8B", "architectures": ["Qwen3ForCausalLM"]}
    layer = raw["transformer_layer_config"]
    expected = {
        "model_type": "qwen3", "vocab_size": V, "hidden_size": H, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 12, "hidden_act": "silu",
        "rms_norm_eps": 1e-5, "attention_bias": False, "max_position_embeddings": 256,
        "layer_types": ["full_attention", "full_attention"], "tie_word_embeddings": False,
    }  # fmt: skip
    assert {k: layer.get(k) for k in expected} == expected
    assert layer["rope_parameters"]["rope_theta"] == 5000.0
    assert layer["rope_parameters"].get("rope_type", "default") == "default"


def test_weights_have_exactly_the_speculators_names(export):
    state = load_file(export / "model.safetensors")
    per_layer = [
        "input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
        "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
        "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    ]  # fmt: skip
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    expected |= {f"layers.{i}.{name}" for i in range(2) for name in per_layer}
    assert set(state) == expected  # no embed_tokens, lm_head, t2d, d2t: the verifier's own are used
    assert set(weight_names(_drafter().dflash).values()) == expected
    shapes = {
        "fc.weight": (H, len(AUX) * H),
        "hidden_norm.weight": (H,),
        "norm.weight": (H,),
        "layers.0.self_attn.q_proj.weight": (4 * 12, H),
        "layers.0.self_attn.k_proj.weight": (2 * 12, H),
        "layers.0.self_attn.o_proj.weight": (H, 4 * 12),
        "layers.0.self_attn.k_norm.weight": (12,),
        "layers.1.mlp.gate_proj.weight": (48, H),
        "layers.1.mlp.down_proj.weight": (H, 48),
    }
    for name, shape in shapes.items():
        assert tuple(state[name].shape) == shape, name


def test_stored_embedding_and_head_copies_are_ignored(export):
    """Releases before 0.8 stored the verifier's embedding and head beside the drafter's weights."""
    before = load_dflash(export).state_dict()

    def add_copies(state):
        state["embed_tokens.weight"] = torch.randn(V, H)
        state["lm_head.weight"] = torch.randn(V, H)

    _edit_weights(export, add_copies)
    after = load_dflash(export).state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_is_dflash_folder(tmp_path, export):
    assert is_dflash_folder(export)
    assert not is_dflash_folder(save_pretrained(_verifier(), tmp_path / "verifier"))
    assert not is_dflash_folder(tmp_path / "nowhere")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    assert not is_dflash_folder(tmp_path / "broken")


# ------------------------------------------------------------------------------------------------ authors' format
@pytest.mark.parametrize("block_inside", [False, True], ids=["block_size_top_level", "block_size_in_dflash_config"])
def test_authors_format_loads_with_layer_ids_one_higher(tmp_path, block_inside):
    """A ``z-lab/*-DFlash`` folder written by hand: Qwen3 keys at the top level, ``dflash_config`` with the layer
    ids numbered from the output of layer 0 (older checkpoints put ``block_size`` at the top, newer ones inside)."""
    verifier = _verifier()
    source = _drafter(seed=5).share(verifier)
    folder = tmp_path / "zlab"
    folder.mkdir()
    dflash_config = {"mask_token_id": MASK, "target_layer_ids": [i - 1 for i in AUX]}
    raw = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "vocab_size": V, "hidden_size": H,
        "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 12, "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 5000.0,
        "max_position_embeddings": 256, "attention_bias": False, "tie_word_embeddings": False,
        "layer_types": ["full_attention", "full_attention"], "num_target_layers": 4, "dflash_config": dflash_config,
        "torch_dtype": "float32",
    }  # fmt: skip
    if block_inside:
        dflash_config["block_size"] = BLOCK
    else:
        raw["block_size"] = BLOCK
    (folder / "config.json").write_text(json.dumps(raw))
    params = source.state_dict()
    save_file(
        {theirs: params[ours] for ours, theirs in weight_names(source.dflash).items()}, folder / "model.safetensors"
    )

    assert is_dflash_folder(folder)
    loaded = load_dflash(folder)
    assert loaded.dflash.target_layer_ids == AUX  # [0, 2] in the authors' numbering
    assert loaded.dflash.block_size == BLOCK and loaded.dflash.mask_token_id == MASK
    assert loaded.dflash.layers == source.dflash.layers
    assert loaded.dflash.verifier is None
    loaded.share(verifier).eval()
    assert torch.equal(_packed_logits(loaded, verifier), _packed_logits(source, verifier))


# ------------------------------------------------------------------------------------------------ refusals
def test_a_draft_vocabulary_is_stored_as_speculators_stores_it(tmp_path):
    """A drafter over N of the V tokens writes ``draft_vocab_size`` N, its N-row head ``lm_head.weight`` and the
    ``t2d``/``d2t`` maps, and reads back with the same vocabulary and the same logits."""
    from streakline.models.draft_vocab import DraftVocab

    verifier = _verifier()
    vocab = DraftVocab.from_counts(torch.arange(V).flip(0), 40, keep=[MASK])  # the 39 lowest ids and the mask
    drafter = _drafter().share(verifier).use_vocab(vocab)
    assert torch.equal(drafter.lm_head.weight, verifier.output_weight[vocab.ids])  # the verifier's rows, frozen
    assert not drafter.lm_head.weight.requires_grad
    folder = save_dflash(drafter, tmp_path / "dflash")
    assert _config(folder)["draft_vocab_size"] == 40
    state = load_file(folder / "model.safetensors")
    assert state["lm_head.weight"].shape == (40, H) and state["t2d"].dtype == torch.bool
    assert torch.equal(torch.arange(40) + state["d2t"], vocab.ids)  # speculators' convention
    loaded = load_dflash(folder).share(verifier).eval()
    assert torch.equal(loaded.draft_vocab.ids, vocab.ids) and loaded.dflash.draft_vocab_size == 40
    logits = _packed_logits(loaded, verifier)
    assert logits.shape[-1] == 40 and torch.equal(logits, _packed_logits(drafter, verifier))
    full = loaded.target_logits(logits)
    assert torch.equal(full[..., vocab.ids], logits) and int(torch.isfinite(full).sum(-1).max()) == 40


def test_refuses_a_draft_vocabulary_without_its_maps_or_with_broken_ones(tmp_path, export):
    _edit_config(export, lambda raw: raw.update(draft_vocab_size=32))
    with pytest.raises(CheckpointError, match=r"drafts over 32 of 97 tokens but holds no t2d/d2t maps"):
        load_dflash(export)
    from streakline.models.draft_vocab import DraftVocab

    folder = save_dflash(_drafter().share(_verifier()).use_vocab(DraftVocab(torch.arange(10), V)), tmp_path / "dv")
    _edit_weights(folder, lambda state: state.update(d2t=state["d2t"] + 1))
    with pytest.raises(CheckpointError, match="draft vocabulary maps are damaged"):
        load_dflash(folder)


def test_identity_maps_of_a_full_vocabulary_are_read_and_others_refused(export):
    def add_maps(state):  # what a full-vocabulary checkpoint of some writers carries: the identity
        state["t2d"] = torch.ones(V, dtype=torch.bool)
        state["d2t"] = torch.zeros(V, dtype=torch.long)

    _edit_weights(export, add_maps)
    assert load_dflash(export).draft_vocab is None
    _edit_weights(export, lambda state: state["t2d"].__setitem__(slice(0, 5), False))
    with pytest.raises(CheckpointError, match="drafts over the whole vocabulary"):
        load_dflash(export)


def test_refuses_sliding_window_layers(export):
    def slide(raw):
        raw["transformer_layer_config"]["layer_types"] = ["sliding_attention", "full_attention"]
        raw["transformer_layer_config"]["sliding_window"] = 2048

    _edit_config(export, slide)
    with pytest.raises(CheckpointError, match="sliding-window draft layers"):
        read_dflash_config(export)


def test_refuses_a_missing_weight(export):
    _edit_weights(export, lambda state: state.pop("layers.1.mlp.down_proj.weight"))
    with pytest.raises(CheckpointError, match=r"lacks the weights \['layers\.1\.mlp\.down_proj\.weight'\]"):
        load_dflash(export)


def test_refuses_weights_that_do_not_fit_the_config(export):
    _edit_config(export, lambda raw: raw["transformer_layer_config"].update(intermediate_size=40))
    with pytest.raises(CheckpointError, match="has shape"):
        load_dflash(export)


def test_refuses_a_config_without_a_mask_token(export):
    _edit_config(export, lambda raw: raw.update(mask_token_id=None))
    with pytest.raises(CheckpointError, match="mask_token_id"):
        load_dflash(export)


# Layers that speculators 0.9.0 builds from these keys but DFlashModel does not: read as if absent, they draft other
# logits without a word (measured against speculators: max |diff| 0.30 for llama3 rope, 0.16 for attention_bias,
# 0.07 for gelu). speculators' trainer copies rope and activation from the verifier (a Llama-3.1 verifier: llama3
# rope). Each must be refused with the reason.


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("rope_parameters", {"rope_type": "llama3", "rope_theta": 5000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64}, "rope"),
        ("attention_bias", True, "attention_bias"),
        ("hidden_act", "gelu_pytorch_tanh", "hidden_act"),
    ],
    ids=["rope_scaling", "attention_bias", "activation"],
)  # fmt: skip
def test_refuses_layers_it_does_not_implement(export, key, value, match):
    _edit_config(export, lambda raw: raw["transformer_layer_config"].update({key: value}))
    try:
        load_dflash(export)
    except CheckpointError as e:
        assert match in str(e)
    else:
        raise AssertionError(f"loaded a drafter with {key}={value!r} as if it had not")


def test_refuses_weights_it_would_not_use(export):
    """A tensor the drafter has no place for (here the q_proj bias an attention_bias checkpoint holds) means the
    checkpoint is not what its config says or not what this model implements; ignoring it changes the logits."""
    _edit_weights(export, lambda state: state.update({"layers.0.self_attn.q_proj.bias": torch.ones(48)}))
    try:
        load_dflash(export)
    except CheckpointError as e:
        assert "q_proj.bias" in str(e)
    else:
        raise AssertionError("ignored layers.0.self_attn.q_proj.bias")


def test_refuses_a_drafter_that_samples_from_the_anchor(export):
    """``sample_from_anchor: true`` (DSpark-style training) makes slot k the draft for position p + k + 1, one later
    than DFlashModel's drafting assumes."""
    _edit_config(export, lambda raw: raw.update(sample_from_anchor=True))
    try:
        load_dflash(export)
    except CheckpointError as e:
        assert "sample_from_anchor" in str(e)
    else:
        raise AssertionError("loaded a sample_from_anchor drafter as a DFlash one")


def test_refuses_what_is_not_a_dflash_checkpoint(tmp_path, export):
    with pytest.raises(CheckpointError, match="not a DFlash drafter's config"):
        load_dflash(save_pretrained(_verifier(), tmp_path / "verifier"))  # a plain Hugging Face model
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="not a DFlash checkpoint folder"):
        load_dflash(tmp_path / "empty")
    (export / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no .safetensors weights"):
        load_dflash(export)


# ------------------------------------------------------------------------------------------------ safe exports
def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_a_drafter_without_qwen3_layers_is_refused_and_the_old_export_kept(tmp_path, export):
    before = _snapshot(export)
    plain = DFlashModel(DFlashConfig(layers=_shapes(qk_norm=False), target_layer_ids=AUX, block_size=BLOCK,
                                     mask_token_id=MASK, verifier="Qwen/Qwen3-8B"))  # fmt: skip
    with pytest.raises(CheckpointError, match="qk_norm=False"):
        save_dflash(plain, export)
    assert _snapshot(export) == before
    assert [p.name for p in tmp_path.iterdir()] == ["dflash"]


def test_a_failed_write_never_replaces_a_good_export(tmp_path, export, monkeypatch):
    import safetensors.torch

    before = _snapshot(export)

    def half_written(state, path, metadata=None):
        Path(path).write_bytes(b"half a file")
        raise OSError("No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", half_written)
    from streakline.errors import DiskFullError

    with pytest.raises(DiskFullError, match="the disk is full: writing model.safetensors"):
        save_dflash(_drafter(seed=9), export)
    assert _snapshot(export) == before
    assert [p.name for p in tmp_path.iterdir()] == ["dflash"]  # the temporary folder is gone too
    monkeypatch.undo()
    assert torch.equal(load_dflash(export).fc.weight, _drafter().fc.weight)


def test_an_export_names_its_verifier(tmp_path):
    """vLLM and speculators load the target (and the embedding and head the drafter drafts with) from the name the
    export records; an export without one would serve nothing, so it is refused."""
    with pytest.raises(ValueError, match="verifier's hub id or path"):
        save_dflash(_drafter(verifier_name=None), tmp_path / "nameless")
    assert not (tmp_path / "nameless").exists()


def test_a_full_disk_ends_an_export_in_one_line_and_keeps_the_earlier_one(tmp_path, small_disk):
    """safetensors reports a full disk in its own error type; the export says it in the project's one line, removes
    its half-written copy, and the export it was replacing still loads."""
    from streakline.errors import DiskFullError

    size = sum(p.stat().st_size for p in save_dflash(_drafter(seed=1), tmp_path / "probe").iterdir())
    disk = small_disk(size * 3 // 2 // 1024 + 8)  # room for one export, not for a second beside it
    first = save_dflash(_drafter(seed=1), disk / "dflash")
    with pytest.raises(DiskFullError, match=r"the disk is full: writing model\.safetensors in .* free there"):
        save_dflash(_drafter(seed=2), disk / "dflash")
    assert sorted(p.name for p in disk.iterdir()) == ["dflash"]  # no half-written copy left beside it
    assert torch.equal(load_dflash(first).fc.weight, _drafter(seed=1).fc.weight)


# ------------------------------------------------------------------------------------------------ its tokenizer
@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """A small trained tokenizer and a copy with its ids shuffled: the same strings, other ids (the same size, so
    only the recorded hash can tell them apart)."""
    from streakline.data.corpora.math import math_texts
    from streakline.data.tokenizer import train_tokenizer
    from streakline.models.tokenizer import load_tokenizer
    from tests.models.helpers import permuted_tokenizer

    root = tmp_path_factory.mktemp("tok")
    a = train_tokenizer([r["text"] for r in math_texts("train", 200, seed=0)], root / "a", vocab_size=300)
    permuted_tokenizer(a, root / "b")
    return load_tokenizer(a), load_tokenizer(root / "b")


def test_an_export_records_its_tokenizer_and_is_refused_under_another(tmp_path, tokenizers):
    """The export records the hash and size of the tokenizer its ids are in, beside speculators' own keys; a load
    with that tokenizer passes and one with the permuted copy is refused in one line naming both hashes and the fix
    (issue 62, item 1). An export that records none (a published drafter, an older export) loads under any."""
    from streakline.models.dflash_checkpoint import TOKENIZER_FIELD, TokenizerMismatchError, recorded_tokenizer
    from streakline.models.tokenizer import tokenizer_hash

    mine, other = tokenizers
    assert tokenizer_hash(mine) != tokenizer_hash(other) and len(mine) == len(other)
    folder = save_dflash(_drafter(), tmp_path / "dflash", tokenizer=mine)
    raw = json.loads((folder / "config.json").read_text())
    assert raw[TOKENIZER_FIELD] == {"hash": tokenizer_hash(mine), "vocab_size": len(mine)}
    assert raw["speculators_model_type"] == "dflash"  # speculators' keys untouched beside it
    assert recorded_tokenizer(folder) == raw[TOKENIZER_FIELD]
    loaded = load_dflash(folder, tokenizer=mine)
    assert torch.equal(loaded.fc.weight, load_dflash(folder).fc.weight)
    with pytest.raises(TokenizerMismatchError) as refused:
        load_dflash(folder, tokenizer=other)
    message = str(refused.value)
    assert "\n" not in message and tokenizer_hash(mine) in message and tokenizer_hash(other) in message
    assert "stage=distill" in message and str(folder) in message

    plain = save_dflash(_drafter(), tmp_path / "plain")
    assert recorded_tokenizer(plain) is None
    load_dflash(plain, tokenizer=other)  # nothing recorded: nothing to refuse
