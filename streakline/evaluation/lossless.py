"""Losslessness checks of an evaluation run against its reference decoder.

- Exact (temperature 0, and every block-diffusion decoder at any temperature thanks to coupled noise): the
  tokens must equal the reference's, prompt by prompt. ``exact_check`` says how many prompts differ and where the
  first difference is.
- Sampling (speculative decoding at temperature > 0): outputs are random, so the check is statistical. Each prompt
  gives one completion per method; the statistic is the completion's mean log-probability per token under the
  verifier, and ``paired_signflip_p`` tests whether the per-prompt differences to the vanilla completions are
  centred on zero (a sign-flip permutation test: no distributional assumption, exact for symmetric differences).
  A lossy decoder (e.g. one that accepts the drafter's choice too often) shifts the log-probabilities and fails it;
  the decoder's own chi-square tests (tests/decoding) are the proof, this is the per-run alarm.

    check = exact_check(run.tokens, vanilla.tokens)            # {"lossless": True, "check": "identical", ...}
    check = sampled_check(method_logprobs, vanilla_logprobs)   # {"lossless": p >= 1e-3, "p_value": ..., ...}
"""

from __future__ import annotations

import math

import torch

ALPHA = 1e-3  # a lossless decoder fails the sampled check with this probability per run


def exact_check(tokens: list[list[int]], reference: list[list[int]]) -> dict:
    if len(tokens) != len(reference):
        raise ValueError(f"{len(tokens)} completions against {len(reference)} reference completions")
    differ = [i for i, (a, b) in enumerate(zip(tokens, reference, strict=True)) if a != b]
    out: dict = {"lossless": not differ, "check": "identical tokens", "prompts_differing": len(differ)}
    if differ:
        a, b = tokens[differ[0]], reference[differ[0]]
        at = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        out["first_difference"] = {"prompt": differ[0], "token": at}
    return out


def paired_signflip_p(x: list[float], y: list[float], *, rounds: int = 20000, seed: int = 0) -> float:
    """Two-sided p-value that the paired differences x - y have mean zero (random sign flips; NaN pairs dropped)."""
    d = torch.tensor([a - b for a, b in zip(x, y, strict=True) if math.isfinite(a) and math.isfinite(b)])
    d = d.double()
    if len(d) < 2 or float(d.abs().max()) == 0.0:
        return 1.0
    observed = float(d.mean().abs())
    gen = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (rounds, len(d)), generator=gen, dtype=torch.int8).double() * 2 - 1
    flipped = (signs * d).mean(dim=1).abs()
    # Count the observed assignment as one of the permutations so that p is never exactly 0.
    return (int((flipped >= observed - 1e-12).sum()) + 1) / (rounds + 1)


def sampled_check(logprobs: list[float], reference_logprobs: list[float]) -> dict:
    p = paired_signflip_p(logprobs, reference_logprobs)
    finite = [v for v in logprobs if math.isfinite(v)]
    ref = [v for v in reference_logprobs if math.isfinite(v)]
    return {
        "lossless": p >= ALPHA,
        "check": f"paired sign-flip test of mean verifier log-prob, p >= {ALPHA:g}",
        "p_value": p,
        "mean_logprob": sum(finite) / len(finite) if finite else None,
        "reference_mean_logprob": sum(ref) / len(ref) if ref else None,
    }
