"""The training module: online teacher logits per window equal the verifier on the trajectory, and on-policy windows
really replace the labels by drafter samples that the verifier then scores. The trainer's checkpoints: pruned to
trainer.keep_last DeepSpeed checkpoints (exports kept unless trainer.keep_exports is set), safe against a kill
mid-prune, and trainer.resume_from extending another run bit-exactly.

    python -m pytest tests/alignment/test_trainer.py -q
"""

import json
from pathlib import Path
from types import SimpleNamespace

import datasets
import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file

from streakline.alignment.data import TrajectoryWindows
from streakline.alignment.losses import LossSettings
from streakline.alignment.strategy import DeepSpeedStrategy, lr_lambda
from streakline.alignment.tracking import Tracker
from streakline.alignment.trainer import FAULT_SIGTERM_AT, DraftTrainModule, Preempted, Trainer, find_checkpoint
from streakline.config import ConfigError, compose_config
from streakline.config.schema import TrainerConfig
from streakline.models import Transformer
from streakline.pipelines.distill import STAGE as DISTILL
from tests.models.helpers import VOCAB, tiny_config

MASK = VOCAB - 1


def _batch():
    g = torch.Generator().manual_seed(0)
    rows = {
        "prompt_id": [],
        "sample_index": [],
        "seed": [],
        "finish_reason": [],
        "prompt_ids": [],
        "completion_ids": [],
    }
    for i, (p, c) in enumerate([(5, 9), (3, 4), (7, 12)]):
        rows["prompt_id"].append(f"p{i}")
        rows["sample_index"].append(0)
        rows["seed"].append(0)
        rows["finish_reason"].append("eos")
        rows["prompt_ids"].append(torch.randint(0, MASK, (p,), generator=g).tolist())
        rows["completion_ids"].append(torch.randint(0, MASK, (c,), generator=g).tolist())
    windows = TrajectoryWindows(datasets.Dataset.from_dict(rows), gamma=4, mask_id=MASK, windows_per_seq=4)
    return next(windows.batches(3))


def _module(onpolicy_mix):
    drafter = Transformer(tiny_config("qwen2", attention="prefix_causal", mask_token_id=MASK)).init_weights(seed=1)
    verifier = Transformer(tiny_config("qwen2")).init_weights(seed=2, std=0.1).eval()
    settings = LossSettings(name="distillspec", divergence="fkl")
    return DraftTrainModule(drafter, settings, mask_id=MASK, verifier=verifier, onpolicy_mix=onpolicy_mix)


def test_per_window_teacher_equals_the_verifier_on_the_trajectory():
    module, batch = _module(0.0), _batch()
    keep = batch.window_valid.flatten()
    labels = batch.labels.flatten(0, 1)[keep]
    valid = batch.valid.flatten(0, 1)[keep]
    per_window = module._window_teacher_logits(batch, labels)
    whole = module._teacher_logits(batch)[keep]
    torch.testing.assert_close(per_window[valid], whole[valid], rtol=1e-5, atol=1e-5)


def test_onpolicy_windows_are_resampled_and_offpolicy_ones_are_not():
    batch = _batch()
    off, on = _module(0.0), _module(1.0)
    losses_off = [float(off(batch)[0].detach()) for _ in range(2)]
    assert losses_off[0] == losses_off[1]  # P's labels: nothing random
    torch.manual_seed(1)
    a = float(on(batch)[0].detach())
    torch.manual_seed(2)
    b = float(on(batch)[0].detach())
    assert a != b and a != losses_off[0]  # drafter samples as labels, a fresh draw each time
    torch.manual_seed(1)
    assert float(on(batch)[0].detach()) == a  # and seeded like everything else, so resume stays exact


# ---------------------------------------------------------------------------------------------- checkpoints, resume
# Tiny runs of the real Trainer on a one-rank CPU DeepSpeed engine (ZeRO-0, fp32): checkpoints are pruned to
# trainer.keep_last (exports kept unless trainer.keep_exports says otherwise), a kill mid-prune loses nothing, and
# trainer.resume_from extends another run exactly.


def _cfg(**values):
    base = dict(name="cpu", zero_stage=0, precision="fp32", lr=3e-3, warmup_steps=1, max_steps=8,
                micro_batch_size=2, save_every=2, eval_every=100, log_every=1)  # fmt: skip
    return OmegaConf.structured(TrainerConfig(**{**base, **values}))


def _train(run_dir: Path, *, fit: bool = True, autocast: torch.dtype | None = None, evaluate=None, **values) -> Trainer:
    """A Trainer in ``run_dir`` (``values`` override the trainer settings), resumed and, with ``fit``, trained;
    ``evaluate``: the held-out check the trainer calls at its ``eval_every`` steps."""
    cfg = _cfg(**values)
    strategy = DeepSpeedStrategy(cfg, seed=0, autocast=autocast)
    drafter = Transformer(tiny_config("qwen2", attention="prefix_causal", mask_token_id=MASK)).init_weights(seed=1)
    engine = strategy.setup(DraftTrainModule(drafter, LossSettings(name="ce_streak"), mask_id=MASK))
    windows = TrajectoryWindows(_rows(), gamma=4, mask_id=MASK, windows_per_seq=4)

    def export(step, state):
        folder = run_dir / "checkpoints" / f"step-{step:06d}"
        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.clone() for k, v in state.items()}, folder / "model.safetensors")  # clone: tied weights
        return folder

    tracker = Tracker(run_dir / "metrics.jsonl")
    trainer = Trainer(strategy, engine, windows, cfg, run_dir, tracker, evaluate=evaluate, export=export)
    start = trainer.resume()
    if fit:
        trainer.fit(start_step=start)
    trainer.start = start
    return trainer


def _rows():
    g = torch.Generator().manual_seed(0)
    n = 6
    return datasets.Dataset.from_dict(
        {
            "prompt_id": [f"p{i}" for i in range(n)],
            "sample_index": [0] * n,
            "seed": [0] * n,
            "finish_reason": ["eos"] * n,
            "prompt_ids": [torch.randint(0, MASK, (4 + i,), generator=g).tolist() for i in range(n)],
            "completion_ids": [torch.randint(0, MASK, (8 + i,), generator=g).tolist() for i in range(n)],
        }
    )


def _tags(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "deepspeed").iterdir() if p.is_dir())


def _exports(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.engine.module.state_dict().items()}


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _logged(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A complete 4-step run (checkpoints at 2 and 4, all kept) that other runs extend; never written to again."""
    run_dir = tmp_path_factory.mktemp("finished")
    _train(run_dir, max_steps=4, keep_last=None)
    return run_dir


def test_keep_last_leaves_that_many_deepspeed_checkpoints_and_every_export(tmp_path, capsys):
    run = _train(tmp_path, keep_last=2)
    assert _tags(tmp_path) == ["step-000006", "step-000008"]
    assert (tmp_path / "deepspeed" / "latest").read_text() == "step-000008"
    assert _exports(tmp_path) == ["step-000002", "step-000004", "step-000006", "step-000008"]  # Fig. 7's points
    out = capsys.readouterr().out
    assert "distill: kept the last 2 checkpoints; removed step-000002" in out
    assert "removed step-000004" in out and "exports" not in out
    assert run.last_export == tmp_path / "checkpoints" / "step-000008"


def test_keep_last_none_keeps_every_checkpoint_and_keep_exports_prunes_exports(tmp_path, capsys):
    _train(tmp_path, keep_last=None, keep_exports=1)
    assert _tags(tmp_path) == ["step-000002", "step-000004", "step-000006", "step-000008"]
    assert _exports(tmp_path) == ["step-000008"]  # the final export, the one exported.json names, stays
    assert json.loads((tmp_path / "deepspeed" / "exported.json").read_text())["tag"] == "step-000008"
    assert "kept the last 1 exports; removed checkpoints/step-000006" in capsys.readouterr().out


def test_a_kill_mid_prune_loses_nothing_and_the_next_start_finishes_it(tmp_path):
    reference = _weights(_train(tmp_path, keep_last=None))
    # killed between the rename and the deletion: the oldest checkpoint and export sit under temp names
    for sub in ("deepspeed", "checkpoints"):
        (tmp_path / sub / "step-000002").rename(tmp_path / sub / ".step-000002.0badcafe.tmp")
    again = _train(tmp_path, fit=False, keep_last=2)  # a rerun: sweeps, resumes, then prunes what is left over
    assert again.start == 8
    _assert_same(reference, _weights(again))
    assert _tags(tmp_path) == ["step-000006", "step-000008"]
    assert _exports(tmp_path) == ["step-000004", "step-000006", "step-000008"]


def _logged_steps(run_dir: Path) -> list[int]:
    """The steps of the metrics log's lines, in file order: a step logged twice appears twice."""
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


class _Died(Exception):
    """The first attempt's end: its process gone before it saved anything."""


def test_a_restart_from_step_0_logs_every_step_once(tmp_path):
    """An attempt that dies before its first checkpoint leaves nothing to resume, so the rerun starts at step 0 and
    logs steps 1, 2, ... again; the dead attempt's lines go, and the log is an uninterrupted run's (issue 62,
    item 4), as a resume from a checkpoint forgets the steps past it."""
    reference = _logged(_train(tmp_path / "ref", max_steps=4, save_every=4).run_dir)

    def dies_at_3(step):  # after step 3 is logged, before any save (save_every=4)
        if step == 3:
            raise _Died
        return None

    with pytest.raises(_Died):
        _train(tmp_path / "run", max_steps=4, save_every=4, eval_every=1, evaluate=dies_at_3)
    assert _logged_steps(tmp_path / "run") == [1, 2, 3] and not (tmp_path / "run" / "deepspeed" / "latest").exists()
    again = _train(tmp_path / "run", max_steps=4, save_every=4)
    assert again.start == 0
    assert _logged_steps(tmp_path / "run") == [1, 2, 3, 4]
    assert [_logged(tmp_path / "run")[s]["loss"] for s in range(1, 5)] == [reference[s]["loss"] for s in range(1, 5)]


def test_resume_from_continues_another_run_bit_exactly(tmp_path, monkeypatch, capsys):
    uninterrupted = _weights(_train(tmp_path / "ref"))
    monkeypatch.setenv(FAULT_SIGTERM_AT, "4")  # run A stops at step 4 of the same 8-step schedule
    with pytest.raises(Preempted):
        _train(tmp_path / "a")
    monkeypatch.delenv(FAULT_SIGTERM_AT)
    extended = _train(tmp_path / "b", resume_from=str(tmp_path / "a"))
    assert extended.start == 4
    _assert_same(uninterrupted, _weights(extended))
    assert sorted(_logged(tmp_path / "b")) == [5, 6, 7, 8]
    assert _tags(tmp_path / "a") == ["step-000002", "step-000004"]  # the other run's folder is only read
    # a rerun of the extended run resumes from its own checkpoint, not from A's again
    capsys.readouterr()
    assert _train(tmp_path / "b", fit=False, resume_from=str(tmp_path / "a")).start == 8
    assert f"resumed from {tmp_path / 'b' / 'deepspeed' / 'step-000008'}" in capsys.readouterr().out


def test_resume_from_a_finished_run_trains_to_the_new_max_steps_on_the_new_schedule(tmp_path, finished):
    run = _train(tmp_path, resume_from=str(finished / "deepspeed"), max_steps=8, lr=6e-3)
    assert run.start == 4
    logged = _logged(tmp_path)
    assert sorted(logged) == [5, 6, 7, 8] and _tags(tmp_path) == ["step-000006", "step-000008"]
    schedule = lr_lambda(1, 8, TrainerConfig.min_lr_ratio)  # this run's: lr 6e-3, cosine over 8 steps
    for step in logged:
        assert logged[step]["lr"] == pytest.approx(6e-3 * schedule(step), rel=1e-12)
    named = _train(tmp_path / "named", fit=False, resume_from=str(finished / "deepspeed" / "step-000002"))
    assert named.start == 2


def test_resume_from_is_resolved_or_refused_before_any_folder_is_made(tmp_path, finished, monkeypatch):
    for given in (finished, finished / "deepspeed", finished / "deepspeed" / "step-000004"):
        assert find_checkpoint(given) == (finished / "deepspeed", "step-000004")
    assert find_checkpoint(finished / "deepspeed" / "step-000002") == (finished / "deepspeed", "step-000002")
    root = tmp_path / "runs"
    for path, message in (
        (tmp_path / "nowhere", r"trainer.resume_from=.*nowhere: no DeepSpeed checkpoint there; give a distill"),
        (finished, r"holds step 4 and trainer.max_steps=4 leaves nothing to train; set trainer.max_steps above 4"),
    ):
        cfg = compose_config(["stage=distill", f"run_root={root}", f"trainer.resume_from={path}",
                              "trainer.max_steps=4"])  # fmt: skip
        with pytest.raises(ConfigError, match=message):
            DISTILL.check(cfg)
    assert not root.exists()
    # the checkpoint is part of the run key; unset, the key is what it was before the setting existed. (The key's
    # trajectories folder needs the world's tokenizer, which this test does not build.)
    monkeypatch.setattr("streakline.pipelines.distill.trajectories_dir", lambda cfg: tmp_path / "trajectories")
    base = compose_config(["stage=distill", f"run_root={root}"])
    assert "resume_from" not in DISTILL.key(base)["trainer"]
    extended = compose_config(["stage=distill", f"run_root={root}", f"trainer.resume_from={finished}"])
    assert DISTILL.key(extended)["trainer"]["resume_from"] == str(finished / "deepspeed" / "step-000004")
    pruned = compose_config(["stage=distill", f"run_root={root}", "trainer.keep_last=5", "trainer.keep_exports=3"])
    assert DISTILL.key(pruned) == DISTILL.key(base)  # pruning is cadence: it does not move the run


def test_the_strategy_asks_deepspeed_for_autocast_over_fp32_weights_only():
    base = dict(micro_batch_size=2, grad_accum=1, grad_clip=1.0, zero_stage=0)
    strategy = DeepSpeedStrategy(SimpleNamespace(precision="fp32", **base), autocast=torch.bfloat16)
    config = strategy.ds_config()
    assert config["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"} and "bf16" not in config
    assert "torch_autocast" not in DeepSpeedStrategy(SimpleNamespace(precision="fp32", **base)).ds_config()
    with pytest.raises(ValueError, match="fp32 weights"):
        DeepSpeedStrategy(SimpleNamespace(precision="bf16", **base), autocast=torch.bfloat16)


def test_a_one_rank_cpu_engine_takes_gloos_path_and_builds_no_shared_memory_op():
    # DeepSpeed's comm backend is created with the first engine of a process; for a group of one it must hold no
    # shared-memory all-reduce (a C++ op compiled on first use: ~30 s, again for every new virtual environment)
    import deepspeed.comm.comm as ds_comm

    cfg = SimpleNamespace(precision="fp32", micro_batch_size=2, grad_accum=1, grad_clip=1.0, zero_stage=0, lr=1e-3,
                          warmup_steps=1, max_steps=2, min_lr_ratio=0.1)  # fmt: skip
    strategy = DeepSpeedStrategy(cfg, seed=0)
    engine = strategy.setup(torch.nn.Linear(4, 4))
    before = engine.module.weight.detach().clone()
    assert strategy.world_size == 1 and ds_comm.cdb is not None and ds_comm.cdb.shm_comm_op is None
    loss = engine(torch.ones(2, 4)).square().mean()
    strategy.step(engine, loss)  # and the engine still trains: gloo's all-reduce over one rank
    assert not torch.equal(engine.module.weight, before)
    strategy.close()


def test_mixed_precision_keeps_fp32_weights_and_trains_as_fp32_does(tmp_path):
    """DeepSpeed's autocast over an fp32 trainer (stage=distill where bf16 is native): the weights and their
    updates stay fp32, the forwards really run in bf16 (the run differs from fp32's), and 8 steps move the weights
    where fp32's moved them, up to bf16's rounding."""
    start = Transformer(tiny_config("qwen2", attention="prefix_causal", mask_token_id=MASK)).init_weights(seed=1)
    runs = {name: _train(tmp_path / name, autocast=dtype) for name, dtype in (("fp32", None), ("bf16", torch.bfloat16))}
    weights = {name: dict(run.engine.module.drafter.named_parameters()) for name, run in runs.items()}
    moved = apart = 0.0
    for name, w0 in start.named_parameters():
        w32, w16 = weights["fp32"][name], weights["bf16"][name]
        assert w16.dtype == torch.float32
        moved += float((w32 - w0).norm() ** 2)
        apart += float((w16 - w32).norm() ** 2)
    assert 0 < apart < 0.2**2 * moved, (apart, moved)  # 0.05 here: bf16 rounding, not another trajectory


def test_a_full_disk_ends_a_deepspeed_save_in_one_line_and_leaves_no_half_checkpoint(tmp_path, small_disk):
    """torch's checkpoint writer reports a full disk as "enforce fail at inline_container.cc ... file write failed";
    the strategy says it in the project's one line, and takes the half-written tag away so a rerun resumes from the
    last whole checkpoint."""
    from streakline.errors import DiskFullError

    trainer = _train(tmp_path / "run", fit=False)
    trainer.strategy.save(trainer.engine, tmp_path / "probe", "step-000001", {"step": 1})
    size = sum(p.stat().st_size for p in (tmp_path / "probe").rglob("*") if p.is_file())
    disk = small_disk(max(16, size // 2 // 1024))  # half of what one checkpoint needs
    with pytest.raises(DiskFullError, match=r"the disk is full: a write under .*step-000002 failed"):
        trainer.strategy.save(trainer.engine, disk, "step-000002", {"step": 2})
    assert not (disk / "step-000002").exists() and not (disk / "latest").exists()
