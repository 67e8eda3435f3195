"""stage=spot on the micro world: shards, order_model/ and metrics.json are written; a rerun is cached; a lost shard
is recollected alone; ``locate`` finds the order model (or says what to run); the drafter built from it decodes the
micro target exactly. Run: ``python -m pytest tests/pipelines/test_spot.py``."""

import json
from pathlib import Path

import pytest
import torch

from streakline.alignment.block_traces import read_trace_shards
from streakline.artifacts import read_manifest
from streakline.config import compose_config
from streakline.decoding.block_diffusion import BlockDecodeConfig, decode_blocks
from streakline.decoding.registry import block_drafter
from streakline.decoding.vanilla import left_pad
from streakline.models import CheckpointError, build
from streakline.models.order_model import OrderModel
from streakline.pipelines import run_stage
from streakline.pipelines.common.lookup import locate_order_model
from streakline.world import attach_world

SETTINGS = [
    "stage.prompt_sources=[tiny-math-train]",  # tiny-code-train parses the stdlib's training files: seconds per run
    "stage.prompts=10",
    "stage.max_new_tokens=16",
    "stage.num_shards=2",
    "stage.batch_size=5",
    "stage.top_k=8",
    "stage.horizon=4",
    "stage.d_model=32",
    "stage.layers=1",
    "stage.heads=4",
    "stage.ffn=64",
    "stage.max_block=8",
    "stage.steps=40",
    "stage.train_batch=32",
]


pytestmark = pytest.mark.usefixtures("one_thread")


def _cfg(root, experiment="spot", *extra):
    return compose_config(
        ["stage=spot", "model=micro", f"run_root={root}", f"experiment.name={experiment}", *SETTINGS, *extra]
    )


@pytest.fixture(scope="module")
def first(micro_world):
    root = micro_world[0]
    return root, run_stage(_cfg(root))


def test_stage_writes_shards_order_model_and_metrics(first, capsys):
    root, res = first
    folder = res.folder
    assert not res.cached
    manifest = read_manifest(folder)
    assert manifest.status == "complete" and set(manifest.outputs) == {"shards", "order_model", "metrics.json"}
    traces = read_trace_shards(f"{folder}/shards")
    assert sorted({t.prompt for t in traces}) == list(range(10))  # global prompt numbering across the 2 shards
    metrics = json.loads(Path(folder, "metrics.json").read_text())
    assert metrics == res.metrics == manifest.metrics
    assert metrics["collected_shards"] == [0, 1] and metrics["traces"] == len(traces)
    held = metrics["heldout"]
    assert 0 <= held["accuracy"] <= 1 and 0 <= held["baseline_accuracy"] <= 1
    assert set(held["by_depth"]) <= {"0", "1", "2", "3"} and "0" in held["by_depth"]
    assert metrics["examples"]["train"] > 0 and metrics["examples"]["heldout"] == held["examples"]
    model = OrderModel.load(res.artifact)
    assert model.num_parameters() == metrics["parameters"] and model.config.top_k == 8


def test_rerun_is_cached_and_a_lost_shard_is_recollected_alone(first, capsys):
    root, res = first
    again = run_stage(_cfg(root))
    assert again.cached and again.folder == res.folder and again.metrics == res.metrics
    assert "reusing the complete run" in capsys.readouterr().out
    # A killed run: one shard and the manifest gone. Only that shard is decoded again, with the same traces.
    other = _cfg(root, "spot-resume")
    full = run_stage(other)
    before = read_trace_shards(f"{full.folder}/shards")
    folder = Path(full.folder)
    (folder / "manifest.json").unlink()
    next(iter(sorted((folder / "shards").glob("shard-00001-*.parquet")))).unlink()
    resumed = run_stage(_cfg(root, "spot-resume"))
    assert resumed.metrics["collected_shards"] == [1] and not resumed.cached
    after = read_trace_shards(folder / "shards")
    assert len(after) == len(before)
    for a, b in zip(before, after, strict=True):
        assert a.prompt == b.prompt and all((x.tokens == y.tokens).all() for x, y in zip(a.steps, b.steps, strict=True))
    assert resumed.metrics["heldout"] == full.metrics["heldout"]  # training is deterministic too


def locate(cfg):
    return locate_order_model(attach_world(cfg, progress=False))


def test_locate_finds_the_newest_matching_run_or_says_what_to_run(first, tmp_path):
    root, res = first
    assert locate(_cfg(root)) == res.artifact
    assert locate(_cfg(root, "spot", f"decoder.artifact={res.artifact}")) == locate(_cfg(root))
    # a consumer need not repeat the producer's settings: the run for this target and rule is found
    assert locate(_cfg(root, "spot", "stage.steps=41")) == res.artifact
    with pytest.raises(CheckpointError, match=r"python launch.py stage=spot model=micro stage.rule=static first"):
        locate(_cfg(root, "never-ran"))
    with pytest.raises(CheckpointError, match=r"\(1 complete run\(s\) there have other settings\); run python "
                       r"launch.py stage=spot model=micro stage.rule=threshold stage.threshold=0.9 first"):  # fmt: skip
        locate(_cfg(root, "spot", "decoder.rule=threshold"))  # traces of another rule: another commit order
    with pytest.raises(CheckpointError, match="not an order-model folder"):
        locate(_cfg(root, "spot", f"decoder.artifact={tmp_path}"))


def test_the_trained_drafter_decodes_the_micro_target_exactly(first):
    root, _ = first
    cfg = _cfg(root, "spot", "decoder=spot", "decoder.budget=6")
    drafter = block_drafter("spot", locate(cfg), cfg.decoder, target=cfg.model.target.name)
    target = build(cfg.model.target, "target").eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (5, 11, 8)]
    ids, mask = left_pad(prompts)
    for temperature in (0.0, 1.0):
        dcfg = BlockDecodeConfig(max_new_tokens=20, temperature=temperature, seed=4)
        plain = decode_blocks(target, ids, mask, dcfg)
        spot = decode_blocks(target, ids, mask, dcfg, drafter=drafter)
        assert spot.tokens == plain.tokens and spot.nfe <= plain.nfe


def test_an_order_model_names_its_target_and_one_for_another_block_size_is_refused(first):
    """order_model/target.json and the manifest record the target's fingerprint and block size; the lookup for
    another block size finds nothing, and the order model picked by hand is refused in one line with the command."""
    from streakline.pipelines.common.fingerprints import target_identity

    root, res = first
    cfg = attach_world(_cfg(root), progress=False)
    recorded = json.loads((Path(res.artifact) / "target.json").read_text())
    assert recorded == {**target_identity(cfg), "block_size": 8}
    assert read_manifest(res.folder).metrics["target_fingerprint"] == recorded["target_fingerprint"]
    extra = [f"model.target.path={cfg.model.target.path}", "model.target.block_size=4"]
    with pytest.raises(CheckpointError, match=r"complete run\(s\) there are for another target or tokenizer"):
        locate(_cfg(root, "spot", *extra))
    with pytest.raises(CheckpointError) as refused:
        locate(_cfg(root, "spot", f"decoder.artifact={res.artifact}", *extra))
    message = str(refused.value)
    assert "\n" not in message and "made for target micro-target (block size 8, weights " in message
    assert "not for model.target: target micro-target (block size 4, weights " in message
    assert f"python launch.py stage=spot model=micro {' '.join(extra)} stage.rule=static, or set" in message


def test_a_hand_picked_order_model_for_another_block_size_is_refused_before_a_world_is_built(first):
    """A changed model.target.block_size means a new tiny world (minutes) that the lookup would then refuse the
    hand-picked order model for: stage=decode says so first, and builds nothing."""
    from streakline.config import compose_config
    from streakline.pipelines import run_stage

    root, res = first
    before = sorted(p for p in Path(root).rglob("*") if p.is_dir())
    cfg = compose_config(["stage=decode", "model=micro", f"run_root={root}", "decoder=spot", "prompt_ids=[5,6]",
                          f"decoder.artifact={res.artifact}", "model.target.block_size=4"])  # fmt: skip
    with pytest.raises(CheckpointError, match=r"made for target micro-target \(block size 8\).*"
                                              r"block size 4\), which would need a new world built first; set "
                                              r"model.target.block_size=8"):  # fmt: skip
        run_stage(cfg)
    assert sorted(p for p in Path(root).rglob("*") if p.is_dir()) == before
