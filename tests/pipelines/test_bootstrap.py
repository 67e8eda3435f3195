"""stage=bootstrap on the micro world: the tiny world's code path, trained for seconds.

Checks the properties the world must have: held-out loss falls for every model, the checkpoints load back
through the presets, the cache is hit on rerun, and a damaged or partial cache entry is rebuilt, not loaded.
"""

import json
import time

import pytest
import torch

from streakline.config import ConfigError, compose_config
from streakline.models import build
from streakline.models.tokenizer import load_tokenizer
from streakline.pipelines import run_stage
from streakline.world import attach_world, ensure_world, format_report


def _cfg(root, *extra):
    return compose_config(["stage=bootstrap", "model=micro", f"run_root={root}", *extra])


@pytest.fixture(scope="module")
def built(micro_world):
    return micro_world


def test_every_model_learns_on_heldout_data(built):
    _, _, result = built
    report = result.metrics
    for role in ("verifier", "drafter", "target"):
        for domain in ("code", "math"):
            start, end = report[role]["start"][f"{domain}_loss"], report[role]["heldout"][f"{domain}_loss"]
            assert end < start, (role, domain, start, end)
    for name in ("tiny-math", "tiny-code"):
        s = report["drafter"]["streak"][name]
        assert 0 <= s["mean_streak"] <= report["gamma"] and s["windows"] > 0
        assert len(s["alpha"]) == report["gamma"] and all(0 <= a <= 1 for a in s["alpha"])
        rules = report["target"]["forwards_per_token"][name]
        # static commits one token per forward; threshold commits at least one, so never needs more forwards
        assert rules["threshold"]["forwards_per_token"] <= rules["static"]["forwards_per_token"]


def test_world_checkpoints_load_through_the_presets(built):
    root, cfg, result = built
    attach_world(cfg)
    tok = load_tokenizer(cfg.model.drafter.tokenizer)
    text = "Sam has 3 apples.\n    def f(x):\n        return x  # é"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    for role in ("verifier", "drafter", "target"):
        model = build(cfg.model[role], role)
        assert model.config.attention == cfg.model[role].attention
        assert model.config.vocab_size == len(tok) == cfg.model.world.vocab_size
    assert build(cfg.model.drafter, "drafter").config.mask_token_id == tok.convert_tokens_to_ids("<|mask|>")
    assert json.loads(
        (result_dir := (root / "world" / "bootstrap")).iterdir().__next__().joinpath("report.json").read_text()
    )
    assert result_dir.exists()


def test_rerun_hits_the_cache(built):
    root, _, result = built
    manifest = result.folder / "manifest.json"
    before = manifest.stat().st_mtime_ns
    t0 = time.perf_counter()
    again = run_stage(_cfg(root))
    assert again.folder == result.folder and manifest.stat().st_mtime_ns == before
    assert time.perf_counter() - t0 < 10  # a hit reads checksums; it never trains


def test_damaged_or_partial_entries_are_rebuilt(built, capsys):
    root, _, result = built
    folder = result.folder
    weights = folder / "drafter" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated
    rebuilt = ensure_world(_cfg(root), progress=False)
    assert "damaged" in capsys.readouterr().out and rebuilt == folder
    build({"path": str(folder / "drafter"), "attention": "prefix_causal", "dtype": "float32"}, "drafter")

    (folder / "manifest.json").unlink()  # as if killed before the manifest was written
    again = ensure_world(_cfg(root), progress=False)
    assert (again / "manifest.json").exists()
    with torch.no_grad():  # the rebuilt world is the same world: training is seeded
        a = build({"path": str(again / "verifier"), "dtype": "float32", "attention": "causal"})
        assert torch.isfinite(a(torch.tensor([[1, 2, 3]]))).all()


def test_bootstrap_needs_a_world_recipe(tmp_path):
    with pytest.raises(ConfigError, match="model=tiny"):
        compose_config(["stage=bootstrap", "model=diffucoder", f"run_root={tmp_path}"])
    with pytest.raises(ConfigError, match="drop the model.verifier override"):
        compose_config(["stage=bootstrap", "model=micro", "model.verifier=qwen2.5-14b", f"run_root={tmp_path}"])


def test_a_role_given_a_path_keeps_it(built, tmp_path):
    root, _, result = built
    cfg = compose_config(["stage=doctor", "model=micro", f"run_root={root}", f"model.drafter.path={tmp_path}"])
    attach_world(cfg, progress=False)
    assert cfg.model.drafter.path == str(tmp_path)
    assert cfg.model.verifier.path == str(result.folder / "verifier")


def test_a_role_with_a_path_keeps_its_own_settings_and_the_world_it_was_built_with(built, tmp_path, capsys):
    root, _, result = built
    tokenizer = str(result.folder / "tokenizer")
    changed = [
        f"model.drafter.path={result.folder / 'drafter'}", "model.drafter.mask_token='<|pad|>'",
        "model.drafter.family=llama", f"model.drafter.tokenizer={tokenizer}",
    ]  # fmt: skip
    cfg = compose_config(["stage=doctor", "model=micro", f"run_root={root}", *changed])
    attach_world(cfg, progress=False)
    # the same world, not a new build: changing what the pointed-at drafter is read as does not change the world
    assert cfg.model.verifier.path == str(result.folder / "verifier")
    assert "building" not in capsys.readouterr().out.lower()
    assert len(list((root / "world" / "bootstrap").iterdir())) == 1
    # ... while the run itself reads the drafter as the command line said, with the tokenizer it named
    assert (cfg.model.drafter.mask_token, cfg.model.drafter.family) == ("<|pad|>", "llama")
    assert cfg.model.drafter.tokenizer == tokenizer
    # without a path, the same change is a different world
    from streakline.world import world_key
    from streakline.world.build import world_config

    plain = compose_config(["stage=doctor", "model=micro", f"run_root={root}", "model.drafter.mask_token='<|pad|>'"])
    assert world_key(world_config(plain)) != world_key(world_config(cfg))


def test_the_stage_builds_the_world_where_roles_device_says(built, monkeypatch):
    """``stage=bootstrap`` asks ``common.roles.device()`` (the GPU when there is one) where to train, and the world
    records where it was trained (a rerun is a cache hit: the question is asked, nothing is trained)."""
    import streakline.pipelines.bootstrap as stage
    from streakline.pipelines.common.roles import device

    root, _, result = built
    assert result.metrics["device"] == device()
    assert f"build time on {device()}" in format_report(result.metrics, result.folder)
    asked = []
    monkeypatch.setattr(stage, "device", lambda: asked.append(device()) or asked[-1])
    assert run_stage(_cfg(root)).folder == result.folder and asked == [device()]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_world_learns_on_a_gpu(tmp_path):
    from streakline.artifacts import read_manifest

    report = read_manifest(ensure_world(_cfg(tmp_path), progress=False, device="cuda")).metrics["report"]
    assert report["device"] == "cuda"
    for role in ("verifier", "drafter", "target"):
        assert report[role]["heldout"]["code_loss"] < report[role]["start"]["code_loss"], role
