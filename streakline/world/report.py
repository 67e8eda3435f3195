"""The sanity report of a freshly built world (``world/build.py`` writes it into ``report.json``).

verifier  held-out loss and next-token accuracy per domain
drafter   simulated accepted streak at γ against the verifier's greedy continuations of tiny-math and tiny-code
          prompts (``Σ_m Π_{j≤m} [argmax q_j = x_j]``, mean over windows) and per-position acceptance α_j
target    held-out block-diffusion loss per domain and target forwards per generated token under the static and
          threshold decoders
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from streakline.alignment.streak import simulated_streak
from streakline.data import load_benchmark
from streakline.data.benchmarks import prompt_text
from streakline.decoding.block_diffusion import BlockDecodeConfig, decode_blocks
from streakline.decoding.vanilla import greedy_generate, left_pad

BENCHMARKS = ("tiny-math", "tiny-code")


def _prompts(tokenizer, name: str, n: int) -> list[list[int]]:
    # The verifier was trained on raw documents: a math prompt is its question line, code the def + docstring.
    records = load_benchmark(name, limit=n)
    return [tokenizer(prompt_text(r), add_special_tokens=False)["input_ids"] for r in records]


@torch.no_grad()
def sanity_report(models: dict, tokenizer, world, evals: dict[str, list[dict]]) -> dict[str, Any]:
    verifier, drafter, target = models["verifier"], models["drafter"], models["target"]
    eos = tokenizer.eos_token_id
    mask_id = drafter.config.mask_token_id
    report: dict[str, Any] = {
        role: {"heldout": evals[role][-1]["eval"], "start": evals[role][0]["eval"]} for role in models
    }
    report["drafter"]["streak"] = {}
    report["target"]["forwards_per_token"] = {}
    for name in BENCHMARKS:
        prompts = _prompts(tokenizer, name, world.report_prompts)
        completions = greedy_generate(verifier, prompts, world.report_new_tokens, eos_token_id=eos)
        report["drafter"]["streak"][name] = simulated_streak(
            drafter, list(zip(prompts, completions, strict=True)), world.report_gamma, mask_id
        )
        ids, mask = left_pad(prompts, tokenizer.pad_token_id or 0)
        ids, mask = ids.to(target.embed.weight.device), mask.to(target.embed.weight.device)
        for rule in ("static", "threshold"):
            result = decode_blocks(
                target,
                ids,
                mask,
                BlockDecodeConfig(rule=rule, max_new_tokens=world.report_new_tokens, eos_token_id=eos),
            )
            generated = sum(len(t) for t in result.tokens)
            report["target"]["forwards_per_token"].setdefault(name, {})[rule] = {
                "nfe": result.nfe,
                "tokens": generated,
                "forwards_per_token": sum(result.nfe_per_row) / max(1, generated),
            }
    report["gamma"] = world.report_gamma
    return report


def format_report(report: dict[str, Any], folder: Path) -> str:
    lines = [f"tiny world: {folder}", "verifier (held-out)"]
    for key, value in report["verifier"]["heldout"].items():
        start = report["verifier"]["start"][key]
        lines.append(f"  {key:<20} {value:8.3f}   (at step 0: {start:.3f})")
    lines.append(f"drafter: simulated streak at γ={report['gamma']} against the verifier's greedy continuations")
    for name, s in report["drafter"]["streak"].items():
        alpha = " ".join(f"{a:.2f}" for a in s["alpha"])
        lines.append(f"  {name:<10} mean streak {s['mean_streak']:.2f} over {s['windows']} windows; α_j: {alpha}")
    for key, value in report["drafter"]["heldout"].items():
        lines.append(f"  {key:<20} {value:8.3f}   (held-out mdm; accuracy with every slot masked)")
    lines.append("target (block diffusion)")
    for key, value in report["target"]["heldout"].items():
        lines.append(f"  {key:<20} {value:8.3f}")
    for name, rules in report["target"]["forwards_per_token"].items():
        parts = ", ".join(f"{rule} {r['forwards_per_token']:.2f}" for rule, r in rules.items())
        lines.append(f"  {name:<10} forwards per generated token: {parts}")
    if "seconds" in report:
        where = f" on {report['device']}" if "device" in report else ""  # worlds built before it was recorded
        lines.append(f"build time{where}: " + ", ".join(f"{k} {v:.0f}s" for k, v in report["seconds"].items()))
    return "\n".join(lines)
