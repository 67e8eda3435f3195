"""The drafter kinds as the stages dispatch on them (``streakline/pipelines/common/kinds/``): which kind a preset or
a checkpoint folder is, the rows ``stage=evaluate`` gives the model preset's drafter, what the decode command of
``stage=distill`` adds for each kind, and a kind distill does not train refusing to. That each entry fits its drafter
class, decoder and checkpoint kind is ``tests/test_registries.py``'s; training and exporting each kind is
``test_distill.py``'s and ``test_dflash_pipeline.py``'s.

Run: ``python -m pytest tests/pipelines/test_kinds.py``.
"""

from __future__ import annotations

import pytest

from streakline.config import ConfigError, compose_config
from streakline.models import Transformer, TransformerConfig, save_pretrained
from streakline.models.dflash import DFlashConfig, DFlashModel
from streakline.models.dflash_checkpoint import save_dflash
from streakline.pipelines.common.kinds import DRAFTER_KINDS, drafter_kind, preset_rows

pytestmark = pytest.mark.usefixtures("one_thread")


def _cfg(*overrides):
    return compose_config(["stage=evaluate", "model=micro", *overrides])


def _rows(cfg):
    return [(m.name, m.decoder, m.steps) for m in preset_rows(cfg)]


def test_a_preset_is_the_kind_that_trains_its_checkpoint_kind():
    plain, dflash = _cfg(), _cfg("model.drafter=micro-dflash")
    assert drafter_kind(plain) is DRAFTER_KINDS["diffusion"]
    assert drafter_kind(dflash) is DRAFTER_KINDS["dflash"]
    # a transformer drafter is decoded as AR and as a diffusion drafter (its step 0); a DFlash one only as itself
    assert _rows(plain) == [("ar_draft", "ar_draft", None), ("base", "diffusion_draft", 0)]
    assert _rows(dflash) == [("dflash:base", "dflash_draft", 0)]
    assert DRAFTER_KINDS["diffusion"].decode_overrides(plain) == ""
    assert DRAFTER_KINDS["dflash"].decode_overrides(dflash) == "model.drafter=micro-dflash "


def test_a_folder_is_the_kind_its_format_says(tmp_path):
    layers = TransformerConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
        family="qwen3", qk_norm=True, tie_embeddings=False, attention="full", mask_token_id=63,
    )  # fmt: skip
    plain = save_pretrained(Transformer(layers).init_weights(seed=0), tmp_path / "plain")
    drafter = DFlashModel(DFlashConfig(layers=layers, target_layer_ids=(1,), block_size=4, mask_token_id=63))
    dflash = save_dflash(drafter.init_weights(seed=0), tmp_path / "dflash", verifier_name="v")
    cfg = _cfg()
    assert drafter_kind(cfg, str(plain)).decoder == "diffusion_draft"
    assert drafter_kind(cfg, str(dflash)).decoder == "dflash_draft"
    # the folder decides, whatever the model preset's drafter is
    assert drafter_kind(_cfg("model.drafter=micro-dflash"), str(plain)) is DRAFTER_KINDS["diffusion"]


def test_a_kind_distill_does_not_train_refuses_to(tmp_path):
    ar = DRAFTER_KINDS["ar"]
    assert not ar.trains and all(k.trains for n, k in DRAFTER_KINDS.items() if n != "ar")
    with pytest.raises(ConfigError, match="does not train ar drafters"):
        ar.trainee(_cfg(), None, device="cpu", run=tmp_path, temperature=1.0)
