"""Benchmark: the Triton kernels of ``streakline.decoding.kernels`` against their torch references, side by side in
one run, on a CUDA GPU.

Cases (the per-cycle work of a speculative decoder at realistic sizes):
  - verify_chains, rules greedy (streak selection) and exact: N=4 rows, K=8 chains, G=16 slots, V=152064
    (Qwen2.5 vocabulary), bf16 logits;
  - compact_kv: L=28 layers, B=4, H=4 KV heads, C=2048 slots, D=128, n=17 kept slots per row, bf16. The torch
    reference includes its precondition check (a host sync); "torch gather" is the bare gather + slice write.
Prints the median time per call of each side (torch.cuda.Event, after a warm-up, repeats interleaved so that clock
and noise changes hit both alike) and the ratio torch / triton (> 1 means Triton is faster); for verify_chains also
max |scores_torch - scores_triton| and whether chosen / accepted / next_token agree (they may differ only when a
uniform lands within float rounding of a boundary; see the verify module docstring). Not a test: nothing is asserted.

    python bench/triton_kernels.py
    python bench/triton_kernels.py --repeats 50
"""

from __future__ import annotations

import argparse
import functools
import statistics

import torch

from streakline.decoding.kernels import compact_kv, verify_chains


def _time_pair(fns: list, repeats: int, warmup: int = 3) -> list[float]:
    """Median microseconds per call of each function, repeats interleaved across the functions."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times[i].append(start.elapsed_time(end) * 1e3)
    return [statistics.median(t) for t in times]


def _row(name: str, t_torch: float, t_triton: float, extra: str = "") -> None:
    print(f"{name:<52}{t_torch:>12.1f}{t_triton:>12.1f}{t_torch / t_triton:>8.2f}  {extra}")


def bench_verify(repeats: int) -> None:
    N, K, G, V, T = 4, 8, 16, 152064, 1.0
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(N, K, G + 1, V, device="cuda", generator=g) * 3).to(torch.bfloat16)
    drafts = torch.randint(0, V, (N, K, G), device="cuda", generator=g)
    # Half the slots of each chain copy the verifier's argmax so that streaks and match lengths are not all zero.
    drafts[..., : G // 2] = logits[..., : G // 2, :].argmax(-1)
    ua = torch.rand(N, G, device="cuda", generator=g)
    us = torch.rand(N, device="cuda", generator=g)
    for rule in ("greedy", "exact"):
        kw = dict(rule=rule, temperature=T, u_accept=ua, u_sample=us, selection="streak")
        outs = {b: verify_chains(logits, drafts, backend=b, **kw) for b in ("torch", "triton")}
        a, b = outs["torch"], outs["triton"]
        agree = all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("chosen", "accepted", "next_token"))
        dmax = (a.scores - b.scores).abs().max().item()
        calls = [functools.partial(verify_chains, logits, drafts, backend=b, **kw) for b in ("torch", "triton")]
        t_torch, t_triton = _time_pair(calls, repeats)
        _row(f"verify {rule} N{N} K{K} G{G} V{V}", t_torch, t_triton, f"max|dscores|={dmax:.1e} discrete agree={agree}")


def bench_compact(repeats: int) -> None:
    L, B, H, C, D, n, depth = 28, 4, 4, 2048, 128, 17, 17
    start = C - 8 * depth - 32  # 8 chains of 17 slots after `start`; rows keep chains 3, 5, 7, 1 (all slots move)
    k = torch.randn(L, B, H, C, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    chain = torch.tensor([3, 5, 7, 1], device="cuda")
    index = start + chain[:, None] * depth + torch.arange(n, device="cuda")
    ref_k, ref_v = k.clone(), v.clone()
    compact_kv(ref_k, ref_v, index, start, backend="torch")
    got_k, got_v = k.clone(), v.clone()
    compact_kv(got_k, got_v, index, start, backend="triton")
    agree = torch.equal(ref_k, got_k) and torch.equal(ref_v, got_v)
    idx = index[None, :, None, :, None].expand(L, B, H, n, D)

    def gather_only():
        for t in (k, v):
            t[:, :, :, start : start + n] = torch.gather(t, 3, idx)

    # Repeating an in-place compaction redoes the same copies (the sources are never destinations).
    calls = [functools.partial(compact_kv, k, v, index, start, backend=b) for b in ("torch", "triton")]
    t_torch, t_gather, t_triton = _time_pair([calls[0], gather_only, calls[1]], repeats)
    shape = f"L{L} B{B} H{H} C{C} D{D} n{n}"
    _row(f"compact_kv {shape}", t_torch, t_triton, f"equal={agree}")
    _row(f"compact_kv (torch gather) {shape}", t_gather, t_triton)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/triton_kernels.py needs a CUDA GPU (it times compiled Triton kernels); nothing to do here.")
        return
    import triton

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"{'case (median us per call)':<52}{'torch':>12}{'triton':>12}{'ratio':>8}")
    with torch.inference_mode():
        bench_verify(args.repeats)
        bench_compact(args.repeats)


if __name__ == "__main__":
    main()
