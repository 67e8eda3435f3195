"""``export_like``: a retrained model written as a copy of its source checkpoint folder with only the weights replaced.

The sources are made by ``transformers`` itself (bf16, sharded, with the extra files a hub repository ships), so
the test is the drop-in promise: ``AutoModelForCausalLM.from_pretrained(export)`` loads what it loads from the
source, with the new weights, and the folder differs from the source in the weights and ``streakline.json`` only.
"""

import copy
import json

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from streakline.models import CheckpointError, Transformer, load_pretrained, save_pretrained
from streakline.models.export import PROVENANCE_NAME, export_like
from streakline.models.tokenizer import add_mask_token, load_tokenizer, tokenizer_hash
from tests.models.helpers import tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")

AUTO_MAP = {"AutoConfig": "configuration_dummy.DummyConfig", "AutoModelForCausalLM": "modeling_dummy.DummyForCausalLM"}
EXTRA = {
    "modeling_dummy.py": "# the remote code a hub repository ships beside its weights\n",
    "configuration_dummy.py": "# its configuration class\n",
    "README.md": "# a model card\n",
    "docs/notes.txt": "a subfolder travels too\n",
}


def _source(folder, *, vocab=384, tied=False, shard=True, tokenizer=None):
    """A bf16 Qwen2 checkpoint written by transformers, with auto_map, a generation config and extra files, plus
    files an export must not copy: a stale weight file in a subfolder and a hidden file."""
    config = transformers.Qwen2Config(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(7)
    transformers.Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(
        folder, max_shard_size="20KB" if shard else "1GB"
    )
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "auto_map": AUTO_MAP}, indent=2))
    (folder / "generation_config.json").write_text(json.dumps({"max_new_tokens": 7, "do_sample": False}))
    for name, text in EXTRA.items():
        (folder / name).parent.mkdir(exist_ok=True)
        (folder / name).write_text(text)
    (folder / "original").mkdir()
    (folder / "original" / "consolidated.00.pth").write_bytes(b"stale weights")
    (folder / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder


def _trained(folder):
    """The source loaded here in fp32 and nudged, as a few training steps would."""
    model = load_pretrained(folder, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-2 * torch.randn(p.shape, generator=gen))
    return model


def _tensors(folder):
    """name -> (file, dtype) of every tensor of a safetensors checkpoint folder."""
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            out.update({k: (path.name, f.get_slice(k).get_dtype()) for k in f.keys()})  # noqa: SIM118
    return out


def _files(folder):
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def _tokenizer(folder, n_merges=100):
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(
        ["def f(x): return x + 1", "two plus two is four"] * 20,
        trainers.BpeTrainer(vocab_size=n_merges, special_tokens=["<unk>", "<|endoftext|>"]),
    )
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|endoftext|>")
    fast.save_pretrained(folder)
    return load_tokenizer(folder)


def test_a_sharded_bf16_transformers_checkpoint_exports_as_a_drop_in_copy(tmp_path):
    src = _source(tmp_path / "src")
    model = _trained(src)
    out = export_like(model, tmp_path / "out", src, provenance={"step": 12, "method": {"loss": "streak"}})

    assert json.loads((out / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    for name in [*EXTRA, "generation_config.json"]:
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    # the same files (shard names too) but the stale weights and the hidden file, plus the provenance record
    assert _files(out) == sorted([*(f for f in _files(src) if not f.startswith(("original/", "."))), PROVENANCE_NAME])
    assert not (out / "original").exists() and not (out / ".gitattributes").exists()  # stale weights, hidden files

    # the source's tensor names, shard files (same tensors in each) and dtype
    theirs, ours = _tensors(src), _tensors(out)
    assert len({f for f, _ in theirs.values()}) > 2 and ours == theirs
    assert {d for _, d in ours.values()} == {"BF16"}
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {f for f, _ in theirs.values()}

    record = json.loads((out / PROVENANCE_NAME).read_text())
    assert record["source"] == str(src) and record["step"] == 12 and record["dtype"] == "bfloat16"
    assert record["model"]["attention"] == "causal"

    # transformers loads it as it loads the source (auto_map present, no remote code asked for) ...
    assert transformers.AutoModelForCausalLM.from_pretrained(out).dtype == (
        transformers.AutoModelForCausalLM.from_pretrained(src).dtype
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="sdpa")
    # ... with the new weights: our model rounded to bf16 the way the export was, computed in fp32 by both
    rounded = copy.deepcopy(model).to(torch.bfloat16).float()
    ids = torch.randint(0, 384, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(hf.eval()(ids).logits, rounded(ids), atol=1e-4, rtol=0)
        assert not torch.allclose(rounded(ids), load_pretrained(src)(ids).float(), atol=1e-3)  # not the old weights
    # and load_pretrained reads it back to the rounded weights
    back = load_pretrained(out, dtype=torch.float32).state_dict()
    for k, v in rounded.state_dict().items():
        assert torch.equal(back[k], v), k


def test_a_tied_source_that_carries_lm_head_keeps_its_key_set(tmp_path):
    src = _source(tmp_path / "src", tied=True, shard=False)
    weights = load_file(src / "model.safetensors")
    assert "lm_head.weight" not in weights  # transformers drops it for a tied model; some checkpoints keep it
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, src / "model.safetensors", metadata={"format": "pt"})

    model = _trained(src)
    out = export_like(model, tmp_path / "out", src)
    assert _files(out).count("model.safetensors") == 1 and not (out / "model.safetensors.index.json").exists()
    written = load_file(out / "model.safetensors")
    assert written.keys() == weights.keys()
    assert torch.equal(written["lm_head.weight"], written["model.embed_tokens.weight"])
    assert written["lm_head.weight"].dtype == torch.bfloat16
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.tensor([[1, 5, 9, 200, 383]])
    with torch.no_grad():
        torch.testing.assert_close(
            hf.eval()(ids).logits, copy.deepcopy(model).bfloat16().float()(ids), atol=1e-4, rtol=0
        )


def test_the_tokenizer_is_copied_unless_the_model_was_given_a_token(tmp_path):
    tok = _tokenizer(tmp_path / "tok")
    src = _source(tmp_path / "src", vocab=len(tok), shard=False, tokenizer=tok)
    model = _trained(src)

    same = export_like(model, tmp_path / "same", src, tokenizer=load_tokenizer(tmp_path / "tok"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (same / name).read_bytes() == (src / name).read_bytes(), name

    # a mask token added: one more embedding row (vocab_size follows it, nothing else) and the tokenizer that has it
    mask = add_mask_token(model, tok, "<|mask|>")
    grown = export_like(model, tmp_path / "grown", src, tokenizer=tok)
    raw, source_raw = json.loads((grown / "config.json").read_text()), json.loads((src / "config.json").read_text())
    assert raw.pop("vocab_size") == len(tok) == source_raw.pop("vocab_size") + 1 and raw == source_raw
    assert tokenizer_hash(load_tokenizer(grown)) == tokenizer_hash(tok) and load_tokenizer(grown).mask_token_id == mask
    assert load_pretrained(grown).config.vocab_size == len(tok)
    assert transformers.AutoModelForCausalLM.from_pretrained(grown).get_input_embeddings().weight.shape[0] == len(tok)


def test_a_save_pretrained_source_keeps_its_streakline_block_and_behaviour(tmp_path):
    # the tiny world's folders are written by save_pretrained: their config.json carries the behaviour block
    first = Transformer(tiny_config("qwen2", attention="prefix_causal", mask_token_id=96)).init_weights(seed=4)
    src = save_pretrained(first, tmp_path / "src", max_shard_bytes=30_000)
    model = _trained(src)
    out = export_like(model, tmp_path / "out", src)
    out = export_like(model, out, src)  # again over the first export: replaced whole, atomically
    assert json.loads((out / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    assert _tensors(out) == _tensors(src)
    back = load_pretrained(out)
    assert back.config == model.config and back.config.attention == "prefix_causal"
    for k, v in model.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k  # fp32 source: fp32 export, bit for bit
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no temp or old folder left behind


def test_a_model_that_is_not_the_sources_is_refused(tmp_path):
    src = _source(tmp_path / "src", shard=False)
    other = Transformer(tiny_config("qwen2", vocab_size=384)).init_weights(seed=1)  # hidden_size 64, not 32
    with pytest.raises(CheckpointError, match="hidden_size is 32, the model's is 64"):
        export_like(other, tmp_path / "out", src)
    with pytest.raises(CheckpointError, match="inside"):
        export_like(load_pretrained(src), src / "export", src)
    assert not (tmp_path / "out").exists()


def test_an_export_is_readable_by_the_team_as_a_plain_folder_would_be(tmp_path):
    import os
    import stat

    from streakline.models import Transformer, save_pretrained
    from tests.models.helpers import tiny_config

    umask = os.umask(0o022)
    try:
        folder = save_pretrained(Transformer(tiny_config("qwen2")).init_weights(seed=0), tmp_path / "out")
    finally:
        os.umask(umask)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o755  # not mkdtemp's 0700


@pytest.mark.parametrize("writer", ["save_pretrained", "sharded", "export_like"])
def test_weight_files_are_ordinary_files_a_server_of_another_user_can_read(tmp_path, writer):
    """safetensors writes 0600; an export's weights get the mode any new file gets (0644 under umask 022)."""
    import os
    import stat

    umask = os.umask(0o022)
    try:
        if writer == "export_like":
            source = _source(tmp_path / "src")
            folder = export_like(_trained(source), tmp_path / "out", source)
        else:
            model = Transformer(tiny_config("qwen2")).init_weights(seed=0)
            folder = save_pretrained(model, tmp_path / "out", max_shard_bytes=4096 if writer == "sharded" else None)
    finally:
        os.umask(umask)
    weights = sorted(folder.glob("*.safetensors"))
    assert weights and (len(weights) > 1) == (writer != "save_pretrained")
    assert {stat.S_IMODE(f.stat().st_mode) for f in weights} == {0o644}


def test_what_a_killed_export_leaves_is_swept_when_its_stage_starts_again(tmp_path):
    from streakline.artifacts import sweep_temp_files
    from streakline.models import Transformer, save_pretrained
    from streakline.models.checkpoint import _temp_folder
    from tests.models.helpers import tiny_config

    left = _temp_folder(tmp_path / "checkpoints" / "step-000006")  # a kill between writing and swapping in
    (left / "model.safetensors").write_bytes(b"half")
    save_pretrained(Transformer(tiny_config("qwen2")).init_weights(seed=0), tmp_path / "checkpoints" / "step-000003")
    assert sweep_temp_files(tmp_path) == 1
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000003"]


# ------------------------------------------------------------------------------------------------ a full disk
def _bytes_of(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_copy_that_meets_a_full_disk_names_its_file_and_leaves_the_folder_whole_or_absent(tmp_path, small_disk):
    """``copy_folder`` (stage=distill's final ``drafter/``) on a real small filesystem: with an earlier copy in
    place the second does not fit, and the earlier one stays byte for byte; with no earlier copy and no room, the
    folder is absent. Either way the one line names the file whose copy failed and says what was kept, and no
    half-written copy is left beside it (issue 62, item 2)."""
    from streakline.errors import DiskFullError
    from streakline.models.checkpoint import copy_folder

    first = save_pretrained(Transformer(tiny_config("qwen2")).init_weights(seed=1), tmp_path / "first")
    second = save_pretrained(Transformer(tiny_config("qwen2")).init_weights(seed=2), tmp_path / "second")
    size = sum(len(b) for b in _bytes_of(first).values())
    disk = small_disk(size * 3 // 2 // 1024 + 8)  # room for one copy, not for a second beside it
    copy_folder(first, disk / "drafter")
    assert _bytes_of(disk / "drafter") == _bytes_of(first)
    with pytest.raises(DiskFullError) as full:
        copy_folder(second, disk / "drafter", kept="the export it copies is kept")
    message = str(full.value)
    assert f"the disk is full: writing model.safetensors in {disk / 'drafter'} failed (" in message
    assert f"{disk / 'drafter'} is the earlier one, untouched, and the export it copies is kept" in message
    assert _bytes_of(disk / "drafter") == _bytes_of(first)
    assert [p.name for p in disk.iterdir()] == ["drafter"]

    empty = small_disk(size // 2 // 1024)  # not even one copy fits
    with pytest.raises(DiskFullError, match=r"writing model\.safetensors in .* was not written \(no half-written"):
        copy_folder(second, empty / "drafter")
    assert not any(empty.iterdir())


def test_an_export_that_meets_a_full_disk_in_its_tokenizer_names_that_write(tmp_path, small_disk):
    """A full disk after the weights, in the tokenizer files a library writes: the line names that write, not
    the weights, and the export is absent."""
    import os

    from streakline.errors import DiskFullError

    model = Transformer(tiny_config("qwen2")).init_weights(seed=1)
    probe = save_pretrained(model, tmp_path / "probe")  # config.json and the weights alone, one page rounding each
    pages = sum(-(-p.stat().st_size // 4096) for p in probe.iterdir())
    disk = small_disk(pages * 4 + 64)
    free = os.statvfs(disk)
    with open(disk / "filler", "wb") as f:  # leave the weights and config.json their pages, nothing more
        f.write(b"\0" * (free.f_bavail * free.f_frsize - pages * 4096))
    with pytest.raises(DiskFullError, match=r"writing the tokenizer's files in .*export failed"):
        save_pretrained(model, disk / "export", tokenizer=_tokenizer(tmp_path / "tok"))
    assert sorted(p.name for p in disk.iterdir()) == ["filler"]
