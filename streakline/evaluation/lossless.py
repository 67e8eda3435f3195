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
- Near-ties (temperature 0 with the verifier in bf16): a verify window of nine positions and a single vanilla step
  round differently in bf16, so where the verifier's top two logits almost tie the two decodes can pick different
  tokens, and every token after differs too. ``tie_check`` is ``exact_check`` that accepts such a divergence when
  it is a near-tie: at the first diverging position of a prompt ``gap`` (a caller's function, ``runner.tie_gap``)
  recomputes the verifier's logits of the common prefix in fp32 and in the run's precision. Each decode's bf16
  logits are within about ``eps`` = max |bf16 - fp32| of the fp32 ones, and each picked its own argmax, so the fp32
  logits of the two tokens differ by at most ``2 eps`` (``TIE_FACTOR``): a larger gap is a real difference and the
  row is lossy. fp32 rows get no allowance: their check stays token for token. Every row reports
  ``divergence_rate``, the share of prompts whose output left the reference's (docs/evaluation.md).

    check = exact_check(run.tokens, vanilla.tokens)            # {"lossless": True, "check": "identical", ...}
    check = tie_check(run.tokens, vanilla.tokens, gap)         # bf16: {"lossless": ..., "near_ties": 1, ...}
    check = sampled_check(method_logprobs, vanilla_logprobs)   # {"lossless": p >= 1e-3, "p_value": ..., ...}
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

ALPHA = 1e-3  # a lossless decoder fails the sampled check with this probability per run
# A bf16 divergence is a near-tie when the fp32 logits of the two tokens differ by at most TIE_FACTOR times the
# largest bf16 error of the logits at that position: each decode is within one error of fp32 and took its argmax.
TIE_FACTOR = 2.0
SHOWN = 8  # divergences a check lists in full (the count covers all)


def first_difference(a: list[int], b: list[int]) -> int:
    """The first position where ``a`` and ``b`` differ (the shorter's length when one is a prefix of the other)."""
    return next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def exact_check(tokens: list[list[int]], reference: list[list[int]]) -> dict:
    if len(tokens) != len(reference):
        raise ValueError(f"{len(tokens)} completions against {len(reference)} reference completions")
    differ = [i for i, (a, b) in enumerate(zip(tokens, reference, strict=True)) if a != b]
    out: dict = {
        "lossless": not differ,
        "check": "identical tokens",
        "prompts_differing": len(differ),
        "divergence_rate": len(differ) / len(tokens) if tokens else 0.0,
    }
    if differ:
        first = differ[0]
        out["first_difference"] = {"prompt": first, "token": first_difference(tokens[first], reference[first])}
    return out


def tie_check(
    tokens: list[list[int]], reference: list[list[int]], gap: Callable[[int, list[int], int, int], dict]
) -> dict:
    """``exact_check`` for a run in reduced precision: a prompt whose output leaves the reference's is accepted when
    the first diverging position is a near-tie. ``gap(prompt_index, common_prefix, token, reference_token)``
    returns ``{"gap": fp32 logit difference, "eps": largest |run - fp32| logit error}`` at that position
    (``runner.tie_gap``); a divergence is a near-tie when ``gap <= TIE_FACTOR * eps``. The check lists the first
    ``SHOWN`` divergences with their numbers, the largest gap and the bound it was held to."""
    out = exact_check(tokens, reference)
    out["check"] = f"identical tokens, up to near-ties (fp32 top-2 gap <= {TIE_FACTOR:g} x the bf16 logit error)"
    divergences = []
    for i, (a, b) in enumerate(zip(tokens, reference, strict=True)):
        if a == b:
            continue
        at = first_difference(a, b)
        if at >= min(len(a), len(b)):  # one output stops where the other goes on: no token pair to weigh
            why = "one output is a prefix of the other"
            divergences.append({"prompt": i, "token": at, "near_tie": False, "why": why})
            continue
        measured = gap(i, list(a[:at]), a[at], b[at])
        bound = TIE_FACTOR * measured["eps"]
        divergences.append(
            {"prompt": i, "token": at, "tokens": [a[at], b[at]], "gap": measured["gap"], "eps": measured["eps"],
             "bound": bound, "near_tie": abs(measured["gap"]) <= bound}
        )  # fmt: skip
    ties = [d for d in divergences if d["near_tie"]]
    out.update(
        lossless=len(ties) == len(divergences),
        near_ties=len(ties),
        max_gap=max((abs(d["gap"]) for d in divergences if "gap" in d), default=None),
        divergences=divergences[:SHOWN],
    )
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
