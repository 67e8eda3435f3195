"""Benchmark: the vanilla decode step of SmolLM2-135M-Instruct on a CPU, against its limits and a peer.

The baseline every speedup divides by should be fast, so this prints, side by side in one run (methods taking
turns, prompt by prompt, after a warm-up), greedy decoding at batch 1 in bf16:

  torch       streakline's decoder on torch's own ops (oneDNN's ``linear``, SDPA, RMSNorm and rotary as torch ops),
              the projections unfused: the path before the CPU kernels (``cpu_native.use_reference()``)
  kernel      streakline's decoder as ``build(inference=True)`` makes it on this CPU: the bf16 kernels (linear,
              attention, RMSNorm, rotary; AVX512-BF16 or AVX2), q/k/v and gate/up fused (where none runs, torch)
  hf          ``transformers``' ``generate`` on the same weights (``do_sample=False``, every token forced)
  torch_fp32, hf_fp32
              the same two in fp32: the baseline where bf16 is not native (``precision=auto`` ran fp32 there before
              the AVX2 kernels; ``--no-fp32`` leaves them out)
  limit       reading every bf16 weight once a token at this machine's read bandwidth (a ``sum`` over 512 MB)

at 1 and 2 threads (``--threads``). Also, per shape of SmolLM2's matrices, the GB/s that torch's ``linear`` and the
kernel reach at 1 and 9 rows (a vanilla step, a verify window). Not a test: nothing is asserted; run it alone.

    python bench/vanilla.py                        # 4 HumanEval prompts x 64 tokens, 1 and 2 threads: ~5 min
    python bench/vanilla.py --threads 2 --prompts 2 --new 32 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from streakline.config import compose_config
from streakline.data.sources import load_source, prompt_for
from streakline.decoding.speculative import SpecConfig, generate
from streakline.models import build, cpu_linear
from streakline.models.precision import detect
from streakline.models.tokenizer import load_tokenizer
from streakline.world.imports import attach_imports

SHAPES = ((576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576))  # q/o, k/v, gate/up, down, head


def _best(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def _shapes(reps: int = 5) -> list[dict]:
    """GB/s of torch's linear and the kernel per shape at 1 and 9 rows, over ~256 MB of distinct weights (so the
    weights come from memory, as in a decode step, not from cache)."""
    rows = []
    for n, k in SHAPES:
        count = max(1, int(256e6 / (n * k * 2)))
        ws = [torch.randn(n, k, dtype=torch.bfloat16) for _ in range(count)]
        size = count * n * k * 2
        for m in (1, 9):
            x = torch.randn(m, k, dtype=torch.bfloat16)
            t_torch = _best(lambda x=x, ws=ws: [F.linear(x, w) for w in ws], reps)
            t_kernel = _best(lambda x=x, ws=ws: [cpu_linear.linear(x, w) for w in ws], reps)
            rows.append({"shape": f"{n}x{k}", "rows": m, "torch_gbs": size / t_torch / 1e9,
                         "kernel_gbs": size / t_kernel / 1e9})  # fmt: skip
        del ws
    return rows


def _bandwidth() -> float:
    big = torch.ones(128 * 1024 * 1024, dtype=torch.float32)  # 512 MB
    return big.numel() * 4 / _best(big.sum, 5) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-root", default="runs")
    ap.add_argument("--prompts", type=int, default=4, help="HumanEval prompts")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--no-hf", action="store_true", help="leave transformers' generate out")
    ap.add_argument("--no-fp32", action="store_true", help="leave the fp32 rows out")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    hw = detect("cpu")
    print(f"CPU: {hw.evidence}; the kernel {'runs' if cpu_linear.available() else 'does NOT run'} here")
    cfg = attach_imports(compose_config(["model=smol", f"run_root={args.run_root}"]))
    kernel = build(cfg.model.verifier, "verifier", inference=True, dtype=torch.bfloat16)
    os.environ[cpu_linear.ENV] = "torch"  # the path before the kernel: unfused, torch's linear
    plain = build(cfg.model.verifier, "verifier", inference=True, dtype=torch.bfloat16)
    del os.environ[cpu_linear.ENV]
    fp32 = None if args.no_fp32 else build(cfg.model.verifier, "verifier", inference=True, dtype=torch.float32)
    weights = sum(p.numel() * p.element_size() for p in plain.parameters())
    hf = hf32 = None
    if not args.no_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(cfg.model.verifier.path, dtype=torch.bfloat16).eval()
        if not args.no_fp32:
            hf32 = AutoModelForCausalLM.from_pretrained(cfg.model.verifier.path, dtype=torch.float32).eval()
    tok = load_tokenizer(cfg.model.verifier.tokenizer)
    records = load_source("humaneval", limit=args.prompts)
    prompts = [tok(prompt_for(r, tok, True), add_special_tokens=False)["input_ids"] for r in records]
    spec = SpecConfig(max_new_tokens=args.new, eos_token_id=None)

    def ours(model, prompt, reference: bool) -> float:
        ctx = cpu_linear.use_reference() if reference else torch.no_grad()
        with ctx, torch.no_grad():
            res = generate(model, [prompt], spec)
        return res.metrics.new_tokens / res.metrics.wall_s

    def theirs(model, prompt) -> float:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            t = time.perf_counter()
            model.generate(ids, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False)
            return args.new / (time.perf_counter() - t)

    summary: dict = {"cpu": hw.evidence, "kernel": cpu_linear.available(), "weights_mb": weights / 1e6}
    bw = _bandwidth()
    summary["read_gbs"] = bw
    limit = bw * 1e9 / weights
    print(f"weights {weights / 1e6:.0f} MB; read bandwidth {bw:.1f} GB/s: at most {limit:.0f} tok/s")
    for threads in args.threads:
        torch.set_num_threads(threads)
        methods = {"torch": lambda p: ours(plain, p, True), "kernel": lambda p: ours(kernel, p, False)}
        if hf is not None:
            methods["hf"] = lambda p: theirs(hf, p)
        if fp32 is not None:
            methods["torch_fp32"] = lambda p: ours(fp32, p, True)
        if hf32 is not None:
            methods["hf_fp32"] = lambda p: theirs(hf32, p)
        for fn in methods.values():  # warm-up
            fn(prompts[0][:32])
        rates: dict[str, list[float]] = {m: [] for m in methods}
        for prompt in prompts:
            for m, fn in methods.items():
                rates[m].append(fn(prompt))
        med = {m: statistics.median(r) for m, r in rates.items()}
        cells = "  ".join(f"{m} {v:.1f}" for m, v in med.items())
        vs = f"kernel/torch {med['kernel'] / med['torch']:.2f}x"
        for peer in ("hf", "torch_fp32", "hf_fp32"):
            if peer in med:
                vs += f", kernel/{peer} {med['kernel'] / med[peer]:.2f}x"
        print(f"threads {threads}: tok/s {cells}; {vs}; kernel at {med['kernel'] / limit:.2f} of the limit")
        summary[f"threads_{threads}"] = {"tok_s": med, "limit_tok_s": limit}
        summary[f"shapes_{threads}"] = shapes = _shapes()
        for r in shapes:
            print(f"   {r['shape']:>10} x{r['rows']}: torch {r['torch_gbs']:5.1f} GB/s, kernel {r['kernel_gbs']:5.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
