"""Run one evaluation method over a prompt set and return its tokens and metrics (no model loading here).

The evaluate stage (``pipelines/evaluate.py``) builds the models and drafters, then calls:

    run = run_speculative(verifier, prompts, decoder_cfg, drafter, eos_token_id=eos, batch_size=1)
    run = run_block(target, prompts, BlockDecodeConfig(rule="static", max_new_tokens=64), drafter=None)
    run.tokens, run.metrics["tokens_per_s"], run.metrics["nfe_per_token"]

Every method sees the same prompts, batches and stop rule; the decoder is the same code as ``stage=decode``.
Metrics of several batches are summed before the ratios are taken, so a method's numbers do not depend on how the
prompts were batched. Tests: ``python -m pytest tests/evaluation``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from streakline.decoding.block_diffusion import BlockDecodeConfig, BlockDrafter, decode_blocks
from streakline.decoding.metrics import PHASES, DecodeMetrics
from streakline.decoding.speculative import SpecConfig, generate
from streakline.decoding.vanilla import left_pad


@dataclass
class MethodRun:
    tokens: list[list[int]]  # per prompt
    metrics: dict[str, Any] = field(default_factory=dict)
    # the counts the metrics were computed from, one per decode call (DecodeMetrics, or BlockCounts for a block
    # decoder): merge_runs sums them, so a method decoded in several calls (evaluate's interleaved timing) reports
    # what one call over all its prompts would
    parts: list = field(default_factory=list, repr=False)


@dataclass
class BlockCounts:
    """What one ``decode_blocks`` call over a batch counted and took."""

    nfe: int  # target forwards per row, summed: comparable across batch sizes
    drafts: int  # draft states verified, summed over the call's forwards
    forwards: int
    drafting_s: float
    wall_s: float


def batches(items: list, size: int) -> list[list]:
    """``items`` in consecutive batches of ``size`` (at least 1): the decode calls of one method over a prompt set."""
    size = max(1, size)
    return [items[i : i + size] for i in range(0, len(items), size)]


def merge_metrics(parts: list[DecodeMetrics]) -> DecodeMetrics:
    """One DecodeMetrics for several decode calls of the same method (counts summed, ratios recomputed)."""
    first = parts[0]
    total = DecodeMetrics(gamma=first.gamma, K=first.K, batch_size=max(p.batch_size for p in parts))
    for p in parts:
        for name in ("new_tokens", "nfe", "drafter_forwards", "cycles", "accepted"):
            setattr(total, name, getattr(total, name) + getattr(p, name))
        total.reached_at = [a + b for a, b in zip(total.reached_at, p.reached_at, strict=True)]
        total.accepted_at = [a + b for a, b in zip(total.accepted_at, p.accepted_at, strict=True)]
        total.chosen = [a + b for a, b in zip(total.chosen, p.chosen, strict=True)]
        for phase in PHASES:
            total.time_s[phase] += p.time_s[phase]
        total.wall_s += p.wall_s
    return total


def merge_runs(runs: list[MethodRun]) -> MethodRun:
    """One run of a method from its runs over consecutive batches of a prompt set, in order: the tokens joined, the
    counts summed and the ratios taken of the sums, exactly as if one call had decoded every batch."""
    tokens = [t for run in runs for t in run.tokens]
    parts = [p for run in runs for p in run.parts]
    return _speculative_run(tokens, parts) if isinstance(parts[0], DecodeMetrics) else _block_run(tokens, parts)


def run_speculative(
    verifier,
    prompts: list[list[int]],
    spec: SpecConfig,
    drafter=None,
    *,
    batch_size: int = 1,
    tokenizer=None,
) -> MethodRun:
    """Decode ``prompts`` with the speculative decoder (``drafter`` None = vanilla); summed metrics."""
    tokens: list[list[int]] = []
    parts: list[DecodeMetrics] = []
    for chunk in batches(prompts, batch_size):
        res = generate(verifier, chunk, spec, drafter=drafter, tokenizer=tokenizer)
        tokens.extend(res.tokens)
        parts.append(res.metrics)
    return _speculative_run(tokens, parts)


def _speculative_run(tokens: list[list[int]], parts: list[DecodeMetrics]) -> MethodRun:
    m = merge_metrics(parts)
    out = m.to_dict()
    out["nfe_per_token"] = m.nfe / m.new_tokens if m.new_tokens else 0.0
    return MethodRun(tokens, out, parts)


def run_block(
    target,
    prompts: list[list[int]],
    cfg: BlockDecodeConfig,
    drafter: BlockDrafter | None = None,
    *,
    batch_size: int = 1,
) -> MethodRun:
    """Decode ``prompts`` with a block-diffusion decoder (``drafter``: SPOT / Spiffy, None = draft-free)."""
    device = next(target.parameters()).device
    tokens: list[list[int]] = []
    parts: list[BlockCounts] = []
    for chunk in batches(prompts, batch_size):
        t0 = time.perf_counter()
        ids, mask = left_pad(chunk)
        res = decode_blocks(target, ids.to(device), mask.to(device), cfg, drafter=drafter)
        if device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        tokens.extend(res.tokens)
        drafts = sum(res.drafts_per_forward)
        parts.append(BlockCounts(sum(res.nfe_per_row), drafts, res.nfe, res.seconds_drafting, wall))
    return _block_run(tokens, parts)


def _block_run(tokens: list[list[int]], parts: list[BlockCounts]) -> MethodRun:
    new = sum(len(t) for t in tokens)
    nfe, drafts = sum(p.nfe for p in parts), sum(p.drafts for p in parts)
    forwards, wall = sum(p.forwards for p in parts), sum(p.wall_s for p in parts)
    return MethodRun(
        tokens,
        {
            "new_tokens": new,
            "nfe": nfe,  # target forwards per row, summed: comparable across batch sizes
            "nfe_per_token": nfe / new if new else 0.0,
            "tokens_per_verifier_call": new / nfe if nfe else 0.0,
            "drafts_per_forward": drafts / forwards if forwards else 0.0,
            "wall_s": wall,
            "tokens_per_s": new / wall if wall > 0 else 0.0,
            "drafting_s": sum(p.drafting_s for p in parts),
            "accepted_per_cycle": None,  # no drafter streak: a block decoder commits positions, not a chain
            "alpha": [],
        },
        parts,
    )


@torch.no_grad()
def sequence_logprobs(model, prompts: list[list[int]], completions: list[list[int]]) -> list[float]:
    """Mean log-probability per completion token under a causal ``model`` at temperature 1 (one forward each).
    Empty completions give NaN. The sampling-time losslessness statistic compares these between methods."""
    device = next(model.parameters()).device
    out = []
    for prompt, completion in zip(prompts, completions, strict=True):
        if not completion:
            out.append(float("nan"))
            continue
        ids = torch.tensor([prompt + completion], device=device)
        logits = model(ids)[0, len(prompt) - 1 : -1].float()
        lp = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, len(prompt) :, None]).squeeze(-1)
        out.append(float(lp.mean()))
    return out


@torch.no_grad()
def tie_gap(model, reference, prompt: list[int], prefix: list[int], token: int, other: int) -> dict[str, float]:
    """How near a tie the choice between ``token`` and ``other`` after ``prompt + prefix`` is (``lossless.
    tie_check``): ``gap``, the fp32 ``reference``'s logit of ``token`` minus that of ``other``, and ``eps``, the
    largest difference over the vocabulary between ``model``'s logits (the run's precision) and the reference's
    there. ``reference`` is the same verifier in fp32."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt + prefix], device=device)
    run = model(ids, logits_to_keep=1)[0, -1].float()
    exact = reference(ids.to(next(reference.parameters()).device), logits_to_keep=1)[0, -1].float().to(run.device)
    return {"gap": float(exact[token] - exact[other]), "eps": float((run - exact).abs().max())}
