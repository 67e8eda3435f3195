"""DFlash drafters through the stages on the micro world (``model.drafter=micro-dflash``): stage=distill trains one
and exports a ``speculators`` folder, stage=decode with ``decoder=dflash_draft`` reproduces the verifier's greedy
output with it, stage=evaluate runs and discovers it; what DFlash training cannot do and wrong pairings are refused
with the fix, before any folder is made.

    python -m pytest tests/pipelines/test_dflash_pipeline.py -q
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from streakline.artifacts import read_manifest
from streakline.config import ConfigError, compose_config
from streakline.models import build
from streakline.models.dflash import DFlashModel
from streakline.models.dflash_checkpoint import load_dflash
from streakline.pipelines import run_stage
from streakline.world import attach_world

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENT = "dflash"
DFLASH = "model.drafter=micro-dflash"  # the role-swap shorthand for checkpoint@model.drafter=micro-dflash
PROMPT = "Sam has 3 apples."
DATA = [
    "data.max_prompts=16",
    "data.samples_per_prompt=1",
    "data.max_new_tokens=24",
    "data.num_shards=2",
    "data.batch_size=8",
]
TRAIN = [
    "trainer.max_steps=8",
    "trainer.micro_batch_size=2",
    "trainer.lr=3e-3",
    "trainer.warmup_steps=2",
    "trainer.save_every=4",
    "trainer.eval_every=8",
    "trainer.log_every=1",
    "trainer.eval_prompts=2",
    "trainer.windows_per_seq=4",
]


def _cfg(root, stage: str, *extra: str):
    return compose_config(
        [f"stage={stage}", "model=micro", f"run_root={root}", f"experiment.name={EXPERIMENT}", *DATA, *TRAIN, *extra]
    )


def _folders(root) -> list[Path]:
    return sorted(p for p in Path(root).rglob("*") if p.is_dir())


@pytest.fixture(scope="module")
def world(micro_world):
    root = micro_world[0]
    run_stage(_cfg(root, "trajectories"))
    return root


@pytest.fixture(scope="module")
def dflash_run(world):
    return run_stage(_cfg(world, "distill", DFLASH, "method=dflash_ce"))


def _decode(root, *extra):
    cfg = compose_config(["stage=decode", "model=micro", f"run_root={root}", "decoder.max_new_tokens=12", *extra])
    return run_stage(cfg).details["line"]


def test_dflash_ce_exports_a_speculators_drafter_that_decodes_like_the_verifier(world, dflash_run, capsys):
    run, folder = dflash_run.folder, dflash_run.artifact
    losses = [x["loss"] for x in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in x]
    assert len(losses) == 8 and sum(losses[-2:]) < sum(losses[:2])
    # the held-out checks ran through the DFlash paths (packed simulated streak, DFlashDrafter in the decoder)
    assert len(dflash_run.metrics["eval/tiny-math/alpha"]) == 4 and dflash_run.metrics["eval/tiny-math/decoder_streak"]

    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["speculators_model_type"] == "dflash"
    assert config["aux_hidden_state_layer_ids"] == [1, 2] and config["block_size"] == 5
    verifier = attach_world(_cfg(world, "distill"), False).model.verifier
    assert config["speculators_config"]["verifier"] == {
        "name_or_path": verifier.path,
        "architectures": ["Qwen2ForCausalLM"],
    }
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000004", "step-000008"]
    drafter, last = load_dflash(folder), load_dflash(run / "checkpoints" / "step-000008")
    assert isinstance(drafter, DFlashModel) and drafter.dflash.target_layer_ids == (1, 2)
    for (name, a), (_, b) in zip(drafter.state_dict().items(), last.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    # built from scratch, the run kept the weights it started from (dflash:base in stage=evaluate): the preset's
    # seeded initialisation, which training then moved
    cfg = attach_world(_cfg(world, "distill", DFLASH, "method=dflash_ce"), False)
    init, seeded = load_dflash(run / "init"), build(cfg.model.drafter, "drafter", seed=cfg.seed)
    assert "init" in read_manifest(run).outputs
    for (name, a), (_, b) in zip(init.state_dict().items(), seeded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert not torch.equal(init.state_dict()["fc.weight"], drafter.state_dict()["fc.weight"])
    for prompt in (f"prompt={PROMPT}", "prompt_ids=[5,6,7]"):
        vanilla = _decode(world, "decoder=vanilla", prompt)
        drafted = _decode(world, DFLASH, "decoder=dflash_draft", f"model.drafter.path={folder}", prompt)
        assert drafted["token_ids"] == vanilla["token_ids"]
        assert drafted["gamma"] == 4 and drafted["drafter_forwards"] >= 1  # unset gamma: block_size - 1
    capsys.readouterr()
    again = run_stage(_cfg(world, "distill", DFLASH, "method=dflash_ce"))  # complete: found, not retrained
    assert again.cached and again.folder == run
    assert "model.drafter=micro-dflash decoder=dflash_draft" in capsys.readouterr().out  # how to decode with it


def test_other_losses_train_dflash_drafters_and_evaluate_runs_them(world, dflash_run):
    res = run_stage(_cfg(world, "distill", DFLASH, "method=ce_streak", "trainer.max_steps=4", "trainer.eval_prompts=0"))
    assert json.loads((res.artifact / "config.json").read_text())["speculators_model_type"] == "dflash"
    # the drafter's kind is in the run key: the same method on the preset's plain drafter is another run
    from streakline.pipelines.distill import STAGE as DISTILL

    plain, dflash = (attach_world(_cfg(world, "distill", *x), False) for x in ([], [DFLASH]))
    assert DISTILL.key(plain)["gamma"] == DISTILL.key(dflash)["gamma"] == 4
    assert DISTILL.key(plain)["drafter"] != DISTILL.key(dflash)["drafter"]
    # stage=evaluate discovers DFlash runs as dflash_draft rows and runs one against vanilla, losslessly
    from streakline.pipelines.evaluate import discover

    found = discover(attach_world(_cfg(world, "evaluate"), False))
    rows = {m.drafter: m.decoder for m in found if m.drafter}
    assert rows[str(dflash_run.artifact)] == rows[str(res.artifact)] == "dflash_draft"
    # named dflash:<loss>; the DFlash lines of Fig. 7 start at dflash:base, the weights both runs started from
    named = {m.name: m for m in found if not m.curve}
    assert named["dflash:dflash_ce"].drafter == str(dflash_run.artifact)
    ce_streak = named["dflash:ce_streak"]
    assert (ce_streak.drafter, ce_streak.distill_loss) == (str(res.artifact), "ce_streak")
    start = named["dflash:base"]
    assert (start.decoder, start.steps, start.distill_loss) == ("dflash_draft", 0, None)
    assert start.drafter in (str(dflash_run.folder / "init"), str(res.folder / "init"))
    assert [m.name for m in found].count("dflash:base") == 1  # one seeded start: one row
    base = discover(attach_world(_cfg(world, "evaluate", DFLASH), False))
    names = {m.name: m.decoder for m in base}
    assert names["dflash:base"] == "dflash_draft" and "ar_draft" not in names
    # stage.base=false: only what training made and the references; no undistilled row (the preset's ar_draft and
    # base, dflash:base as the DFlash runs' start)
    trained = {m.name for m in discover(attach_world(_cfg(world, "evaluate", "stage.base=false"), False))}
    untrained = {"ar_draft", "base", "dflash:base"}
    assert trained == {m.name for m in found} - untrained and "dflash:ce_streak" in trained and "vanilla" in trained
    # stage.lookup=true: every DFlash run also decodes behind prompt lookup (decoder=dflash_lookup)
    hybrid = {
        m.name: m for m in discover(attach_world(_cfg(world, "evaluate", "stage.lookup=true"), False)) if not m.curve
    }
    assert set(hybrid) - set(named) == {"dflash_lookup:dflash_ce", "dflash_lookup:ce_streak"}
    looked = hybrid["dflash_lookup:ce_streak"]
    assert (looked.decoder, looked.drafter, looked.steps) == ("dflash_lookup", ce_streak.drafter, None)
    methods = [f"{{name: {name}, decoder: {decoder}, drafter: '{dflash_run.artifact}'}}"
               for name, decoder in (("dflash", "dflash_draft"), ("hybrid", "dflash_lookup"))]  # fmt: skip
    result = run_stage(
        _cfg(world, "evaluate", f"stage.methods=[{','.join(methods)}]", "stage.prompts=2", "stage.temperatures=[0.0]",
             "stage.benchmarks=[tiny-math]", "stage.max_new_tokens=8", "stage.block=false", "stage.figures=false")
    )  # fmt: skip
    records = {r["method"]: r for r in result.details["records"]}
    assert records["dflash"]["lossless"] and records["dflash"]["settings"]["gamma"] == 4
    assert records["hybrid"]["lossless"] and records["hybrid"]["settings"]["gamma"] == 4


# ZeRO-3 only: it partitions the weights as well as what ZeRO-2 partitions, and the DFlash drafter's shared frozen
# embedding and head are what could go wrong there; ZeRO-2 on two ranks is tests/pipelines/test_distill.py's (and
# the telemetry test's), 20 s each on 2 cores.
@pytest.mark.parametrize("stage", [3])
def test_zero_on_two_cpu_ranks_matches_one_process(world, stage):
    """DFlash training under DeepSpeed ZeRO-3 on two gloo ranks (each with its own frozen verifier) gives the single
    process's drafter: rank r reads micro-batch 2s + r, so the ranks see its batches split in halves."""
    # fp32 throughout (no bf16 autocast where the CPU has it): the sharded run must agree to fp32 rounding
    steps = ["method=dflash_ce", "trainer.max_steps=4", "trainer.save_every=4", "trainer.eval_every=4",
             "trainer.warmup_steps=1", "trainer.eval_prompts=0", "trainer.autocast=off"]  # fmt: skip
    single = run_stage(_cfg(world, "distill", DFLASH, *steps, "trainer.micro_batch_size=2"))
    ranks = [DFLASH, *steps, f"trainer=zero{stage}", "trainer.precision=fp32", "trainer.micro_batch_size=1"]
    overrides = ["model=micro", f"run_root={world}", f"experiment.name={EXPERIMENT}", *DATA, *TRAIN, *ranks]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "launch.py",
         "stage=distill", *overrides],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = run_stage(_cfg(world, "distill", *ranks))  # finds the 2-rank run complete: nothing retrained
    assert two.cached and two.folder != single.folder
    a, b = load_dflash(single.artifact).state_dict(), load_dflash(two.artifact).state_dict()
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=5e-3)


def test_zero3_in_bf16_checks_the_gathered_export_beside_the_verifier(world):
    """Under ZeRO-3 the held-out check runs on the export, which DeepSpeed gathers in fp32 on the CPU, while the
    verifier (whose embedding and head a DFlash drafter drafts through) is in the trainer's bf16, on the GPU there:
    the check casts and moves the export to the verifier's dtype and device (a bf16 H200 run failed on both). The run
    leaves torch.nn.functional.linear as it found it: ZeRO-3 swaps it process-wide, and left swapped it changed the
    rounding of every later in-process run (trajectory and distill tests that compare with a subprocess failed)."""
    linear = torch.nn.functional.linear
    run = run_stage(_cfg(world, "distill", DFLASH, "method=dflash_ce", "trainer=zero3", "trainer.precision=bf16",
                         "trainer.max_steps=4", "trainer.save_every=4", "trainer.eval_every=4",
                         "trainer.warmup_steps=1", "trainer.eval_prompts=1"))  # fmt: skip
    records = [json.loads(line) for line in (run.folder / "metrics.jsonl").read_text().splitlines()]
    checks = [r for r in records if any(k.endswith("/sim_streak") for k in r)]
    assert [r["step"] for r in checks] == [4]
    streaks = [v for k, v in checks[0].items() if k.endswith("/sim_streak")]
    assert streaks and all(0.0 <= v <= 4.0 for v in streaks)  # gamma = block_size - 1 = 4 slots at most
    assert torch.nn.functional.linear is linear


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["method=dflash_ce", "method.gamma=3"], "set method.gamma=4"),
        (["method=distillspec", "method.teacher=online", "method.onpolicy_mix=0.5"], "set method.onpolicy_mix=0"),
        (["method=dflash_ce", "trainer.lora.enabled=true"], "set trainer.lora.enabled=false"),
        (["method=mdm"], "adapts a standalone diffusion drafter"),
        (["method=dflash_ce", "method.draft_vocab=0"], r"must lie in 1 \.\. 384"),
        (["method=distillspec", "method.draft_vocab=64"], "train it with dflash_ce, dpace, streak or ce_streak"),
    ],
)
def test_what_dflash_training_cannot_do_is_refused_before_any_folder(world, overrides, match):
    before = _folders(world)
    with pytest.raises(ConfigError, match=match):
        run_stage(_cfg(world, "distill", DFLASH, *overrides))
    assert _folders(world) == before


def test_a_draft_vocabulary_is_built_from_the_training_data_stored_and_decoded_losslessly(world, capsys):
    """``method.draft_vocab=64``: the 64 most frequent target ids of the trajectories (eos among them) become the
    drafter's head; the export carries them as speculators does, decodes exactly like the verifier, and the run is
    keyed apart from the full-vocabulary one (whose key does not name the setting)."""
    from streakline.data.trajectories import load_trajectories
    from streakline.models.draft_vocab import DraftVocab, count_tokens
    from streakline.pipelines.common.lookup import trajectories_dir
    from streakline.pipelines.distill import STAGE as DISTILL

    steps = ["method=ce_streak", "trainer.max_steps=4", "trainer.eval_every=4", "trainer.save_every=4"]
    run = run_stage(_cfg(world, "distill", DFLASH, *steps, "method.draft_vocab=64"))
    assert "distill: draft vocabulary of 64 of 384 tokens" in capsys.readouterr().out
    config = json.loads((run.artifact / "config.json").read_text())
    assert config["draft_vocab_size"] == 64
    drafter = load_dflash(run.artifact)
    cfg = attach_world(_cfg(world, "distill", DFLASH, *steps, "method.draft_vocab=64"), False)
    counts = count_tokens(load_trajectories(trajectories_dir(cfg))["completion_ids"], 384)
    eos = json.loads((Path(cfg.model.verifier.path) / "config.json").read_text())["eos_token_id"]
    want = DraftVocab.from_counts(counts, 64, keep=[eos] if isinstance(eos, int) else eos)
    assert torch.equal(drafter.draft_vocab.ids, want.ids)
    verifier = build(cfg.model.verifier, "verifier")
    assert torch.equal(drafter.lm_head.weight, verifier.output_weight[want.ids])  # its rows, frozen through training
    assert load_dflash(run.folder / "init").draft_vocab is not None  # dflash:base drafts over it too
    assert any(m.startswith("eval/") for m in run.metrics)  # the held-out checks ran over the draft vocabulary
    vanilla = _decode(world, "decoder=vanilla", "prompt_ids=[5,6,7]")
    drafted = _decode(world, DFLASH, "decoder=dflash_draft", f"model.drafter.path={run.artifact}", "prompt_ids=[5,6,7]")
    assert drafted["token_ids"] == vanilla["token_ids"]
    full = attach_world(_cfg(world, "distill", DFLASH, *steps), False)
    assert "draft_vocab" not in DISTILL.key(full)["method"] and DISTILL.key(cfg)["method"]["draft_vocab"] == 64
    with pytest.raises(ConfigError, match="a DFlash drafter's head of its own"):
        run_stage(_cfg(world, "distill", *steps, "method.draft_vocab=64"))  # the world's plain drafter


def test_wrong_pairings_are_refused_with_the_fix(world, dflash_run):
    folder = dflash_run.artifact
    prompt = "prompt_ids=[5,6,7]"
    with pytest.raises(ConfigError, match="use decoder=dflash_draft"):
        _decode(world, "decoder=diffusion_draft", f"model.drafter.path={folder}", prompt)
    with pytest.raises(ConfigError, match="the drafter is a plain transformer"):
        _decode(world, "decoder=dflash_draft", prompt)
    # a verifier of another hidden size (the world's 32-wide drafter) cannot lend the DFlash drafter its head
    other = attach_world(_cfg(world, "decode"), False).model.drafter.path
    with pytest.raises(ConfigError, match="hidden size 64.*the verifier's is 32"):
        _decode(world, "decoder=dflash_draft", f"model.drafter.path={folder}", f"model.verifier.path={other}", prompt)
    with pytest.raises(ConfigError, match="pick the DFlash preset made for model.verifier=micro-verifier"):
        _cfg(world, "decode", "model.drafter=tiny-dflash")


# ------------------------------------------------------------------------------------------------------------------
# offline features (docs/dflash.md, Offline features): stage=trajectories stores the verifier's states at the
# drafter's layers, stage=distill trains from them

FEATURES = "data.feature_layers=[1,2]"  # micro-dflash's target_layer_ids
SHORT = ["method=dflash_ce", "trainer.max_steps=2", "trainer.eval_prompts=0"]


def _losses(run: Path) -> list[float]:
    return [x["loss"] for x in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in x]


def test_stored_features_are_the_verifiers_states_and_train_like_online(world, capsys):
    from streakline.alignment.dflash import verifier_features
    from streakline.data.features import StoredFeatures, feature_name
    from streakline.data.trajectories import load_trajectories

    capsys.readouterr()
    res = run_stage(_cfg(world, "trajectories", FEATURES))
    assert "verifier features of 2 layers x 64 in float16, at most" in capsys.readouterr().out
    shards = res.artifact
    assert sorted(p.name for p in shards.glob("features-*")) == [feature_name(0, 2), feature_name(1, 2)]
    stored = StoredFeatures(shards)
    dataset = load_trajectories(shards)
    assert stored.layers == (1, 2) and stored.rows == len(dataset) == 16
    # every row's features are the verifier's states at layers 1 and 2, recomputed here one row at a time
    verifier = build(attach_world(_cfg(world, "trajectories"), False).model.verifier, "verifier", inference=True)
    for i in (0, 15):
        seq = dataset[i]["prompt_ids"] + dataset[i]["completion_ids"]
        (alone,) = verifier_features(verifier, [seq], (1, 2), dtype=torch.float32)
        assert stored.row(i).shape == (len(seq), 128)
        torch.testing.assert_close(
            torch.from_numpy(stored.row(i)).float(), torch.from_numpy(alone), atol=1e-2, rtol=1e-3
        )
    # a missing feature file makes its shard incomplete: a rerun regenerates that shard alone, identically
    before = (shards / feature_name(1, 2)).read_bytes()
    (shards / feature_name(1, 2)).unlink()
    again = run_stage(_cfg(world, "trajectories", FEATURES))
    assert again.folder == res.folder and again.details["generated_shards"] == [1]
    assert (shards / feature_name(1, 2)).read_bytes() == before

    # distill from the stored features and online from the same trajectories: the same run but for the key, and the
    # same losses up to float16 rounding of the features
    offline = run_stage(_cfg(world, "distill", DFLASH, FEATURES, *SHORT, "method.features=stored"))
    online = run_stage(_cfg(world, "distill", DFLASH, FEATURES, *SHORT))
    assert offline.folder != online.folder
    a, b = _losses(offline.folder), _losses(online.folder)
    assert len(a) == len(b) == 2 and a != b
    torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-3, atol=1e-3)
    assert json.loads((offline.artifact / "config.json").read_text())["aux_hidden_state_layer_ids"] == [1, 2]


def test_new_feature_settings_at_their_defaults_leave_run_keys_alone(world):
    from streakline.pipelines.common.lookup import trajectories_key
    from streakline.pipelines.distill import STAGE as DISTILL

    cfg = attach_world(_cfg(world, "distill", DFLASH, "method=dflash_ce"), False)
    data = trajectories_key(cfg, "0" * 12)["data"]
    assert (
        "feature_layers" not in data and "max_feature_gb" not in data and "features" not in DISTILL.key(cfg)["method"]
    )
    stored = attach_world(_cfg(world, "distill", DFLASH, FEATURES, "method=dflash_ce", "method.features=stored"), False)
    assert trajectories_key(stored, "0" * 12)["data"]["feature_layers"] == [1, 2]
    assert DISTILL.key(stored)["method"]["features"] == "stored"
    # trainer.max_minutes (2026-12-04) unset and the check's soft streak (a report, even under a plateau stop on
    # sim_streak) are not in the key; a time budget, set, is: where it stops is the drafter
    trainer = DISTILL.key(cfg)["trainer"]
    assert "max_minutes" not in trainer and "eval_soft_streak" not in trainer
    plateau = ["method=dflash_ce", "trainer.patience=3", "trainer.eval_prompts=2"]
    soft = DISTILL.key(attach_world(_cfg(world, "distill", DFLASH, *plateau), False))
    hard = DISTILL.key(attach_world(_cfg(world, "distill", DFLASH, *plateau, "trainer.eval_soft_streak=false"), False))
    assert soft == hard and soft["trainer"]["eval_prompts"] == 2  # (with patience the check's own settings are)
    timed = attach_world(_cfg(world, "distill", DFLASH, "method=dflash_ce", "trainer.max_minutes=9"), False)
    assert DISTILL.key(timed)["trainer"]["max_minutes"] == 9


@pytest.mark.parametrize(
    ("stage", "overrides", "match"),
    [
        ("distill", [DFLASH, "method.features=stored"], r"set data.feature_layers=\[1,2\] in stage=trajectories"),
        ("distill", [DFLASH, "data.feature_layers=[2]", "method.features=stored"], r"are \[2\]: set"),
        ("distill", [FEATURES, "method.features=stored"], "the diffusion drafter reads none"),
        ("distill", [DFLASH, FEATURES, "method=distillspec", "method.teacher=online", "method.features=stored"],
         "use method.teacher=stored"),
        ("distill", [DFLASH, "method.features=offline"], "choose one of: online, stored"),
        ("trajectories", [FEATURES, "data.max_feature_gb=1e-6"], "past data.max_feature_gb=1e-06; raise"),
        ("trajectories", ["data.feature_layers=[3]"], "the verifier has 2 layers"),
        ("trajectories", ["data.feature_layers=[1,1]"], "must be distinct layer ids"),
    ],
)  # fmt: skip
def test_feature_refusals_name_the_fix_before_any_folder(world, stage, overrides, match):
    before = _folders(world)
    with pytest.raises(ConfigError, match=match):
        run_stage(_cfg(world, stage, *overrides))
    assert _folders(world) == before


def test_a_drafter_is_refused_under_a_verifier_tokenizer_it_was_not_trained_in(world, dflash_run, tmp_path):
    """The distill export records the verifier's tokenizer; stage=decode and stage=evaluate with a copy of that
    tokenizer whose ids are shuffled (same size, so nothing else tells) are refused in one line naming both hashes,
    before any row decodes or folder is made (issue 62, item 1); with the verifier's own it decodes as before."""
    from streakline.errors import UserError
    from streakline.models.dflash_checkpoint import recorded_tokenizer
    from streakline.models.tokenizer import load_tokenizer, tokenizer_hash
    from tests.models.helpers import permuted_tokenizer

    verifier = Path(attach_world(_cfg(world, "decode"), False).model.verifier.path)
    assert recorded_tokenizer(dflash_run.artifact)["hash"] == tokenizer_hash(load_tokenizer(verifier))
    permuted_tokenizer(verifier, tmp_path / "shuffled")
    theirs, mine = tokenizer_hash(load_tokenizer(tmp_path / "shuffled")), tokenizer_hash(load_tokenizer(verifier))
    other = f"model.verifier.tokenizer={tmp_path / 'shuffled'}"
    drafted = [DFLASH, "decoder=dflash_draft", f"model.drafter.path={dflash_run.artifact}", "prompt_ids=[5,6,7]"]
    with pytest.raises(UserError) as refused:
        _decode(world, *drafted, other)
    assert mine in str(refused.value) and theirs in str(refused.value) and "\n" not in str(refused.value)
    assert _decode(world, *drafted)["token_ids"] == _decode(world, "decoder=vanilla", "prompt_ids=[5,6,7]")["token_ids"]

    before = _folders(world)
    method = f"{{name: dflash, decoder: dflash_draft, drafter: '{dflash_run.artifact}'}}"
    with pytest.raises(UserError, match=f"{mine}.*{theirs}"):
        run_stage(_cfg(world, "evaluate", f"stage.methods=[{method}]", "stage.prompts=2", other))
    assert _folders(world) == before
