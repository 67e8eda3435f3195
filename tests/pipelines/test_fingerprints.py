"""Run keys carry content, not names (``pipelines/common/fingerprints.py``, ``streakline/hashing.py``): an edited
data file, a new hub revision, other weights in a folder and another drafter tokenizer each move the key they enter;
untouched inputs, and the presets the world builds, keep the key they had.

Run: ``python -m pytest tests/pipelines/test_fingerprints.py``.
"""

import json
import os
import shutil
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from streakline.artifacts import config_hash, run_path
from streakline.config import compose_config
from streakline.hashing import folder_fingerprint, run_output, sha256_cache
from streakline.models.tokenizer import tokenizer_hash
from streakline.pipelines.common.lookup import (
    LATER_DATA_DEFAULTS,
    frozen_precision,
    spiffy_key,
    spot_key,
    trajectories_dir,
    trajectories_key,
)
from streakline.pipelines.common.roles import role_tokenizer
from streakline.pipelines.distill import STAGE as DISTILL
from streakline.world import attach_world

TOK = "0" * 12  # trajectories_key takes the verifier tokenizer's hash; these tests vary everything else
CHATS = [
    [("What is 2 + 2?", "4")],
    [("Name a prime.", "7"), ("Another?", "11")],
    [("Spell cat.", "c-a-t")],
]


def _cfg(root, *extra, stage="trajectories"):
    return compose_config([f"stage={stage}", "model=micro", f"run_root={root}", "data.mix_weights=[]", *extra])


def _write_chats(path: Path, chats) -> None:
    rows = [{"messages": [{"role": r, "content": c} for q, a in chat for r, c in (("user", q), ("assistant", a))]}
            for chat in chats]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _old_trajectories_key(cfg, tok):
    """The trajectories key as it was before content entered it, for inputs that name no file or folder (with the
    mix order of several sources, which changed the rows themselves)."""
    data = OmegaConf.to_container(cfg.data, resolve=True)
    for key, default in LATER_DATA_DEFAULTS.items():
        if data.get(key) == default:
            data.pop(key)
    data.pop("allow_eval_overlap", None)
    data.pop("max_feature_gb", None)
    data.pop("seed", None)  # data.seed came later; unset, the rows' seed is the run's
    if data.get("batching") == "continuous":
        data.pop("batch_size", None)
    node = cfg.model.verifier
    key = {"verifier": node.path or node.hub_id, "tokenizer": tok, "data": data, "seed": cfg.seed}
    if len(cfg.data.prompt_sources) > 1:  # several sources were listed one after another, now interleaved
        key["mix"] = "interleaved"  # (data/mix.py): other rows, so a new folder, and the one part that adds
    precision = frozen_precision(cfg)  # what the rows were sampled in: a part of its own, not a fingerprint
    return key if precision == "fp32" else {**key, "precision": precision}


# --------------------------------------------------------------------------------------------- data files
@pytest.mark.parametrize("source", ["conversations", "gsm8k"])
def test_an_edited_data_file_moves_the_trajectories_key(tmp_path, source):
    path = tmp_path / "rows.jsonl"
    if source == "conversations":
        _write_chats(path, CHATS)
    else:
        path.write_text("".join(json.dumps({"question": q, "answer": "#### 1"}) + "\n" for q in ("1+0?", "2-1?")))
    cfg = _cfg(tmp_path / "runs", f"data.prompt_sources=[{source}@{path}]")
    first = trajectories_key(cfg, TOK)
    assert first == trajectories_key(cfg, TOK)  # untouched: the same folder
    text = path.read_text()
    path.write_text(text.replace("2", "3", 1))  # one prompt edited in place: same path, same rows, same size
    edited = trajectories_key(cfg, TOK)
    assert edited != first
    assert {k: v for k, v in edited.items() if k != "source_files"} == {
        k: v for k, v in first.items() if k != "source_files"
    }  # only the content moved it
    path.write_text(text)
    assert trajectories_key(cfg, TOK) == first  # the same content again: the same folder again


def test_file_hashes_are_cached_by_path_size_and_mtime(tmp_path):
    """A file is read once: while its size and mtime stay, the cached hash stands (what makes a 100 GB data set
    cheap to key); a new mtime reads it again."""
    path = tmp_path / "chats.jsonl"
    _write_chats(path, CHATS)
    old = path.stat().st_mtime_ns - 3600 * 10**9  # an hour old: past the racy window, so it is cached
    os.utime(path, ns=(old, old))
    cfg = _cfg(tmp_path / "runs", f"data.prompt_sources=[conversations@{path}]")
    first = trajectories_key(cfg, TOK)
    assert sha256_cache(cfg.run_root).is_file()
    path.write_text(path.read_text().replace("2", "3", 1))
    os.utime(path, ns=(old, old))  # same size and mtime: the content is not read again
    assert trajectories_key(cfg, TOK) == first
    os.utime(path, ns=(old + 10**9, old + 10**9))
    assert trajectories_key(cfg, TOK) != first


def test_built_in_sources_and_presets_keep_their_keys(tmp_path):
    cfg = _cfg(tmp_path, "data.prompt_sources=[tiny-math-train,tiny-chat]")
    assert trajectories_key(cfg, TOK) == _old_trajectories_key(cfg, TOK)
    assert "mix" not in trajectories_key(_cfg(tmp_path, "data.prompt_sources=[tiny-chat]"), TOK)


def test_what_changes_a_row_moves_the_key_and_nothing_else_does(tmp_path):
    """docs/data.md's table: the sampling precision and the batching scheme move the folder; under continuous
    batching the batch size does not (each row its own seed); fixed batching in fp32 keeps the folder it always
    had (the data settings without the later fields, no precision part)."""
    sources = "data.prompt_sources=[tiny-math-train]"
    fp32 = trajectories_key(_cfg(tmp_path, sources, "precision=fp32"), TOK)
    assert "precision" not in fp32
    assert trajectories_key(_cfg(tmp_path, sources, "precision=bf16"), TOK) == {**fp32, "precision": "bf16"}
    assert trajectories_key(_cfg(tmp_path, sources, "precision=fp32", "data.batch_size=8"), TOK) == fp32
    old = ("precision=fp32", "data.batching=fixed", "data.batch_size=16")
    fixed = trajectories_key(_cfg(tmp_path, sources, *old), TOK)
    assert "batching" not in fixed["data"] and fixed["data"]["batch_size"] == 16 and fixed != fp32
    assert fixed["data"] == {**{k: v for k, v in fp32["data"].items() if k != "batching"}, "batch_size": 16}


def test_data_seed_holds_the_trajectories_while_the_training_seed_moves(tmp_path):
    """data.seed names the trajectories' sampling seed: seed=1 data.seed=0 reads the trajectories seed=0 made (so
    several training seeds share one set), while seed=1 alone samples its own; distill's key still holds seed."""
    sources = "data.prompt_sources=[tiny-math-train]"
    zero = trajectories_key(_cfg(tmp_path, sources, "seed=0"), TOK)
    assert trajectories_key(_cfg(tmp_path, sources, "seed=1", "data.seed=0"), TOK) == zero
    assert trajectories_key(_cfg(tmp_path, sources, "seed=0", "data.seed=0"), TOK) == zero
    assert trajectories_key(_cfg(tmp_path, sources, "seed=1"), TOK)["seed"] == 1
    assert trajectories_key(_cfg(tmp_path, sources, "seed=0", "data.seed=2"), TOK)["seed"] == 2
    assert "seed" not in zero["data"]


# --------------------------------------------------------------------------------------------- hub revisions
def _snapshot(cache: Path, repo_id: str, commit: str, config: dict) -> None:
    """Lay out one snapshot of ``repo_id`` as the hub client does, and point ``refs/main`` at it."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "config.json").write_text(json.dumps(config))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)


def test_a_new_hub_revision_moves_the_key(tmp_path, monkeypatch):
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    _snapshot(cache, "org/verifier", "a" * 40, {"hidden_size": 64})
    cfg = _cfg(tmp_path / "runs", "model.verifier.hub_id=org/verifier")
    first = trajectories_key(cfg, TOK)
    assert first["verifier_revision"] == "a" * 40 and first == trajectories_key(cfg, TOK)
    _snapshot(cache, "org/verifier", "b" * 40, {"hidden_size": 96})  # refs/main now names another snapshot
    moved = trajectories_key(cfg, TOK)
    assert moved["verifier_revision"] == "b" * 40
    assert {k: v for k, v in moved.items() if k != "verifier_revision"} == {
        k: v for k, v in first.items() if k != "verifier_revision"
    }


# --------------------------------------------------------------------------------------------- world checkpoints
@pytest.fixture(scope="module")
def world(micro_world):
    """The micro world's run root and a distill config attached to it."""
    root = micro_world[0]
    return root, attach_world(_cfg(root, stage="distill"), progress=False)


def test_the_worlds_presets_keep_every_key(world):
    """Checkpoints the world built are named by their path, which its content-keyed folder already pins: no key of
    a preset gains a part, so runs made before keep their folders."""
    root, cfg = world
    assert run_output(cfg.model.verifier.path) is not None
    tok = tokenizer_hash(role_tokenizer(cfg, "verifier"))
    assert trajectories_key(cfg, tok) == _old_trajectories_key(cfg, tok)
    old = run_path(root, cfg.experiment.name, "trajectories", config_hash(_old_trajectories_key(cfg, tok)))
    assert trajectories_dir(cfg) == old / "shards"
    key = DISTILL.key(cfg)
    assert not {k for k in key if k.startswith("drafter_")} and "subset" not in key["trainer"]
    target = compose_config(["stage=spiffy", "model=micro", f"run_root={root}"])
    target = attach_world(target, progress=False)
    preset = OmegaConf.to_container(target.model.target, resolve=True)
    preset.pop("devices")
    del preset["source"]
    tok = role_tokenizer(target, "target")
    assert spiffy_key(target, tok)["target"] == preset and "source_files" not in spiffy_key(target, tok)
    assert spot_key(target, tok)["target"] == preset


def test_a_changed_drafter_tokenizer_moves_the_distill_key(world, tmp_path):
    root, cfg = world
    first = DISTILL.key(cfg)
    tokenizer = Path(cfg.model.drafter.tokenizer)
    other = tmp_path / "tokenizer"
    shutil.copytree(tokenizer, other)
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = sorted(t for t in vocab if t.isalpha() and len(t) > 2)[:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # the same tokens and size, two ids swapped: it encodes otherwise
    (other / "tokenizer.json").write_text(json.dumps(spec))
    cfg = OmegaConf.merge(cfg, {"model": {"drafter": {"tokenizer": str(other)}}})
    moved = DISTILL.key(cfg)
    assert (
        moved["drafter_tokenizer"] == tokenizer_hash(role_tokenizer(cfg, "drafter")) != first.get("drafter_tokenizer")
    )
    assert {k: v for k, v in moved.items() if k != "drafter_tokenizer"} == first
    cfg.model.drafter.tokenizer = str(tokenizer)  # back to the trajectories' tokenizer: the first folder
    assert DISTILL.key(cfg) == first


def test_a_folder_of_the_users_enters_by_its_content(world, tmp_path):
    """A copy of the world's verifier is no stage's output: it enters by its fingerprint, which other weights of the
    same shapes saved over it move, and which reading it again does not."""
    from safetensors.torch import load_file, save_file

    root, cfg = world
    folder = tmp_path / "verifier"
    shutil.copytree(cfg.model.verifier.path, folder)
    cfg = OmegaConf.merge(cfg, {"model": {"verifier": {"path": str(folder)}}})
    tok = tokenizer_hash(role_tokenizer(cfg, "verifier"))
    first = trajectories_key(cfg, tok)
    assert first["verifier_weights"] == folder_fingerprint(folder) and trajectories_key(cfg, tok) == first
    state = load_file(folder / "model.safetensors")
    name = sorted(state)[0]
    state[name] = state[name] + 1.0
    save_file(state, folder / "model.safetensors")  # the same header: names, dtypes and shapes unchanged
    assert trajectories_key(cfg, tok)["verifier_weights"] != first["verifier_weights"]
    assert DISTILL.key(OmegaConf.merge(cfg, {"model": {"drafter": {"path": str(folder)}}}))["drafter_weights"]


def test_evaluate_names_a_users_folder_by_its_content(world, tmp_path):
    """evaluate's key gains the fingerprint of a folder of the user's (other weights saved over it move it), and a
    world's checkpoints add nothing, so earlier evaluate runs keep their folders."""
    from safetensors.torch import load_file, save_file

    from streakline.pipelines.evaluate import STAGE as EVALUATE

    root, _ = world
    cfg = attach_world(_cfg(root, "stage.methods=[{name: vanilla, decoder: vanilla}]", stage="evaluate"),
                       progress=False)  # fmt: skip
    assert "model_content" not in EVALUATE.key(cfg)
    folder = tmp_path / "verifier"
    shutil.copytree(cfg.model.verifier.path, folder)
    cfg = OmegaConf.merge(cfg, {"model": {"verifier": {"path": str(folder)}}})
    first = EVALUATE.key(cfg)
    assert first["model_content"] == {"verifier_weights": folder_fingerprint(folder)}
    state = load_file(folder / "model.safetensors")
    name = sorted(state)[0]
    state[name] = state[name] * 2.0
    save_file(state, folder / "model.safetensors")
    assert EVALUATE.key(cfg)["model_content"] != first["model_content"]


def test_roles_parts_merges_the_roles_and_leaves_out_missing_weights_only_when_asked(world, tmp_path):
    """roles_parts holds each role's role_parts (a world's folders add nothing); a role whose folder is not there
    raises unless skip_missing, which also passes over a role the config lacks (evaluate's model_content)."""
    from streakline.errors import UserError
    from streakline.pipelines.common.fingerprints import role_parts, roles_parts
    from streakline.pipelines.evaluate import model_content

    _, cfg = world
    roles = ("verifier", "drafter", "target")
    assert roles_parts(cfg, roles) == {} and model_content(cfg) == {}
    folder = tmp_path / "verifier"
    shutil.copytree(cfg.model.verifier.path, folder)
    cfg = OmegaConf.merge(cfg, {"model": {"verifier": {"path": str(folder)}}})
    mine = {"verifier_weights": folder_fingerprint(folder)}
    assert roles_parts(cfg, roles) == {**role_parts(cfg, "verifier"), **role_parts(cfg, "target")} == mine
    cfg = OmegaConf.merge(cfg, {"model": {"drafter": {"path": str(tmp_path / "nowhere")}}})
    with pytest.raises(UserError, match="model.drafter.path=.* is not a checkpoint folder"):
        roles_parts(cfg, roles)
    assert roles_parts(cfg, (*roles, "no_such_role"), skip_missing=True) == mine
    assert model_content(cfg) == {"model_content": mine}


def test_mixed_precision_moves_the_distill_key_and_fp32_keeps_the_old_one(world):
    """What trainer.autocast resolves to is in the key (a bf16-autocast drafter is another drafter); an fp32 run,
    where the setting is off or the hardware has no native bf16, keeps the key runs had before the setting."""
    from streakline.models.precision import detect

    _, cfg = world
    off = DISTILL.key(OmegaConf.merge(cfg, {"trainer": {"autocast": "off"}}))
    assert "autocast" not in off and "autocast" not in off["trainer"]
    fp32 = DISTILL.key(OmegaConf.merge(cfg, {"precision": "fp32"}))  # fp32 everywhere: fp32 trajectories too
    assert {**fp32, "trajectories": off["trajectories"]} == off
    forced = DISTILL.key(OmegaConf.merge(cfg, {"trainer": {"autocast": "bf16"}}))
    assert {k: v for k, v in forced.items() if k != "autocast"} == off and forced["autocast"] == "bf16"
    assert DISTILL.key(cfg) == (forced if detect("cpu").native_bf16 else off)  # auto: as the hardware says
