"""Benchmark: our speculative decoder against `transformers` generate / assisted generation, side by side in one run.

Measures end-to-end decode throughput on the tiny world (verifier + diffusion drafter built by
``stage=bootstrap``, found in the cache when already built) over ``tiny-math`` and ``tiny-code`` prompts, batch 1,
each prompt decoded on its own with eos stopping, at every temperature given. Rows:

  ours vanilla        generate(drafter=None): the verifier alone, the baseline every ratio divides by
  hf generate         transformers greedy (T=0) or pure sampling (T>0: top_k=0, top_p=1) on the same verifier folder
  hf assisted         transformers assisted generation with the drafter loaded as a causal LM, 8 draft tokens a cycle
                      (constant schedule, confidence stop off); at T>0 it does speculative sampling itself
  ours ar_draft       ARDrafter, gamma 8; greedy_acceptance at T=0, leviathan at T>0 (drafts sampled from the
                      drafter's own distribution, temperature 1, no top-k)
  ours diffusion K=1  DiffusionDrafter (temperature 1.5, top-k 64), gamma 8, greedy_acceptance
  ours diffusion K=8  the same with 8 chains

Per (benchmark, temperature) it prints tokens/s, the ratio to ours vanilla, tokens per verifier call, mean accepted
draft tokens per cycle, the per-slot acceptance alpha_1..alpha_8 (ours only) and, at T=0, whether the tokens equal
ours vanilla's (every method must be lossless; the first differing prompt and position are printed otherwise).
For the hf rows verifier calls are counted with a forward hook on the verifier, and accepted per cycle is
``tokens / calls - 1`` (each call emits the accepted drafts plus one token; a cycle cut by eos or the token budget
counts short). Ours report ``DecodeMetrics.accepted_per_cycle``, which counts a cut cycle's drafts in full, so it can
sit a little above ``tok/call - 1``; tok/call (new tokens / verifier cycles, prefill excluded) compares all rows.
A final summary gives the two goal ratios ours vanilla / hf generate and ours ar_draft / hf assisted (goal >= 1).

Timing: every method is warmed up once, then the loop is prompt-major (all methods on prompt 0, then prompt 1, ...)
so machine noise hits all methods alike; the whole sweep repeats ``--repeats`` times and tokens/s uses the median
total time. Seeds are fixed per prompt, so every repeat decodes the same tokens. Not a test: nothing is asserted.

    python bench/decode.py --threads 1                  # CPU; about 5 minutes
    python bench/decode.py --prompts 4 --new 32 --temperatures 0 --json out.json
    python bench/decode.py --device cuda --dtype bfloat16

``--threads`` defaults to every core; on a shared 2-core machine ``--threads 1`` gives steadier numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import transformers
from _timing import timed

from streakline.config import compose_config
from streakline.data import load_benchmark
from streakline.data.benchmarks import prompt_text
from streakline.decoding.drafters import ARDrafter, DiffusionDrafter
from streakline.decoding.speculative import SpecConfig, generate
from streakline.models import build
from streakline.models.tokenizer import load_tokenizer
from streakline.pipelines.common.roles import device as default_device
from streakline.world import attach_world

BENCHMARKS = ("tiny-math", "tiny-code")
GAMMA = 8
VANILLA, HF_GEN, HF_ASSIST, AR = "ours vanilla", "hf generate", "hf assisted", "ours ar_draft"


@dataclass
class Stats:
    """One method's counts summed over prompts (one repeat: the counts do not change between repeats)."""

    tokens: int = 0
    calls: int = 0  # verifier cycles (ours: prefill excluded; hf: forwards, its prefill is the first cycle)
    accepted: int | None = 0  # None: not known exactly (hf rows derive it from tokens and calls)
    reached_at: list[int] = field(default_factory=lambda: [0] * GAMMA)
    accepted_at: list[int] = field(default_factory=lambda: [0] * GAMMA)
    ours: bool = True

    def add(self, tokens: int, calls: int, metrics=None) -> None:
        self.tokens += tokens
        self.calls += calls
        if metrics is None:
            self.ours = False
            return
        self.accepted += metrics.accepted
        for j in range(min(GAMMA, metrics.gamma)):
            self.reached_at[j] += metrics.reached_at[j]
            self.accepted_at[j] += metrics.accepted_at[j]

    @property
    def tokens_per_call(self) -> float:
        return self.tokens / self.calls if self.calls else 0.0

    @property
    def accepted_per_cycle(self) -> float:
        if not self.calls:
            return 0.0
        return self.accepted / self.calls if self.ours else self.tokens / self.calls - 1

    @property
    def alpha(self) -> list[float | None]:
        return [a / r if r else None for a, r in zip(self.accepted_at, self.reached_at, strict=True)]


@dataclass
class Method:
    name: str
    run: Callable[[list[int], int], tuple[list[int], int, object]]  # (prompt, seed) -> (tokens, calls, metrics)
    draft: bool = True  # False: no drafter, alphas mean nothing


def _prompts(tok, name: str, n: int) -> list[list[int]]:
    # The world's raw-document prompt form, as its sanity report and the trajectories stage encode it.
    return [tok(prompt_text(r), add_special_tokens=False)["input_ids"] for r in load_benchmark(name, limit=n)]


class ForwardCounter:
    """Counts forwards of a Hugging Face model (a pre-hook on its top module: one call = one verifier pass)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.n = 0
        model.register_forward_pre_hook(self._hook)

    def _hook(self, module, args) -> None:
        self.n += 1


def make_methods(args, temperature: float, verifier, drafter, hf, hf_draft, counter, eos: int, pad: int):
    device = args.device
    sampling = temperature > 0

    def ours(drafter_obj, K: int, acceptance: str):
        def run(prompt: list[int], seed: int):
            cfg = SpecConfig(
                max_new_tokens=args.new,
                gamma=GAMMA,
                K=K,
                temperature=temperature,
                acceptance=acceptance,
                eos_token_id=eos,
                seed=seed,
            )
            res = generate(verifier, [prompt], cfg, drafter=drafter_obj)
            return res.tokens[0], res.metrics.cycles, res.metrics

        return run

    def hf_run(assistant):
        # Sampling knobs spelled out: transformers' defaults (top_k=50) would otherwise change the distribution.
        knobs = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if sampling else {"do_sample": False}

        def run(prompt: list[int], seed: int):
            ids = torch.tensor([prompt], device=device)
            torch.manual_seed(seed)  # hf samples from the global generator; ours from a seeded one
            before = counter.n
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=args.new,
                pad_token_id=pad,
                eos_token_id=eos,
                assistant_model=assistant,
                **knobs,
            )
            return out[0, len(prompt) :].tolist(), counter.n - before, None

        return run

    # At T > 0 leviathan needs q to be the drafter's real sampling distribution; at T = 0 the argmax draft is best.
    ar = ARDrafter(drafter, temperature=1.0, top_k=None) if sampling else ARDrafter(drafter)
    diffusion = DiffusionDrafter(drafter, temperature=1.5, top_k=64)
    return [
        Method(VANILLA, ours(None, 1, "greedy_acceptance"), draft=False),
        Method(HF_GEN, hf_run(None), draft=False),
        Method(HF_ASSIST, hf_run(hf_draft)),
        Method(AR, ours(ar, 1, "leviathan" if sampling else "greedy_acceptance")),
        Method("ours diffusion K=1", ours(diffusion, 1, "greedy_acceptance")),
        Method("ours diffusion K=8", ours(diffusion, 8, "greedy_acceptance")),
    ]


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def bench_one(args, methods: list[Method], prompts: list[list[int]], temperature: float) -> dict:
    seeds = [args.seed + i for i in range(len(prompts))]
    for m in methods:  # warm-up: first-call allocations, lazy imports, kernel selection
        m.run(prompts[0], seeds[0])
    times = {m.name: [] for m in methods}
    stats = {m.name: Stats() for m in methods}
    tokens: dict[str, list[list[int]]] = {m.name: [] for m in methods}
    for r in range(args.repeats):
        total = dict.fromkeys(times, 0.0)
        for i, prompt in enumerate(prompts):
            # Rotate the order per prompt so no method always runs right after the same neighbour.
            k = i % len(methods)
            for m in methods[k:] + methods[:k]:
                (out, calls, metrics), seconds = timed(lambda m=m, i=i, p=prompt: m.run(p, seeds[i]), args.device)
                total[m.name] += seconds
                if r == 0:
                    stats[m.name].add(len(out), calls, metrics)
                    tokens[m.name].append(out)
        for name, t in total.items():
            times[name].append(t)

    rows = {}
    base = tokens[VANILLA]
    for m in methods:
        s = stats[m.name]
        median = statistics.median(times[m.name])
        diff = None
        if temperature == 0:
            for i, (got, want) in enumerate(zip(tokens[m.name], base, strict=True)):
                pos = first_difference(got, want)
                if pos is not None:
                    diff = {"prompt": i, "position": pos, "got": got[pos : pos + 4], "want": want[pos : pos + 4]}
                    break
        rows[m.name] = {
            "tokens": s.tokens,
            "time_s": times[m.name],
            "median_s": median,
            "tokens_per_s": s.tokens / median if median > 0 else 0.0,
            "verifier_calls": s.calls,
            "tokens_per_verifier_call": s.tokens_per_call,
            "accepted_per_cycle": s.accepted_per_cycle if m.draft else 0.0,
            "alpha": s.alpha if (s.ours and m.draft) else None,
            "identical": None if temperature else diff is None,
            "first_difference": diff,
        }
    vanilla = rows[VANILLA]["tokens_per_s"]
    for row in rows.values():
        row["vs_vanilla"] = row["tokens_per_s"] / vanilla if vanilla else 0.0
    return rows


def print_table(bench: str, temperature: float, rows: dict) -> None:
    alphas = "".join(f"{'α' + str(j + 1):>6}" for j in range(GAMMA))
    print(f"\n{bench}, T={temperature:g}")
    head = f"{'method':<20}{'tokens':>7}{'tok/s':>9}{'vs van':>8}{'tok/call':>9}{'acc/cyc':>8}{'identical':>10}"
    print(head + alphas)
    for name, r in rows.items():
        ident = "-" if r["identical"] is None else ("yes" if r["identical"] else "no")
        alpha = "".join(f"{'-' if a is None else f'{a:.2f}':>6}" for a in (r["alpha"] or [None] * GAMMA))
        print(
            f"{name:<20}{r['tokens']:>7}{r['tokens_per_s']:>9.1f}{r['vs_vanilla']:>8.2f}"
            f"{r['tokens_per_verifier_call']:>9.2f}{r['accepted_per_cycle']:>8.2f}{ident:>10}{alpha}"
        )
    for name, r in rows.items():
        if r["first_difference"]:
            d = r["first_difference"]
            print(
                f"  NOT LOSSLESS: {name} differs from {VANILLA} on prompt {d['prompt']} at position {d['position']}: "
                f"{d['got']} vs {d['want']}"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    # 5 x 64 tokens keeps a full default run (2 benchmarks x 2 temperatures x 6 methods x 3 repeats) near 5 minutes
    # on one CPU thread; 8 prompts took 8.3 minutes.
    ap.add_argument("--prompts", type=int, default=5, help="prompts per benchmark")
    ap.add_argument("--new", type=int, default=64, help="max new tokens (eos stops earlier)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--benchmarks", nargs="+", default=list(BENCHMARKS), choices=BENCHMARKS)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write every number here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()  # generation-flag chatter and load bars would bury the tables
    transformers.logging.disable_progress_bar()
    dtype = getattr(torch, args.dtype)
    wall = time.perf_counter()

    cfg = compose_config(["stage=decode", "model=tiny", "prompt=x"])
    attach_world(cfg, progress=False, device=default_device())
    tok = load_tokenizer(cfg.model.verifier.tokenizer)
    eos, pad = tok.eos_token_id, tok.pad_token_id
    verifier = build(cfg.model.verifier, "verifier", device=args.device, dtype=dtype).eval()
    drafter = build(cfg.model.drafter, "drafter", device=args.device, dtype=dtype).eval()

    def hf_load(path: str):
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
        return model.to(args.device).eval()

    hf, hf_draft = hf_load(cfg.model.verifier.path), hf_load(cfg.model.drafter.path)
    # Draft exactly gamma tokens every cycle like ours: constant schedule, and no early stop on low draft
    # confidence (transformers' default threshold 0.4 would cut drafts short).
    hf_draft.generation_config.num_assistant_tokens = GAMMA
    hf_draft.generation_config.num_assistant_tokens_schedule = "constant"
    hf_draft.generation_config.assistant_confidence_threshold = 0.0
    counter = ForwardCounter(hf)
    print(
        f"tiny world: verifier {sum(p.numel() for p in verifier.parameters()) / 1e6:.2f}M, drafter "
        f"{sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M params; {args.dtype} on {args.device}, "
        f"{args.threads} threads; torch {torch.__version__}, transformers {transformers.__version__}"
    )
    print(
        f"{args.prompts} prompts per benchmark, batch 1, max {args.new} new tokens, gamma {GAMMA}, "
        f"median of {args.repeats} repeats"
    )

    results: dict = {"args": vars(args), "tables": []}
    with torch.inference_mode():
        for temperature in args.temperatures:
            methods = make_methods(args, temperature, verifier, drafter, hf, hf_draft, counter, eos, pad)
            for bench in args.benchmarks:
                prompts = _prompts(tok, bench, args.prompts)
                rows = bench_one(args, methods, prompts, temperature)
                print_table(bench, temperature, rows)
                results["tables"].append({"benchmark": bench, "temperature": temperature, "rows": rows})

    print("\nsummary (goal >= 1)")
    print(f"{'benchmark':<12}{'T':>4}{'ours vanilla / hf generate':>30}{'ours ar_draft / hf assisted':>30}")
    for t in results["tables"]:
        rows = t["rows"]
        a = rows[VANILLA]["tokens_per_s"] / rows[HF_GEN]["tokens_per_s"]
        b = rows[AR]["tokens_per_s"] / rows[HF_ASSIST]["tokens_per_s"]
        t["goal_ratios"] = {"vanilla_vs_hf_generate": a, "ar_draft_vs_hf_assisted": b}
        print(f"{t['benchmark']:<12}{t['temperature']:>4g}{a:>30.2f}{b:>30.2f}")
    results["wall_s"] = time.perf_counter() - wall
    print(f"\ntotal {results['wall_s']:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
