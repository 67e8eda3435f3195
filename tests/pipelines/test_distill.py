"""stage=distill on the micro world: the loss falls, the drafter exports and decodes, preemption resumes exactly,
LoRA merges on export, and ZeRO-2 / ZeRO-3 on 2 CPU ranks train like one process."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from streakline.alignment.trainer import FAULT_SIGTERM_AT
from streakline.artifacts import read_manifest
from streakline.config import ConfigError, compose_config
from streakline.config.schema import DecoderConfig
from streakline.data.trajectories import load_trajectories
from streakline.models import load_pretrained
from streakline.pipelines import run_stage
from streakline.pipelines.distill import method_key, train_temperature

ROOT = Path(__file__).resolve().parents[2]
DATA = [
    "data.max_prompts=16",
    "data.samples_per_prompt=1",
    "data.max_new_tokens=24",
    "data.num_shards=2",
    "data.batch_size=8",
    "data.topk_logprobs=4",
]
TRAIN = [
    "trainer.max_steps=12",
    "trainer.micro_batch_size=2",
    "trainer.lr=3e-3",
    "trainer.warmup_steps=2",
    "trainer.save_every=6",
    "trainer.eval_every=12",
    "trainer.log_every=1",
    "trainer.eval_prompts=2",
    "trainer.windows_per_seq=4",
]


def _overrides(root, experiment, *extra):
    return ["model=micro", f"run_root={root}", f"experiment.name={experiment}", *DATA, *TRAIN, *extra]


@pytest.fixture(scope="module")
def world(micro_world):
    root = micro_world[0]
    run_stage(compose_config(["stage=trajectories", *_overrides(root, "distill-data")]))
    return root


def _distill(root, experiment, *extra):
    return run_stage(compose_config(["stage=distill", *_overrides(root, experiment), *extra]))


def _losses(folder):
    lines = [json.loads(x) for x in (Path(folder) / "metrics.jsonl").read_text().splitlines()]
    return [x["loss"] for x in lines if "loss" in x]


def _weights(folder):
    return load_pretrained(folder).state_dict()


@pytest.fixture(scope="module")
def streak_run(world):
    return _distill(world, "distill-data", "method=streak")


def test_streak_distillation_lowers_the_loss_and_exports_a_decodable_drafter(world, streak_run, capsys):
    losses = _losses(streak_run.folder)
    assert len(losses) == 12
    assert sum(losses[-3:]) < sum(losses[:3])  # streak loss is -E[accepted]: it must fall as the drafter aligns
    metrics = streak_run.metrics
    assert "eval/tiny-math/sim_streak" in metrics and len(metrics["q_mean_j"]) == 4
    capsys.readouterr()
    out = run_stage(
        compose_config(
            ["stage=decode", "model=micro", f"run_root={world}", "decoder=diffusion_draft", "prompt_ids=[5,6,7]",
             f"model.drafter.path={streak_run.artifact}", "decoder.max_new_tokens=8"]
        )
    )  # fmt: skip
    vanilla = run_stage(
        compose_config(["stage=decode", "model=micro", f"run_root={world}", "decoder=vanilla", "prompt_ids=[5,6,7]",
                        "decoder.max_new_tokens=8"])
    )  # fmt: skip
    assert out.details["line"]["token_ids"] == vanilla.details["line"]["token_ids"]
    again = _distill(world, "distill-data", "method=streak")  # complete: found, not retrained
    assert again.cached and again.details["resumed_from"] is None


def test_preemption_saves_and_the_rerun_resumes_bit_exactly(world, streak_run):
    # another experiment folder, same settings: the same trajectories and, uninterrupted, the same drafter
    run_stage(compose_config(["stage=trajectories", *_overrides(world, "distill-preempt")]))
    env = dict(os.environ, **{FAULT_SIGTERM_AT: "4"})
    proc = subprocess.run(
        [sys.executable, "launch.py", "stage=distill", *_overrides(world, "distill-preempt", "method=streak",
                                                                     "trainer.save_every=100")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 143, proc.stderr[-3000:]
    assert "saving a checkpoint" in proc.stdout
    resumed = _distill(world, "distill-preempt", "method=streak", "trainer.save_every=100")
    assert resumed.details["resumed_from"] == 4
    ref, got = _weights(streak_run.artifact), _weights(resumed.artifact)
    assert ref.keys() == got.keys()
    for k in ref:
        assert torch.equal(ref[k], got[k]), k


def test_lora_exports_a_merged_checkpoint(world):
    res = _distill(world, "distill-data", "method=ce_streak", "trainer.lora.enabled=true", "trainer.lora.r=4",
                   "trainer.max_steps=4", "trainer.save_every=4", "trainer.eval_every=4")  # fmt: skip
    merged = _weights(res.artifact)
    assert not any("lora" in k for k in merged)
    base = compose_config(["stage=distill", *_overrides(world, "distill-data")])
    from streakline.world import attach_world

    base_weights = _weights(attach_world(base, progress=False).model.drafter.path)
    changed = [k for k in merged if not torch.equal(merged[k], base_weights[k])]
    assert changed and all(
        k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")) for k in changed
    )


def test_frozen_embeddings_train_only_the_layers(world, streak_run):
    res = _distill(world, "distill-data", "method=ce_streak", "trainer.freeze_embeddings=true",
                   "trainer.max_steps=4", "trainer.save_every=4", "trainer.eval_every=4")  # fmt: skip
    trained = _weights(res.artifact)
    from streakline.world import attach_world

    base = attach_world(compose_config(["stage=distill", *_overrides(world, "distill-data")]), progress=False)
    start = _weights(base.model.drafter.path)
    changed = {k for k in trained if not torch.equal(trained[k], start[k])}
    assert "embed.weight" not in changed and "lm_head.weight" not in changed
    assert any(k.startswith("layers.") for k in changed)
    assert "freeze_embeddings" in read_manifest(Path(res.artifact).parent).config["trainer"]
    # unset, the knob is not in the key: runs from before it existed keep their folders
    assert "freeze_embeddings" not in read_manifest(Path(streak_run.artifact).parent).config["trainer"]


def test_a_transformers_checkpoint_exports_as_a_drop_in_copy(world, tmp_path):
    """A drafter warm-started from a checkpoint transformers wrote (bf16, sharded, no private config block, no
    tokenizer) exports as that folder with new weights: same config.json and shards, loadable by transformers."""
    import transformers
    from safetensors import safe_open

    from streakline.world import attach_world

    world_drafter = attach_world(compose_config(["stage=distill", *_overrides(world, "distill-data")]), progress=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(world_drafter.model.drafter.path, dtype=torch.bfloat16)
    source = tmp_path / "hf-drafter"
    hf.save_pretrained(source, max_shard_size="40KB")
    raw = json.loads((source / "config.json").read_text())
    raw.pop("streakline", None)  # a hub checkpoint has no such block: the preset and mask_token_id say it all
    (source / "config.json").write_text(json.dumps(raw, indent=2))
    assert len(list(source.glob("model-*.safetensors"))) > 1 and not (source / "tokenizer.json").exists()

    res = _distill(world, "distill-data", "method=streak", f"model.drafter.path={source}", "trainer.max_steps=2",
                   "trainer.save_every=2", "trainer.eval_every=2")  # fmt: skip
    export = Path(res.artifact)
    assert json.loads((export / "config.json").read_text()) == raw
    shards = sorted(p.name for p in source.glob("*.safetensors"))
    assert sorted(p.name for p in export.glob("*.safetensors")) == shards
    with safe_open(export / shards[0], "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}  # noqa: SIM118
    assert (export / "tokenizer.json").is_file()  # the source has none: the run's tokenizer is saved beside it
    record = json.loads((export / "streakline.json").read_text())
    assert record["source"] == str(source) and record["step"] == 2 and record["method"]["name"] == "streak"

    theirs = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    ours = load_pretrained(export, dtype=torch.float32, attention="causal").eval()
    before = load_pretrained(source, dtype=torch.float32, attention="causal").eval()
    ids = torch.randint(0, ours.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids), atol=1e-4, rtol=0)
        assert not torch.allclose(ours(ids), before(ids), atol=1e-3)  # trained: the weights were replaced


def test_the_losses_train_at_the_decoders_drafter_temperature_unless_told_otherwise(streak_run):
    """One setting for both by default: q is trained at decoder.drafter_temperature, and the run key (manifest)
    records the temperature actually used."""
    assert (
        read_manifest(streak_run.folder).config["method"]["drafter_temperature"] == DecoderConfig().drafter_temperature
    )
    assert train_temperature(compose_config(["stage=distill", "decoder.drafter_temperature=2.0"])) == 2.0
    both = ["stage=distill", "decoder.drafter_temperature=2.0", "method.drafter_temperature=0.5"]
    assert train_temperature(compose_config(both)) == 0.5


def test_distillspec_reads_stored_teacher_logprobs(world):
    res = _distill(world, "distill-data", "method=distillspec", "method.divergence=tvd", "trainer.max_steps=3",
                   "trainer.save_every=3", "trainer.eval_every=3")  # fmt: skip
    assert len(_losses(res.folder)) == 3


@pytest.mark.parametrize("onpolicy", [0.0, 0.5])
def test_distillspec_with_an_online_verifier_teacher(world, onpolicy):
    res = _distill(world, "distill-data", "method=distillspec", "method.teacher=online", "method.divergence=jsd",
                   f"method.onpolicy_mix={onpolicy}", "trainer.max_steps=3", "trainer.save_every=3",
                   "trainer.eval_every=3")  # fmt: skip
    losses = _losses(res.folder)
    assert len(losses) == 3 and all(x > 0 for x in losses)  # a JSD between two different models is positive


def test_a_token_subset_an_epoch_cap_and_a_plateau_stop(world, capsys):
    """trainer.train_tokens reads a nested subset, max_epochs caps the steps, patience stops on a held-out plateau
    and the best check's export is the drafter (alignment/stopping.py)."""
    small = _distill(world, "distill-data", "method=streak", "trainer.train_tokens=120", "trainer.max_epochs=1",
                     "trainer.max_steps=100", "trainer.save_every=100")  # fmt: skip
    out = capsys.readouterr().out
    rows = int(re.search(r"trainer.train_tokens=120: (\d+) of 16 trajectories", out)[1])
    assert 1 <= rows < 16
    manifest = read_manifest(small.folder)
    assert manifest.config["trainer"]["subset"] == "prefix"  # the set's first rows: keyed apart from a sample
    steps, examples = manifest.metrics["steps"], manifest.metrics["run/dataset_examples"]
    assert steps == -(-examples // 2) and steps < 100  # one pass at 2 examples a step
    run = _distill(world, "distill-data", "method=streak", "trainer.train_tokens=120", "trainer.max_steps=40",
                   "trainer.eval_every=1", "trainer.patience=2", "trainer.save_every=100")  # fmt: skip
    m = read_manifest(run.folder).metrics
    assert m["stopped_at"] < 40 and m["steps"] == m["stopped_at"]  # a plateau on 2 held-out prompts, checked every step
    # two checks in a row without a new best spanning a pass, and not before the end of the warmup
    warmup = read_manifest(run.folder).config["trainer"]["warmup_steps"]
    assert m["stopped_at"] == max(m["best_step"] + max(2, -(-m["run/dataset_examples"] // 2)), warmup)
    best = Path(run.folder) / "checkpoints" / f"step-{m['best_step']:06d}"
    assert _weights(best).keys() == _weights(run.artifact).keys()
    assert all(torch.equal(a, _weights(run.artifact)[k]) for k, a in _weights(best).items())
    assert run.folder != small.folder
    total = sum(len(r) for r in load_trajectories(manifest.config["trajectories"])["completion_ids"])
    with pytest.raises(ConfigError, match=f"hold {total} completion tokens.*a higher data.max_prompts"):
        _distill(world, "distill-data", "method=streak", f"trainer.train_tokens={total + 1}")


def test_length_grouping_reaches_the_windows_and_the_key(world, streak_run, capsys):
    """trainer.length_grouping: distill groups its batches by length (alignment/data.py), says what share of the
    computed positions are real tokens against batches as drawn, and keys the run apart (other steps' batches)."""
    run = _distill(world, "distill-data", "method=streak", "trainer.length_grouping=4", "trainer.max_steps=3",
                   "trainer.save_every=3", "trainer.eval_every=3")  # fmt: skip
    found = re.search(r"trainer.length_grouping=4: (\d+)% of the positions .* real tokens \((\d+)% in batches as drawn",
                      capsys.readouterr().out)  # fmt: skip
    assert found and 0 < int(found[2]) <= int(found[1]) <= 100
    assert read_manifest(run.folder).config["trainer"]["length_grouping"] == 4
    assert run.folder != streak_run.folder and len(_losses(run.folder)) == 3
    # off (0, the default), the knob is not in the key: runs from before it existed keep their folders
    assert "length_grouping" not in read_manifest(Path(streak_run.artifact).parent).config["trainer"]


def test_a_time_budget_stops_the_run_with_a_last_check_and_export(world):
    """trainer.max_minutes: at the first logging step past the budget the run stops, checked and exported as the
    step at max_steps would be; the manifest says where and why. A budget of a microsecond has passed by step 3
    (the first logging step) on any machine. That check runs without its soft streak (trainer.eval_soft_streak)."""
    run = _distill(world, "distill-data", "method=streak", "trainer.max_minutes=1e-8", "trainer.max_steps=40",
                   "trainer.log_every=3", "trainer.eval_every=100", "trainer.save_every=100",
                   "trainer.eval_soft_streak=false")  # fmt: skip
    manifest = read_manifest(run.folder)
    m = manifest.metrics
    assert (m["stopped_at"], m["steps"], m["stopped_by"]) == (3, 3, "max_minutes")
    assert manifest.config["trainer"]["max_minutes"] == 1e-8  # set, it is part of the run key
    checked = [k for k in m if k.startswith("eval/")]  # the last step's held-out check ran (eval_every is 100)
    assert any(k.endswith("/sim_streak") for k in checked) and not any(k.endswith("/soft_streak") for k in checked)
    last = Path(run.folder) / "checkpoints" / "step-000003"
    assert all(torch.equal(a, _weights(run.artifact)[k]) for k, a in _weights(last).items())
    assert len(_losses(run.folder)) == 1  # logged at step 3 only, and no step after it


def test_missing_trajectories_are_refused(world):
    before = sorted(p for p in Path(world).rglob("*") if p.is_dir())
    with pytest.raises(ConfigError, match="no complete trajectories.*python launch.py stage=trajectories model=micro"):
        _distill(world, "distill-data", "data.max_prompts=3")
    assert sorted(p for p in Path(world).rglob("*") if p.is_dir()) == before  # refused: no folder left behind
    # self-chat prompts keep the evaluation prompts out, so the message names those settings too
    with pytest.raises(ConfigError, match="no complete trajectories.*give stage=trajectories the same"):
        _distill(world, "distill-data", "data.prompt_sources=[self-chat]", "data.mix_weights=[]", "data.max_prompts=3")
    with pytest.raises(ConfigError, match="method.teacher=online"):
        _distill(world, "distill-data", "method=streak", "method.onpolicy_mix=0.5")


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_on_two_cpu_ranks_matches_one_process(world, stage):
    # fp32 throughout (no bf16 autocast where the CPU has it): the sharded run must agree to fp32 rounding
    steps = ["method=streak", "trainer.max_steps=6", "trainer.save_every=6", "trainer.eval_every=6",
             "trainer.warmup_steps=1", "trainer.autocast=off"]  # fmt: skip
    single = _distill(world, "distill-data", *steps, "trainer.micro_batch_size=2")
    ranks = [*steps, f"trainer=zero{stage}", "trainer.precision=fp32", "trainer.micro_batch_size=1"]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "launch.py",
         "stage=distill", *_overrides(world, "distill-data", *ranks)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = _distill(world, "distill-data", *ranks)  # finds the 2-rank run complete: its folder, nothing retrained
    assert two.details["resumed_from"] is None and two.folder != single.folder
    losses = _losses(two.folder)
    assert len(losses) == 6 and losses[-1] < losses[0]
    # rank r reads micro-batch 2s + r: the two ranks see the single process's batches, split in halves
    a, b = _weights(single.artifact), _weights(two.artifact)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=5e-3)


def test_two_nodes_rendezvous_on_localhost_and_train(world):
    """Two torchrun invocations, as two Slurm nodes would start them, meet at a master address and train."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["method=expce", "trainer=zero2", "trainer.precision=fp32", "trainer.max_steps=3", "trainer.save_every=3",
            "trainer.eval_every=3"]  # fmt: skip
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                f"--node_rank={rank}",
                "--nproc_per_node=1",
                "--master_addr=127.0.0.1",
                f"--master_port={port}",
                "launch.py",
                "stage=distill",
                *_overrides(world, "distill-data", *args),
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for rank in (0, 1)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    done = _distill(world, "distill-data", *args)
    assert done.details["resumed_from"] is None and len(_losses(done.folder)) == 3


def test_method_knobs_added_later_leave_other_losses_keys_as_they_were():
    """dpace_alpha and the unset decay_gamma (both new on 2026-12-01) do not move the runs of losses that ignore
    them: their keys hold what keys held before (no dpace_alpha, decay_gamma 7.0); the losses that read them are
    keyed by their values."""
    for loss in ("streak", "ce_streak", "distillspec"):
        key = method_key(compose_config([f"method={loss}"]).method)
        assert "dpace_alpha" not in key and key["decay_gamma"] == 7.0
    assert method_key(compose_config(["method=dpace"]).method)["dpace_alpha"] == 0.5
    assert method_key(compose_config(["method=dflash_ce"]).method)["decay_gamma"] is None
    assert method_key(compose_config(["method=dflash_ce", "method.decay_gamma=5"]).method)["decay_gamma"] == 5.0
    # streak_smoothing (2026-12-02) at its default 0 is what every earlier ce_streak run trained with
    assert all(
        "streak_smoothing" not in method_key(compose_config([f"method={m}"]).method) for m in ("ce_streak", "dpace")
    )
    smoothed = method_key(compose_config(["method=ce_streak", "method.streak_smoothing=0.5"]).method)
    assert smoothed["streak_smoothing"] == 0.5
