"""Experiment: every distillation loss on the tiny world, same data and steps, then the streak each drafter buys.

Trains the tiny drafter from the world's base checkpoint with ``streak``, ``ce_streak``, ``expce``, ``distillspec``
(tvd, stored top-k teacher) and ``ar_distill`` on the same verifier trajectories for the same number of steps, and
reports for the base drafter and each trained one:

- the simulated streak (``Σ_m Π_{j≤m} [argmax q_j = x_j]``) and alpha_1..alpha_gamma on held-out verifier greedy
  continuations of ``tiny-math`` / ``tiny-code`` prompts;
- the real decoder's mean accepted streak (``diffusion_draft``, K=1, gamma 8) at verifier temperature 0 and 1.

The paper's ordering is streak > DistillSpec > base, with AR-distillation helping slot 1 and collapsing later slots.
Not a test: nothing is asserted. Needs the tiny world and its trajectories (both are built when missing).

    python bench/distill_methods.py                    # about 8 minutes on 2 CPU cores
    python bench/distill_methods.py --steps 100 --prompts 8 --json out.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from streakline.alignment.streak import simulated_streak
from streakline.config import compose_config
from streakline.data import load_benchmark
from streakline.data.benchmarks import prompt_text
from streakline.decoding.drafters import DiffusionDrafter
from streakline.decoding.speculative import SpecConfig, generate
from streakline.decoding.vanilla import greedy_generate
from streakline.models import build, load_pretrained
from streakline.models.tokenizer import load_tokenizer
from streakline.pipelines import run_stage
from streakline.pipelines.common.roles import device
from streakline.world import attach_world

METHODS = [
    ("streak", []),
    ("ce_streak", []),
    ("expce", []),
    ("distillspec", ["method.divergence=tvd"]),
    ("ar_distill", ["method.divergence=tvd"]),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--prompts", type=int, default=24, help="held-out prompts per benchmark")
    ap.add_argument("--new", type=int, default=48, help="tokens per held-out continuation / decode")
    ap.add_argument("--experiment", default="distill-methods")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    base = [
        "model=tiny",
        f"experiment.name={args.experiment}",
        "data.topk_logprobs=8",
        "trainer.micro_batch_size=8",
        f"trainer.lr={args.lr}",
        "trainer.warmup_steps=20",
        f"trainer.max_steps={args.steps}",
        f"trainer.save_every={args.steps}",
        f"trainer.eval_every={args.steps}",
        "trainer.log_every=50",
        "trainer.wandb_project=null",
    ]
    t0 = time.perf_counter()
    run_stage(compose_config(["stage=trajectories", *base]))
    cfg = attach_world(compose_config(["stage=distill", *base]), progress=False, device=device())
    tok = load_tokenizer(cfg.model.verifier.tokenizer)
    verifier = build(cfg.model.verifier, "verifier").eval()
    gamma = cfg.model.drafter.gamma
    mask_id = build(cfg.model.drafter, "drafter").config.mask_token_id
    held = {}
    for name in ("tiny-math", "tiny-code"):
        prompts = [
            tok(prompt_text(r), add_special_tokens=False)["input_ids"] for r in load_benchmark(name, limit=args.prompts)
        ]
        held[name] = list(
            zip(prompts, greedy_generate(verifier, prompts, args.new, eos_token_id=tok.eos_token_id), strict=True)
        )

    drafters = {"base": cfg.model.drafter.path}
    for method, extra in METHODS:
        result = run_stage(compose_config(["stage=distill", *base, f"method={method}", *extra]))
        drafters[method] = str(result.artifact)

    rows = {}
    for label, folder in drafters.items():
        drafter = load_pretrained(folder).eval()
        row = {}
        for name, pairs in held.items():
            s = simulated_streak(drafter, pairs, gamma, mask_id)
            row[f"{name}/sim"] = s["mean_streak"]
            row[f"{name}/alpha"] = s["alpha"]
            for temperature in (0.0, 1.0):
                res = generate(
                    verifier,
                    [p for p, _ in pairs],
                    SpecConfig(max_new_tokens=args.new, gamma=gamma, temperature=temperature,
                               eos_token_id=tok.eos_token_id, seed=1),
                    drafter=DiffusionDrafter(drafter, temperature=0.0 if temperature == 0 else 1.0),
                )  # fmt: skip
                row[f"{name}/T{temperature:g}"] = res.metrics.accepted_per_cycle
        rows[label] = row

    print(
        f"\ntiny world, {args.steps} steps each (lr {args.lr}), gamma {gamma}, {args.prompts} held-out prompts per set"
    )
    head = f"{'drafter':<12}" + "".join(
        f"{c:>12}" for c in ("math sim", "math T0", "math T1", "code sim", "code T0", "code T1")
    )
    print(head)
    for label, r in rows.items():
        cells = [
            r["tiny-math/sim"],
            r["tiny-math/T0"],
            r["tiny-math/T1"],
            r["tiny-code/sim"],
            r["tiny-code/T0"],
            r["tiny-code/T1"],
        ]
        print(f"{label:<12}" + "".join(f"{c:>12.3f}" for c in cells))
    print("\nalpha_j on tiny-math (simulated, argmax drafts)")
    for label, r in rows.items():
        print(f"{label:<12}" + " ".join(f"{a:5.2f}" for a in r["tiny-math/alpha"]))
    print("\n(sim = simulated streak; T0 / T1 = the decoder's mean accepted draft tokens per cycle)")
    print(f"{time.perf_counter() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": args.steps, "lr": args.lr, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
