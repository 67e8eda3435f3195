"""Training telemetry (streakline/alignment/telemetry.py) on tiny real runs of the Trainer on CPU DeepSpeed engines:

- the logged gradient norm is the global norm before clipping, equal to ``torch.nn.utils.clip_grad_norm_`` on an
  independent replay of the same steps (plain torch: the same batches, AdamW, schedule and clipping), on one
  process (ZeRO-0, where the strategy computes it) and on two gloo ranks under ZeRO-2 (DeepSpeed's own);
- the token counts behind MFU are the shapes the drafter and the teacher ran (a standalone drafter with an online
  teacher, a DFlash drafter with its verifier), and the MFU arithmetic; the phase clock nests and syncs;
- the label tokens seen survive a preemption and resume; the run's shape reaches the W&B config (offline) and the
  result metrics (the manifest), and wall-clock numbers stay out of the latter; ``trainer.profile`` is cadence.

    python -m pytest tests/alignment/test_telemetry.py -q

This file is also the script of the two ranks: ``python -m torch.distributed.run --nproc_per_node 2 -m
tests.alignment.test_telemetry <run_dir>`` trains two steps under ZeRO-2 into ``<run_dir>``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from streakline.alignment.data import TrajectoryWindows
from streakline.alignment.losses import LossSettings
from streakline.alignment.strategy import DeepSpeedStrategy, lr_lambda
from streakline.alignment.telemetry import (
    PhaseClock,
    Telemetry,
    device_peak_tflops,
    is_wall_clock,
    mfu,
    model_flops,
    parameter_counts,
)
from streakline.alignment.tracking import Tracker
from streakline.alignment.trainer import FAULT_SIGTERM_AT, DraftTrainModule, Preempted, Trainer, progress
from streakline.config.schema import TrainerConfig
from streakline.models import Transformer
from tests.alignment.test_trainer import _rows
from tests.models.helpers import VOCAB, tiny_config

ROOT = Path(__file__).resolve().parents[2]
MASK = VOCAB - 1
CLIP = 0.05  # far below the tiny drafter's gradient norms, so a norm logged after clipping would read 0.05
MICRO = 2


def _cfg(**values):
    base = dict(name="cpu", zero_stage=0, precision="fp32", lr=3e-3, warmup_steps=1, max_steps=2,
                micro_batch_size=MICRO, grad_clip=CLIP, save_every=100, eval_every=100, log_every=1)  # fmt: skip
    return OmegaConf.structured(TrainerConfig(**{**base, **values}))


def _windows() -> TrajectoryWindows:
    return TrajectoryWindows(_rows(), gamma=4, mask_id=MASK, windows_per_seq=4)


def _module(teacher: bool = False) -> DraftTrainModule:
    drafter = Transformer(tiny_config("qwen2", attention="prefix_causal", mask_token_id=MASK)).init_weights(seed=1)
    if not teacher:
        return DraftTrainModule(drafter, LossSettings(name="ce_streak"), mask_id=MASK)
    verifier = Transformer(tiny_config("qwen2")).init_weights(seed=2, std=0.1).eval().requires_grad_(False)
    settings = LossSettings(name="distillspec", divergence="fkl")
    return DraftTrainModule(drafter, settings, mask_id=MASK, verifier=verifier)


def _trainer(run_dir: Path, tracker: Tracker | None = None, teacher: bool = False, **values) -> Trainer:
    cfg = _cfg(**values)
    strategy = DeepSpeedStrategy(cfg, seed=0)
    engine = strategy.setup(_module(teacher))
    tracker = tracker or Tracker(run_dir / "metrics.jsonl", enabled=strategy.is_main)
    return Trainer(strategy, engine, _windows(), cfg, run_dir, tracker)


def _logged(run_dir: Path) -> dict[int, dict]:
    """Every step's records of the metrics log merged (the training line, then an evaluation's)."""
    out: dict[int, dict] = {}
    for record in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()):
        out.setdefault(record["step"], {}).update(record)
    return out


def _replayed_norms(steps: int, world: int) -> list[float]:
    """The gradient norm before clipping at each of ``steps`` optimizer steps, replayed in plain torch: rank r of
    ``world`` reads micro-batch ``s * world + r`` at step s; DeepSpeed averages the ranks' gradients, clips them to
    ``CLIP`` and steps AdamW on the warmup+cosine schedule (``DeepSpeedStrategy.setup``)."""
    cfg = _cfg()
    module = _module()
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio))
    stream = _windows().batches(MICRO)
    norms = []
    for _ in range(steps):
        grads = []
        for _ in range(world):
            opt.zero_grad()
            module(next(stream))[0].backward()
            grads.append([p.grad.clone() for p in params])
        for p, *per_rank in zip(params, *grads, strict=True):
            p.grad = torch.stack(per_rank).mean(0)
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, max_norm=CLIP)))
        opt.step()
        sched.step()
    return norms


def test_the_logged_gradient_norm_is_the_norm_before_clipping(tmp_path):
    _trainer(tmp_path).fit()
    logged = _logged(tmp_path)
    expected = _replayed_norms(steps=2, world=1)
    assert min(expected) > 10 * CLIP  # clipping was active: a clipped norm would read CLIP
    for step, norm in zip((1, 2), expected, strict=True):
        assert logged[step]["grad_norm"] == pytest.approx(norm, rel=1e-5), step


@pytest.mark.distributed
def test_zero2_on_two_ranks_logs_deepspeed_global_norm(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
         "tests.alignment.test_telemetry", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    logged = _logged(tmp_path)
    for step, norm in zip((1, 2), _replayed_norms(steps=2, world=2), strict=True):
        assert logged[step]["grad_norm"] == pytest.approx(norm, rel=1e-5), step
    # both ranks' label tokens: rank r read micro-batch 2s + r, so the two steps read batches 0-3
    stream = _windows().batches(MICRO)
    assert logged[2]["label_tokens_seen"] == sum(int(next(stream).valid.sum()) for _ in range(4))
    assert logged[2]["zero_stage"] == 2


def test_token_counts_are_the_shapes_the_drafter_and_the_teacher_ran(tmp_path):
    cfg = _cfg()
    strategy = DeepSpeedStrategy(cfg, seed=0)
    module = _module(teacher=True)
    engine = strategy.setup(module)
    tel = Telemetry(strategy, engine, cfg)
    batch = next(_windows().batches(3))
    B, T = batch.clean.shape
    _, W, G = batch.labels.shape
    tel.start()
    with tel.phase("forward"):
        engine(batch)
    engine(batch)  # outside the train step's forward (an evaluation): not counted
    tel.stop()
    engine(batch)  # hooks removed
    # packed prefix_causal layout [clean ; W windows of G slots] per row; the online teacher reads the clean rows
    assert tel.local["drafter_tokens"] == B * (T + W * G)
    assert tel.local["teacher_tokens"] == B * T
    assert tel.clock.totals["teacher"] > 0 and tel.clock.totals["forward"] > tel.clock.totals["teacher"]
    counts = parameter_counts(engine.module)
    assert counts["trainable"] == sum(p.numel() for p in module.drafter.parameters())
    assert counts["frozen"] == 0
    assert counts["teacher"] == sum(p.numel() for p in module._verifier[0].parameters())


def test_token_counts_of_a_dflash_drafter_and_its_verifier():
    from streakline.alignment.dflash import DFlashTrainModule
    from tests.alignment.test_dflash_training import BLOCK, _batch, _drafter, _verifier
    from tests.alignment.test_dflash_training import _rows as dflash_rows

    cfg = _cfg()
    strategy = DeepSpeedStrategy(cfg, seed=0)
    verifier = _verifier()
    engine = strategy.setup(DFlashTrainModule(_drafter(verifier), verifier, LossSettings(name="dflash_ce")))
    tel = Telemetry(strategy, engine, cfg)
    batch = _batch(dflash_rows())
    B, T = batch.clean.shape
    W = batch.offsets.shape[1]
    tel.start()
    with tel.phase("forward"):
        engine(batch)
    tel.stop()
    # the verifier runs over the clean rows for its layer states (online features); the drafter one block of
    # block_size positions per window, filler windows included
    assert tel.local["teacher_tokens"] == B * T
    assert tel.local["drafter_tokens"] == B * W * BLOCK
    assert tel.params["teacher"] == sum(p.numel() for p in verifier.parameters())


def test_mfu_arithmetic_and_peak_table():
    # 1B trainable drafter parameters over 4096 tokens, a 7B teacher forward over 2048 tokens
    flops = model_flops(10**9, 4096, 7 * 10**9, 2048)
    assert flops == 6 * 4096e9 + 2 * 7 * 2048e9
    # 8 H100 SXM for half a second: 989.4 TFLOP/s each
    assert mfu(flops, 0.5, 8, device_peak_tflops("NVIDIA H100 80GB HBM3")) == pytest.approx(
        flops / 0.5 / (8 * 989.4e12), rel=1e-12
    )
    assert device_peak_tflops("NVIDIA A100-SXM4-80GB") == device_peak_tflops("NVIDIA A100 80GB PCIe") == 312.0
    assert device_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert device_peak_tflops("NVIDIA H200") == 989.4
    for other in ("cpu", "Tesla V100-SXM2-32GB", "NVIDIA L4"):
        assert device_peak_tflops(other) is None
        assert mfu(flops, 0.5, 8, device_peak_tflops(other)) is None


def offline_run(run_dir: Path) -> dict:
    """A 2-step run of the real Trainer with an online teacher and a held-out evaluation at step 2, logged to
    W&B offline (conftest's ``offline_run`` fixture shares it with tests/alignment/test_dashboard.py): the trainer,
    fit's result, the metrics.jsonl records and what the W&B transaction log holds (config, history keys, run)."""
    from streakline.alignment.heldout import HeldoutEvaluator
    from tests.launch.test_slurm import _wandb_records

    tracker = Tracker(run_dir / "metrics.jsonl", project="telemetry-test", run_id="t1", group="g", job_type="distill")
    trainer = _trainer(run_dir, tracker=tracker, teacher=True)
    module = trainer.engine.module
    # the evaluator's own __init__ renders prompt sources with a tokenizer, which these id-level models lack; its
    # __call__ (what names the eval metrics) needs only the prompt/continuation pairs
    evaluator = HeldoutEvaluator.__new__(HeldoutEvaluator)
    g = torch.Generator().manual_seed(3)
    pairs = [(torch.randint(0, MASK, (6,), generator=g).tolist(), torch.randint(0, MASK, (8,), generator=g).tolist())
             for _ in range(2)]  # fmt: skip
    evaluator.verifier, evaluator.gamma, evaluator.mask_id, evaluator.soft = module._verifier[0], 4, MASK, True
    evaluator.pairs = {"tiny-math": pairs}
    trainer.evaluate = lambda step: evaluator(step, module.drafter)
    trainer.cfg.eval_every = 2
    result = trainer.fit()
    tracker.close()
    (log,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    config, history, run = {}, set(), None
    for rec in _complete_records(log, _wandb_records):
        kind = rec.WhichOneof("record_type")
        if kind == "config":
            config.update({item.key: json.loads(item.value_json) for item in rec.config.update})
        elif kind == "history":
            history |= {item.key or "/".join(item.nested_key) for item in rec.history.item}
        elif kind == "run":
            run = rec.run
    return {"trainer": trainer, "result": result, "logged": _logged(run_dir), "config": config, "history": history,
            "run": run}  # fmt: skip


def _complete_records(log: Path, read, timeout_s: float = 60.0) -> list:
    """The records of W&B transaction log ``log`` once its ``exit`` record is written: W&B's service writes the
    file on its own, and under pytest's output capture ``finish()`` was seen to return before it had (a read then
    found no config and no history records)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            records = list(read(log))
        except Exception:  # noqa: BLE001 - a chunk cut off mid-write does not parse yet
            records = []
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        if time.monotonic() > deadline:
            pytest.fail(f"{log} has no exit record after {timeout_s:.0f} s: the W&B run never finished writing")
        time.sleep(0.2)


def test_a_run_logs_telemetry_and_its_shape_and_keeps_wall_clock_out_of_its_result(offline_run):
    trainer, result, record = offline_run["trainer"], offline_run["result"], offline_run["logged"][2]
    for key in ("grad_norm", "step_time", "label_tokens_per_s", "label_tokens_per_s_per_rank", "samples_per_s",
                "label_tokens_seen", "tflops_per_s", "memory/peak_rss_gb", "time/data", "time/teacher",
                "time/drafter", "time/optimizer", "time/checkpoint", "time/other"):  # fmt: skip
        assert record[key] is not None, key
    assert record["mfu"] is None  # a CPU has no bf16 peak in the table
    assert record["time/teacher"] > 0  # the online teacher ran inside every forward
    stream = _windows().batches(MICRO)
    assert record["label_tokens_seen"] == sum(int(next(stream).valid.sum()) for _ in range(2))

    rows = _rows()
    shape = {
        "nodes": 1, "ranks_per_node": 1, "world_size": 1, "device": "cpu", "micro_batch_size": MICRO,
        "grad_accum": 1, "global_batch": MICRO, "zero_stage": 0, "precision": "fp32",
        "params_trainable": trainer.telemetry.params["trainable"], "params_frozen": 0,
        "params_teacher": trainer.telemetry.params["teacher"], "dataset_examples": len(trainer.windows),
        "dataset_tokens": sum(map(len, rows["prompt_ids"])) + sum(map(len, rows["completion_ids"])),
        "peak_tflops": "unknown",
    }  # fmt: skip
    assert trainer.telemetry.params["teacher"] > 0
    for key, value in shape.items():
        assert result[f"run/{key}"] == value, key
    assert not [k for k in result if is_wall_clock(k)]
    assert result["grad_norm"] == record["grad_norm"] and result["loss"] == record["loss"]
    assert result["eval/tiny-math/sim_streak"] == record["eval/tiny-math/sim_streak"]

    config, history, run = offline_run["config"], offline_run["history"], offline_run["run"]
    assert config["run"]["world_size"] == 1 and config["run"]["global_batch"] == MICRO
    assert config["run"]["params_teacher"] == shape["params_teacher"]
    assert {"grad_norm", "step_time", "label_tokens_per_s", "time/teacher", "memory/peak_rss_gb"} <= history
    assert "mfu" not in history  # None: left out of W&B (null in metrics.jsonl)
    assert (run.run_group, run.job_type) == ("g", "distill")


def test_label_tokens_seen_survive_a_preemption(tmp_path, monkeypatch):
    _trainer(tmp_path / "ref", max_steps=4).fit()
    monkeypatch.setenv(FAULT_SIGTERM_AT, "2")
    with pytest.raises(Preempted):
        _trainer(tmp_path / "cut", max_steps=4).fit()
    monkeypatch.delenv(FAULT_SIGTERM_AT)
    again = _trainer(tmp_path / "cut", max_steps=4)
    again.fit(start_step=again.resume())
    ref, cut = _logged(tmp_path / "ref"), _logged(tmp_path / "cut")
    assert sorted(cut) == [1, 2, 3, 4]
    assert [cut[s]["label_tokens_seen"] for s in cut] == [ref[s]["label_tokens_seen"] for s in cut]
    assert [cut[s]["grad_norm"] for s in cut] == [ref[s]["grad_norm"] for s in cut]  # bit-exact resume


def test_phase_clock_nests_and_syncs_around_every_phase():
    calls = []
    clock = PhaseClock(sync=lambda: calls.append(clock.current))
    with clock.phase("forward"):
        with clock.phase("teacher"):
            assert clock.current == "teacher"
        clock.start("teacher")  # left open (an exception in the teacher): closed with its parent
    assert clock.current is None
    # profile=true: a sync before each start and each stop, so device work lands in the phase that launched it
    assert calls == [None, "forward", "teacher", "forward", "teacher"]
    totals = clock.take()
    assert set(totals) == {"forward", "teacher"} and totals["forward"] >= totals["teacher"] >= 0
    assert clock.take() == {}


def test_progress_bar_fields():
    record = {"loss": 0.5, "lr": 1e-4, "step_time": 0.25, "label_tokens_per_s": 1234.5}
    assert progress(record) == {"loss": "0.5000", "lr": "1.00e-04", "step": "0.25s", "tok/s": "1234"}
    assert progress({**record, "memory/peak_allocated_gb": 12.34})["mem"] == "12.3G"


def test_profile_is_cadence(tmp_path, monkeypatch):
    from streakline.config import compose_config
    from streakline.pipelines.distill import STAGE as DISTILL

    monkeypatch.setattr("streakline.pipelines.distill.trajectories_dir", lambda cfg: tmp_path / "trajectories")
    base = compose_config(["stage=distill", f"run_root={tmp_path}"])
    profiled = compose_config(["stage=distill", f"run_root={tmp_path}", "trainer.profile=true"])
    assert profiled.trainer.profile and DISTILL.key(profiled) == DISTILL.key(base)


def _ranks(run_dir: str, zero_stage: int = 2) -> None:
    """One of the two ranks of ``test_zero2_on_two_ranks_logs_deepspeed_global_norm``."""
    trainer = _trainer(Path(run_dir), zero_stage=zero_stage)
    trainer.fit()
    assert math.isfinite(trainer.strategy.grad_norm(trainer.engine))


if __name__ == "__main__":
    _ranks(sys.argv[1], *map(int, sys.argv[2:]))
