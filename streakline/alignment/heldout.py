"""Held-out checks of a drafter during distillation (rank 0): the simulated streak against the verifier's greedy
continuations of held-out prompts (and its soft form under the verifier's probabilities, unless
``trainer.eval_soft_streak=false``), and the real decoder's accepted streak on a few of them.

    evaluator = HeldoutEvaluator(verifier, tokenizer, pairs_from(...), gamma, mask_id)
    metrics = evaluator(step, drafter)   # {"eval/<source>/sim_streak": ..., "eval/<source>/decoder_streak": ...}

These numbers pick checkpoints and draw the training curves; ``stage=evaluate`` measures the deployed speedup.
A DFlash drafter (``models/dflash.py``) is shared with this verifier and measured the same way: its simulated streak
from one packed forward over the verifier's states, its decoder streak through ``DFlashDrafter``.
"""

from __future__ import annotations

from typing import Any

import torch


class HeldoutEvaluator:
    """Held-out checks on rank 0: simulated streak against verifier continuations, and the real decoder's streak."""

    def __init__(
        self,
        verifier,
        tokenizer,
        sources,
        prompts_per_source: int,
        gamma: int,
        mask_id: int,
        *,
        chat_template: bool,
        soft: bool = True,
    ) -> None:
        """``sources``: prompt sources (``data.sources``) whose first ``prompts_per_source`` prompts are held out,
        rendered as ``stage=evaluate`` renders them (``chat_template``); the verifier continues each greedily for
        ``4 * gamma`` tokens once, here. ``soft``: report ``soft_streak`` too (``trainer.eval_soft_streak``)."""
        from streakline.data.benchmarks import BenchmarkError
        from streakline.data.sources import load_source, prompt_for, source_label
        from streakline.decoding.vanilla import greedy_generate

        self.verifier, self.gamma, self.mask_id, self.soft = verifier, gamma, mask_id, soft
        self.pairs: dict[str, list[tuple[list[int], list[int]]]] = {}
        eos = tokenizer.eos_token_id
        for source in sources:
            name = source_label(source)
            try:
                records = load_source(source, limit=prompts_per_source)
            except BenchmarkError as e:
                print(f"distill: no held-out evaluation on {name}: {e}")
                continue
            texts = [prompt_for(r, tokenizer, chat_template) for r in records]
            prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
            completions = greedy_generate(verifier, prompts, 4 * gamma, eos_token_id=eos)
            self.pairs[name] = list(zip(prompts, completions, strict=True))

    @torch.no_grad()
    def __call__(self, step: int, drafter) -> dict[str, Any]:
        from streakline.alignment.streak import simulated_streak
        from streakline.decoding.drafters import DFlashDrafter, DiffusionDrafter
        from streakline.decoding.speculative import SpecConfig, generate
        from streakline.models.dflash import DFlashModel

        if not self.pairs:
            return {}
        kind = DiffusionDrafter
        if isinstance(drafter, DFlashModel):  # an export (ZeRO-3) is not shared yet; the live one is
            drafter.share(self.verifier)
            kind = DFlashDrafter
        was_training = drafter.training
        drafter.eval()
        out: dict[str, Any] = {}
        for name, pairs in self.pairs.items():
            s = simulated_streak(drafter, pairs, self.gamma, self.mask_id, verifier=self.verifier, soft=self.soft)
            out[f"eval/{name}/sim_streak"] = s["mean_streak"]
            if self.soft:
                out[f"eval/{name}/soft_streak"] = s["mean_soft_streak"]
            out[f"eval/{name}/alpha"] = s["alpha"]
            prompts = [p for p, _ in pairs[:4]]
            res = generate(
                self.verifier,
                prompts,
                SpecConfig(max_new_tokens=2 * self.gamma, gamma=self.gamma),
                drafter=kind(drafter, temperature=0.0),
            )
            out[f"eval/{name}/decoder_streak"] = res.metrics.accepted_per_cycle
        drafter.train(was_training)
        return out
