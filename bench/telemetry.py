"""Benchmark: what training telemetry (streakline/alignment/telemetry.py) costs, side by side with a training step.

A drafter of the tests' tiny shape (2 layers, hidden 64) with an online teacher of the same shape, trained by a
one-rank DeepSpeed engine (ZeRO-0, fp32, ``trainer.profile=false``) on synthetic trajectories (prompt 16 + completion
48 tokens, 8 windows of 4 slots each). Three numbers, medians of interleaved repeats:

1. one training step (forward, backward, optimizer step) as the Trainer runs it, telemetry included;
2. the telemetry's own work per micro-step, alone: the phase clock around data, forward, backward and optimizer,
   the drafter's and teacher's block hooks firing on an input of the step's shape, and counting the batch's label
   tokens (which the loop did before telemetry too; printed apart);
3. one ``report`` (what a log step adds: the gather, peak memory, the gradient norm, the record).

and the overhead at ``--log-every``: (2 + 3 / log_every) / 1. The issue's goal is at most 2%. The tiny CPU step is
the worst case (the shortest step); on a GPU the per-step part stays host time and the step is
whatever the model makes it (the strategy takes the GPU when there is one). Not a test: nothing is asserted.

    python bench/telemetry.py                   # about 30 s on 2 CPU cores
    python bench/telemetry.py --log-every 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import datasets
import torch
from omegaconf import OmegaConf

from streakline.alignment.data import TrajectoryWindows
from streakline.alignment.losses import LossSettings
from streakline.alignment.strategy import DeepSpeedStrategy
from streakline.alignment.telemetry import Telemetry
from streakline.alignment.trainer import DraftTrainModule
from streakline.config.schema import TrainerConfig
from streakline.models import Transformer, TransformerConfig

V = 97  # the tests' tiny shapes (tests/models/helpers.py)
MASK = V - 1


def _model(**extra) -> Transformer:
    cfg = TransformerConfig(
        vocab_size=V, hidden_size=64, intermediate_size=88, num_layers=2, num_heads=4, num_kv_heads=2,
        family="qwen2", qkv_bias=True, **extra,
    )  # fmt: skip
    return Transformer(cfg)


def _setup(batch_size: int):
    cfg = OmegaConf.structured(
        TrainerConfig(
            name="cpu",
            zero_stage=0,
            precision="fp32",
            lr=1e-3,
            warmup_steps=1,
            max_steps=10**6,
            micro_batch_size=batch_size,
        )  # fmt: skip
    )
    strategy = DeepSpeedStrategy(cfg, seed=0)
    drafter = _model(attention="prefix_causal", mask_token_id=MASK).init_weights(seed=1)
    verifier = _model().init_weights(seed=2, std=0.1).eval().requires_grad_(False)
    module = DraftTrainModule(drafter, LossSettings(name="distillspec", divergence="fkl"), mask_id=MASK,
                              verifier=verifier)  # fmt: skip
    engine = strategy.setup(module)
    g = torch.Generator().manual_seed(0)
    n = 2 * batch_size
    rows = datasets.Dataset.from_dict(
        {
            "prompt_id": [f"p{i}" for i in range(n)], "sample_index": [0] * n, "seed": [0] * n,
            "finish_reason": ["eos"] * n,
            "prompt_ids": [torch.randint(0, MASK, (16,), generator=g).tolist() for _ in range(n)],
            "completion_ids": [torch.randint(0, MASK, (48,), generator=g).tolist() for _ in range(n)],
        }
    )  # fmt: skip
    batch = next(TrajectoryWindows(rows, gamma=4, mask_id=MASK, windows_per_seq=8).batches(batch_size))
    return cfg, strategy, engine, batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8, help="micro-batch (trajectories)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="training steps per repeat")
    args = parser.parse_args()
    torch.set_num_threads(1)

    cfg, strategy, engine, batch = _setup(args.batch)
    tel = Telemetry(strategy, engine, cfg)
    tel.start()

    def train_step():
        with tel.phase("data"):
            pass
        with tel.phase("forward"):
            loss, _ = engine(batch)
        strategy.step(engine, loss, clock=tel.clock)
        tel.count(batch)

    # the hooks as they fire in a step: one call per hooked block, on an input of the shape the step ran
    module = engine.module
    x = torch.zeros(*batch.clean.shape, module.drafter.config.hidden_size)
    hooked = [
        (b, list(b._forward_pre_hooks.values())) for b in (module.drafter.layers[0], module._verifier[0].layers[0])
    ]
    post = module._verifier[0].layers[-1]
    post_hooks = list(post._forward_hooks.values())

    def telemetry_only():
        with tel.phase("data"):
            pass
        with tel.phase("forward"):
            for block, hooks in hooked:
                for h in hooks:
                    h(block, (x,))
            for h in post_hooks:
                h(post, (x,), x)
        with tel.clock.phase("backward"):
            pass
        with tel.clock.phase("optimizer"):
            pass
        tel.count(batch)

    def per_call(fn, n):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n

    for _ in range(3):
        train_step()  # warm-up: DeepSpeed's first steps
    step, own, count, report = [], [], [], []
    for i in range(args.repeats):
        step.append(per_call(train_step, args.steps))
        own.append(per_call(telemetry_only, 2000))
        count.append(per_call(lambda: tel.count(batch), 2000))
        report.append(per_call(lambda i=i: tel.report(i + 1), 200))
    s, o, c, r = (statistics.median(v) for v in (step, own, count, report))
    print(f"device {strategy.device}, tiny drafter + online teacher, micro-batch {args.batch}, {args.repeats} repeats")
    print(f"  training step             {s * 1e3:9.2f} ms")
    print(f"  telemetry per micro-step  {o * 1e6:9.1f} us   (of which counting the batch {c * 1e6:.1f} us)")
    print(f"  one report (a log step)   {r * 1e6:9.1f} us")
    print(f"  overhead at log_every={args.log_every}: {(o + r / args.log_every) / s * 100:.3f}% of step time")


if __name__ == "__main__":
    main()
