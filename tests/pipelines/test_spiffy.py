"""stage=spiffy on the micro world: graph.json + metrics.json, the cached rerun, ``locate`` and its errors, and the
located graph decoding exactly like the draft-free decoder. Run: ``python -m pytest tests/pipelines/test_spiffy.py``."""

import json
import re
from pathlib import Path

import pytest

from streakline.artifacts import read_manifest
from streakline.config import ConfigError, compose_config
from streakline.decoding.block_diffusion import BlockDecodeConfig, decode_blocks
from streakline.decoding.registry import block_drafter
from streakline.decoding.spiffy import SpiffyGraph
from streakline.decoding.vanilla import left_pad
from streakline.models import CheckpointError, build
from streakline.pipelines import run_stage
from streakline.pipelines.common.lookup import locate_graph as locate
from streakline.pipelines.common.prompts import encode_records, source_records
from streakline.pipelines.common.roles import role_tokenizer
from streakline.world import attach_world

SETTINGS = [
    "stage.prompt_sources=[tiny-math-train,tiny-code]",  # tiny-code-train parses the stdlib (seconds): not here
    "stage.prompts=4",
    "stage.max_new_tokens=16",
    "stage.horizon=3",
    "stage.budget=5",
    "stage.batch_size=4",
    "stage.top_k=8",
]


pytestmark = pytest.mark.usefixtures("one_thread")


def _cfg(root, *extra):
    return compose_config(
        ["stage=spiffy", "model=micro", f"run_root={root}", "experiment.name=spiffy-test", *SETTINGS, *extra]
    )


@pytest.fixture(scope="module")
def first(micro_world):
    root = micro_world[0]
    return root, run_stage(_cfg(root))


def test_stage_writes_the_graph_and_its_metrics(first):
    root, res = first
    assert not res.cached
    folder = Path(res.folder)
    graph = SpiffyGraph.load(res.artifact)
    h = graph.header
    assert (h["target"], h["rule"], h["temperature"], h["top_k"], h["horizon"], h["budget"]) == (
        "micro-target",
        "static",
        0.0,
        8,
        3,
        5,
    )
    metrics = json.loads((folder / "metrics.json").read_text())
    assert metrics["prompts"] == 4 and metrics["steps"] > 0 and metrics["nodes"] == graph.size
    assert 1 <= graph.size <= 5 and 0.0 < metrics["coverage"] <= 1.0
    manifest = read_manifest(folder)
    assert manifest.status == "complete" and {"graph.json", "metrics.json"} <= set(manifest.outputs)


def test_rerun_is_cached_and_locate_finds_the_graph(first, tmp_path):
    root, res = first
    again = run_stage(_cfg(root))
    assert again.cached and again.artifact == res.artifact
    cfg = attach_world(_cfg(root), progress=False)
    assert locate(cfg) == Path(res.artifact)
    cfg.decoder.artifact = res.folder  # a run folder works as well as the file
    assert locate(cfg) == Path(res.artifact)

    # The located graph drafts for the micro target and decodes exactly like the draft-free decoder.
    cfg.decoder.artifact = None
    cfg.decoder.budget, cfg.decoder.prune = 3, 2
    drafter = block_drafter("spiffy", locate(cfg), cfg.decoder, target=cfg.model.target.name)
    assert drafter.graph.size == 3 and drafter.prune == 2
    target = build(cfg.model.target, "target").eval()
    records = source_records(cfg.stage.prompt_sources, cfg.stage.prompts, "spiffy")
    ids, mask = left_pad(encode_records(role_tokenizer(cfg, "target"), records, chat_template=False))
    decode = BlockDecodeConfig(rule="static", max_new_tokens=16)
    plain = decode_blocks(target, ids, mask, decode)
    spec = decode_blocks(target, ids, mask, decode, drafter=drafter)
    assert spec.tokens == plain.tokens and sum(spec.nfe_per_row) <= sum(plain.nfe_per_row)


def test_missing_graph_and_bad_settings_are_clear_errors(first, tmp_path):
    root, _ = first
    # a consumer need not repeat the producer's settings: another budget still finds the graph for this rule and T
    cfg = attach_world(_cfg(root, "stage.budget=6"), progress=False)
    assert locate(cfg) == Path(first[1].artifact)
    # no graph for the decoding temperature: the error names the run that makes one
    wanted = r"\(1 complete run\(s\) there have other settings\); run python launch.py stage=spiffy model=micro "
    with pytest.raises(CheckpointError, match=wanted + "stage.rule=static stage.temperature=1.0 first"):
        locate(cfg, temperature=1.0)
    cfg.decoder.rule = "threshold"
    with pytest.raises(CheckpointError, match="stage.rule=threshold stage.threshold=0.9 stage.temperature=0.0 first"):
        locate(cfg)
    cfg.decoder.artifact = str(tmp_path)
    with pytest.raises(CheckpointError, match="not a Spiffy graph"):
        locate(cfg)
    with pytest.raises(ConfigError, match="stage.rule=spot is not a draft-free rule"):
        run_stage(_cfg(root, "stage.rule=spot"))


def test_traces_use_the_configured_threshold_and_locate_matches_it(first):
    """The threshold rule's tau reaches the traces (it once stayed at 0.9 whatever was set), the graph records it, and
    decoder=spiffy finds the graph for its own tau only."""
    root, _ = first
    res = run_stage(_cfg(root, "stage.rule=threshold", "stage.threshold=0.6"))
    assert SpiffyGraph.load(res.artifact).header["threshold"] == 0.6
    cfg = attach_world(_cfg(root, "decoder.rule=threshold", "decoder.threshold=0.6"), progress=False)
    assert locate(cfg) == Path(res.artifact)
    cfg.decoder.threshold = 0.9
    with pytest.raises(CheckpointError, match="stage.rule=threshold stage.threshold=0.9 stage.temperature=0.0 first"):
        locate(cfg)


def _other_weights(folder: Path, into: Path) -> Path:
    """A copy of the checkpoint ``folder`` with one tensor changed (same names, dtypes and shapes)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, into)
    state = load_file(into / "model.safetensors")
    name = sorted(state)[0]
    state[name] = state[name] + 1.0
    save_file(state, into / "model.safetensors")
    return into


def test_a_graph_names_its_target_and_one_for_another_is_refused(first, tmp_path):
    """The graph and the manifest record the target's fingerprint and block size; the lookup finds only graphs of
    this target, and a hand-picked graph of another block size or other weights is refused in one line naming the
    command that calibrates a matching one."""
    from streakline.pipelines.common.fingerprints import target_identity

    root, res = first
    cfg = attach_world(_cfg(root, f"decoder.artifact={res.artifact}"), progress=False)
    mine = target_identity(cfg)
    header = SpiffyGraph.load(res.artifact).header
    metrics = read_manifest(res.folder).metrics
    assert header["target_fingerprint"] == metrics["target_fingerprint"] == mine["target_fingerprint"]
    assert header["block_size"] == metrics["block_size"] == mine["block_size"] == 8
    assert locate(cfg) == Path(res.artifact)  # its own target: accepted

    world_target = cfg.model.target.path
    for extra, same_weights in (
        ([f"model.target.path={world_target}", "model.target.block_size=4"], True),  # the world's weights, L = 4
        ([f"model.target.path={_other_weights(Path(world_target), tmp_path / 'other')}"], False),
    ):
        other = attach_world(_cfg(root, f"decoder.artifact={res.artifact}", *extra), progress=False)
        theirs = target_identity(other)
        assert (theirs["target_fingerprint"] == mine["target_fingerprint"]) == same_weights
        differs = rf"block size {theirs['block_size']}, weights {theirs['target_fingerprint']}\)"
        command = r"python launch.py stage=spiffy model=micro " + " ".join(map(re.escape, extra))
        with pytest.raises(CheckpointError) as refused:
            locate(other)
        message = str(refused.value)
        assert "\n" not in message
        assert re.search(r"made for target micro-target \(block size 8, weights [0-9a-f]{12}\), not for model.target: "
                         rf"target micro-target \({differs}", message), message  # fmt: skip
        assert re.search(command + r" stage.rule=static stage.temperature=0.0, or set decoder.artifact", message)
        other.decoder.artifact = None
        with pytest.raises(CheckpointError, match=r"complete run\(s\) there are for another target or tokenizer"):
            locate(other)
