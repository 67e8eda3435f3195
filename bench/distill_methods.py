"""Experiment: every distillation loss on the tiny world, same data and steps, then the streak each drafter buys.

Trains the tiny drafter from the world's base checkpoint with ``streak``, ``ce_streak``, ``expce``, ``distillspec``
(fkl and tvd, from the stored top-8 teacher and from the online verifier) and ``ar_distill`` on the same verifier
trajectories for the same number of steps, once per seed (``--seeds``: the seed of the trajectories, sampled
afresh per seed, and of the training run; the held-out prompts and the decoder's sampling seed stay fixed; within a
seed every method sees the same data), and reports for the base
drafter, each trained one and the base drafter run as an AR drafter (``ar_draft``: the tiny drafter's clean prefix
is a causal LM):

- the simulated streak (``Σ_m Π_{j≤m} [argmax q_j = x_j]``) and alpha_1..alpha_gamma on held-out verifier greedy
  continuations of ``tiny-math`` / ``tiny-code`` prompts (not for ar_draft);
- the real decoder's mean accepted streak (K=1, gamma 8) at verifier temperature 0 and 1.

With several seeds each cell is the mean and the spread (sample standard deviation) over seeds, and the summary
gives the paper's two ratios on tiny-math at T=0: streak-trained over the base drafter (paper: +45%) and over
DistillSpec (paper: +35%), for streak and ce_streak against the best DistillSpec variant.
Not a test: nothing is asserted. Needs the tiny world and its trajectories (both are built when missing).

``--drafter tiny-dflash`` trains a DFlash drafter (docs/dflash.md; from its seeded initialisation, so ``base`` is
the untrained one and the standalone tiny drafter is shown beside it) with the same losses, among them the DFlash
trainers' own, ``dflash_ce`` (the DFlash paper's decayed cross-entropy; ``dflash_ce-g7`` with the fixed γ = 7 it
had before γ came from the block size) and ``dpace`` (D-PACE, ``speculators``' default), and adds the ratios of
streak-trained over drafters trained with each of those.

    python bench/distill_methods.py --seeds 0 1 2 --steps 150 --json distill_methods.json   # ~50 min, 2 cores
    python bench/distill_methods.py --steps 100 --prompts 8 --methods streak distillspec-tvd
    python bench/distill_methods.py --drafter tiny-dflash --steps 400 --lr 1e-3 \
        --methods dflash_ce dpace ce_streak streak
    python bench/distill_methods.py --drafter tiny-dflash-1l --steps 800 --lr 1e-3 --seeds 0 1 2 \
        --methods ce_streak dflash_ce

``--model smol`` measures the real model (docs/smol.md): the held-out sets are ``tiny-chat`` and ``humaneval``
through SmolLM2's chat template, ``--init mdm`` first adapts the 4-layer cut with the masked-diffusion loss (once,
at the data seed) and starts every method from it (``trainer.init_from``; the summary's "undistilled" drafter is
then that adapted cut), and ``--data-seed 0`` trains every seed on one set of trajectories (``data.seed``). The
command behind docs/smol.md's 3-seed table (runs of the same settings are found by their keys and reused):

    python bench/distill_methods.py --model smol --init mdm --data-seed 0 --seeds 0 1 2 --steps 300 --lr 3e-4 \
        --methods ce_streak distillspec-fkl distillspec-tvd --prompts 8 --new 32 --no-ar-draft \
        --set data.max_prompts=640 data.max_new_tokens=96 trainer.freeze_embeddings=true

and docs/smol.md's DFlash table (the drafter trained from scratch on the layer states the trajectories stored):

    python bench/distill_methods.py --model smol --drafter smol-dflash --data-seed 0 --seeds 0 1 2 --steps 800 \
        --lr 1e-3 --methods dflash_ce dpace ce_streak --prompts 8 --new 32 \
        --set data.max_prompts=640 data.max_new_tokens=96 'data.feature_layers=[2,10,18,26]' method.features=stored
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from omegaconf import OmegaConf

from streakline.alignment.streak import simulated_streak
from streakline.config import compose_config
from streakline.data.sources import load_source, prompt_for
from streakline.decoding.drafters import ARDrafter, DFlashDrafter, DiffusionDrafter
from streakline.decoding.speculative import SpecConfig, generate
from streakline.decoding.vanilla import greedy_generate
from streakline.models import build
from streakline.models.dflash_checkpoint import load_dflash
from streakline.pipelines import run_stage
from streakline.pipelines.common.roles import device, role_tokenizer
from streakline.world import attach_world

# label -> overrides of stage=distill
METHODS = {
    "streak": ["method=streak"],
    "ce_streak": ["method=ce_streak"],
    "expce": ["method=expce"],
    "distillspec-fkl": ["method=distillspec", "method.divergence=fkl"],
    "distillspec-tvd": ["method=distillspec", "method.divergence=tvd"],
    "distillspec-fkl-online": ["method=distillspec", "method.divergence=fkl", "method.teacher=online"],
    "distillspec-tvd-online": ["method=distillspec", "method.divergence=tvd", "method.teacher=online"],
    "ar_distill": ["method=ar_distill", "method.divergence=tvd"],
    "dflash_ce": ["method=dflash_ce"],  # γ from the block size (4.5 for the tiny drafters' windows of 8)
    "dflash_ce-g7": ["method=dflash_ce", "method.decay_gamma=7"],  # the fixed γ of docs/dflash.md's measurements
    "dpace": ["method=dpace"],
    # ce_streak, its weight from D-PACE-style smoothed confidences (method.streak_smoothing, a project variant)
    "ce_streak-s0.5": ["method=ce_streak", "method.streak_smoothing=0.5"],
    "mdm": ["method=mdm"],  # the masked-diffusion adaptation of a drafter cut from an AR model (--init mdm)
}
# Not run unless named with --methods: a rerun of an older measurement, the cut's adaptation, a variant.
OPTIONAL = ("dflash_ce-g7", "mdm", "ce_streak-s0.5")
# the streak objectives the summary's ratios are printed for
STREAK_LABELS = ("streak", "ce_streak", "ce_streak-s0.5")
# the held-out sets a model is measured on when --sets does not say: the tiny world's own, the real model's chat and
# code benchmarks
HELD_OUT = {"smol": ("tiny-chat", "humaneval")}
DEFAULT_HELD_OUT = ("tiny-math", "tiny-code")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument(
        "--lr",
        type=float,
        default=3e-4,
        help="the tiny trainer's rate for fine-tuning (conf/trainer/cpu.yaml); 1e-3 for a DFlash drafter from scratch",
    )
    ap.add_argument("--seeds", type=int, nargs="+", default=[0], help="training seeds (seed=...) of every method")
    ap.add_argument("--methods", nargs="+", default=[m for m in METHODS if m not in OPTIONAL], choices=list(METHODS))
    ap.add_argument("--prompts", type=int, default=24, help="held-out prompts per benchmark")
    ap.add_argument("--new", type=int, default=48, help="tokens per held-out continuation / decode")
    ap.add_argument("--experiment", default="distill-methods")
    ap.add_argument("--json", default=None)
    ap.add_argument("--drafter", default=None, help="a drafter preset to train instead (e.g. tiny-dflash)")
    ap.add_argument("--model", default="tiny", help="the model preset (tiny, smol, micro)")
    ap.add_argument("--init", default=None, choices=list(METHODS), help="train this first; every method starts from it")
    ap.add_argument("--data-seed", type=int, default=None, help="one set of trajectories for every seed (data.seed)")
    ap.add_argument("--sets", nargs="+", default=None, help="held-out prompt sources (default: by model)")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0], help="verifier temperatures")
    ap.add_argument("--no-ar-draft", action="store_true", help="leave out the base drafter run autoregressively")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more overrides of every stage")
    args = ap.parse_args()
    torch.manual_seed(0)
    sets = tuple(args.sets or HELD_OUT.get(args.model, DEFAULT_HELD_OUT))
    columns = [f"{name}/{c}" for name in sets for c in ("sim", *(f"T{t:g}" for t in args.temperatures))]
    base = [
        f"model={args.model}",
        *([f"data={args.model}"] if args.model == "smol" else []),  # its prompt mix (tiny's data preset is the default)
        *([f"data.seed={args.data_seed}"] if args.data_seed is not None else []),
        f"experiment.name={args.experiment}",
        "data.topk_logprobs=8",
        "trainer.micro_batch_size=8",
        f"trainer.lr={args.lr}",
        "trainer.warmup_steps=20",
        f"trainer.max_steps={args.steps}",
        f"trainer.save_every={args.steps}",
        f"trainer.eval_every={args.steps}",
        "trainer.log_every=50",
        "trainer.eval_prompts=0",  # this script measures every drafter itself (a cadence setting: keys do not move)
        "trainer.wandb_project=null",
        *([f"model.drafter={args.drafter}"] if args.drafter else []),
        *args.set,
    ]
    t0 = time.perf_counter()
    cfg = attach_world(compose_config(["stage=distill", *base]), progress=False, device=device())
    tok = role_tokenizer(cfg, "verifier")
    verifier = build(cfg.model.verifier, "verifier", device=device(), inference=True)
    gamma = cfg.model.drafter.gamma
    dflash = cfg.model.drafter.kind == "dflash"
    if dflash:
        start = build(cfg.model.drafter, "drafter", seed=0).share(verifier).eval()
        mask_id = start.dflash.mask_token_id
    else:  # the base drafter, built once: its mask id now, its row below
        base_drafter = _load(cfg.model.drafter.path, cfg, verifier)
        mask_id = base_drafter.config.mask_token_id
    held = {}
    for name in sets:  # rendered as stage=evaluate renders them (the chat template where the data preset uses it)
        texts = [prompt_for(r, tok, cfg.data.chat_template) for r in load_source(name, limit=args.prompts)]
        prompts = [tok(text, add_special_tokens=False)["input_ids"] for text in texts]
        held[name] = list(
            zip(prompts, greedy_generate(verifier, prompts, args.new, eos_token_id=tok.eos_token_id), strict=True)
        )

    def measure(drafter, kind: str) -> dict:
        row = {}
        for name, pairs in held.items():
            if kind in ("diffusion", "dflash"):
                s = simulated_streak(drafter, pairs, gamma, mask_id, verifier=verifier if kind == "dflash" else None)
                row[f"{name}/sim"] = s["mean_streak"]
                row[f"{name}/alpha"] = s["alpha"]
            for temperature in args.temperatures:
                draft_t = 0.0 if temperature == 0 else 1.0
                proposer = {"diffusion": DiffusionDrafter, "ar": ARDrafter, "dflash": DFlashDrafter}[kind](
                    drafter, temperature=draft_t
                )
                res = generate(
                    verifier,
                    [p for p, _ in pairs],
                    SpecConfig(max_new_tokens=args.new, gamma=gamma, temperature=temperature,
                               eos_token_id=tok.eos_token_id, seed=1),
                    drafter=proposer,
                )  # fmt: skip
                row[f"{name}/T{temperature:g}"] = res.metrics.accepted_per_cycle
                if temperature == 0:  # lossless: each T=0 decode must be the verifier's greedy continuation
                    same = [got == want for got, (_, want) in zip(res.tokens, pairs, strict=True)]
                    row[f"{name}/identical"] = sum(same)
        return row

    if dflash:  # the untrained DFlash drafter, and the world's standalone drafter for comparison
        standalone = attach_world(compose_config(["stage=distill", f"model={args.model}", *args.set]), progress=False)
        world_drafter = build(standalone.model.drafter, "drafter", device=device(), inference=True)
        rows: dict[str, list[dict]] = {"base": [measure(start, "dflash")]}
        rows["standalone_base"] = [measure(world_drafter, "diffusion")]
        print(f"parameters: DFlash drafter {_params(start):,}, standalone drafter {_params(world_drafter):,}")
    else:
        rows = {"base": [measure(base_drafter, "diffusion")]}
        if not args.no_ar_draft:
            rows["ar_draft"] = [measure(base_drafter, "ar")]
    start_from = []
    if args.init:  # adapted once, at the data seed (or the first seed), and every method starts from it
        init_seed = args.data_seed if args.data_seed is not None else args.seeds[0]
        run_stage(compose_config(["stage=trajectories", *base, f"seed={init_seed}"]))
        adapted = run_stage(compose_config(["stage=distill", *base, *METHODS[args.init], f"seed={init_seed}"]))
        rows[args.init] = [measure(_load(adapted.artifact, cfg, verifier), "dflash" if dflash else "diffusion")]
        start_from = [f"trainer.init_from={adapted.artifact}"]
        print(f"  {args.init} (seed {init_seed}): {adapted.artifact} ({time.perf_counter() - t0:.0f} s)", flush=True)
    for seed in args.seeds:
        run_stage(compose_config(["stage=trajectories", *base, f"seed={seed}"]))
        for label in args.methods:
            overrides = ["stage=distill", *base, *METHODS[label], *start_from, f"seed={seed}"]
            result = run_stage(compose_config(overrides))
            drafter = _load(result.artifact, cfg, verifier)
            rows.setdefault(label, []).append(measure(drafter, "dflash" if dflash else "diffusion") | {"seed": seed})
            first = columns[1]
            print(f"  {label} seed {seed}: {first} {rows[label][-1][first]:.3f} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip

    seeds = ", ".join(str(s) for s in args.seeds)
    data = f", trajectories of seed {args.data_seed}" if args.data_seed is not None else ""
    print(f"\nmodel={args.model}, {args.steps} steps each (lr {args.lr}), seeds {seeds}{data}, gamma {gamma}, "
          f"{args.prompts} held-out prompts per set")  # fmt: skip
    print(f"{'drafter':<24}" + "".join(f"{c.replace('tiny-', ''):>15}" for c in columns))
    summary = {}
    for label, runs in rows.items():
        cells = []
        for c in columns:
            values = [r[c] for r in runs if c in r]
            mean, spread = _mean_spread(values)
            summary.setdefault(label, {})[c] = {"mean": mean, "spread": spread, "n": len(values)}
            cells.append("-" if mean is None else f"{mean:.3f}" + (f"±{spread:.2f}" if len(values) > 1 else ""))
        print(f"{label:<24}" + "".join(f"{c:>15}" for c in cells))
    print(f"\nalpha_j on {sets[0]} (simulated, argmax drafts; mean over seeds)")
    for label, runs in rows.items():
        alphas = [r[f"{sets[0]}/alpha"] for r in runs if f"{sets[0]}/alpha" in r]
        if alphas:
            print(f"{label:<24}" + " ".join(f"{sum(a) / len(a):5.2f}" for a in zip(*alphas, strict=True)))
    print("\n(sim = simulated streak; T0 / T1 = the decoder's mean accepted draft tokens per cycle; a ± b = mean and "
          "sample standard deviation over seeds)")  # fmt: skip
    for name in sets:
        _ratios(summary, name, undistilled=args.init or "base")
    if 0.0 in args.temperatures:
        _lossless(rows, {name: len(pairs) for name, pairs in held.items()})
    print(f"{time.perf_counter() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": args.steps, "lr": args.lr, "seeds": args.seeds, "rows": rows, "summary": summary}, f,
                      indent=1)  # fmt: skip


def _lossless(rows: dict[str, list[dict]], sizes: dict[str, int]) -> None:
    """Say whether every T=0 decode above gave the verifier's greedy continuation token for token (``sizes``: the
    prompts of each held-out set), naming any drafter, seed and set that did not: the decoder's lossless check, run
    on the very decodes measured."""
    checked = [(label, r, name) for label, runs in rows.items() for r in runs for name in sizes]
    checked = [(label, r, name) for label, r, name in checked if f"{name}/identical" in r]
    wrong = [
        f"{label} seed {r.get('seed', '-')} {name}: {r[f'{name}/identical']} of {sizes[name]}"
        for label, r, name in checked
        if r[f"{name}/identical"] != sizes[name]
    ]
    if wrong:
        print(f"\nNOT LOSSLESS at T=0 (prompts decoded as vanilla greedy decodes them): {'; '.join(wrong)}")
    else:
        print(f"\nlossless at T=0: all {len(checked)} decodes of held-out sets equal vanilla greedy token for token")


def _params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def _mean_spread(values: list[float]) -> tuple[float | None, float]:
    if not values:
        return None, 0.0
    mean = sum(values) / len(values)
    if len(values) == 1:
        return mean, 0.0
    return mean, (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5


def _load(folder, cfg, verifier):
    """The drafter in ``folder`` (a distill run's output, or the preset's own checkpoint), ready to draft for
    ``verifier``. A standalone drafter is built through its preset with the folder as its path, as stage=evaluate
    builds it: a drafter cut from an AR checkpoint (model=smol) keeps that checkpoint's causal config.json, and the
    preset is what makes it a prefix-causal, shifted diffusion drafter with its mask token."""
    if cfg.model.drafter.kind == "dflash":
        return load_dflash(folder, device=device()).share(verifier).eval()
    node = OmegaConf.merge(cfg.model.drafter, {"path": str(folder)})
    return build(node, "drafter", device=device(), inference=True)


def _ratios(summary: dict, name: str, undistilled: str) -> None:
    """The paper's two claims on held-out set ``name`` at T=0 (mean accepted streak): streak losses over the
    undistilled drafter (``undistilled``: the base drafter, or the one every method started from; +45%, i.e. 1.45x)
    and over DistillSpec (+35%, 1.35x; here against the best DistillSpec variant). The issue's goals: 1.3x and 1.2x."""
    column = f"{name}/T0"
    value = {label: cols[column]["mean"] for label, cols in summary.items() if column in cols}
    spec = {k: v for k, v in value.items() if k.startswith("distillspec") and v is not None}
    print(f"\n{name}, T=0, mean accepted streak ratios (paper: 1.45x over the undistilled drafter, 1.35x over "
          "DistillSpec)")  # fmt: skip
    for label in STREAK_LABELS:
        if value.get(label) is None:
            continue
        line = f"  {label}: " + (f"{value[label] / value[undistilled]:.2f}x {undistilled}" if value.get(undistilled)
                                 else f"{undistilled} is 0")  # fmt: skip
        if spec:
            best = max(spec, key=spec.get)
            line += f", {value[label] / spec[best]:.2f}x {best} (the best DistillSpec variant)" if spec[best] else ""
        print(line)
    baselines = (
        ("dflash_ce", "the DFlash paper's decayed CE", "1.15x"),
        ("dflash_ce-g7", "decayed CE at γ = 7", "1.15x"),
        ("dpace", "D-PACE", "at least level"),
    )
    for baseline, what, goal in baselines:
        if value.get(baseline):
            print(f"{name}, T=0: streak losses over {what} (goal: {goal})")
            for label in STREAK_LABELS:
                if value.get(label) is not None:
                    print(f"  {label}: {value[label] / value[baseline]:.2f}x {baseline}")


if __name__ == "__main__":
    main()
