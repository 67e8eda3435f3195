"""Prompt lookup first, the DFlash drafter where it finds nothing (``decoder=dflash_lookup``).

On a small verifier neither drafter wins everywhere: prompt lookup (``ngram.py``) drafts for free and is right most
of the time on code that repeats its context, but finds a match in only part of the cycles (27% on chat in the
SmolLM2 study); a trained DFlash drafter drafts every cycle but costs a forward and half a verifier step. This
drafter asks lookup first, row by row, and runs the DFlash draft only when some row found no match, so a cycle
costs what the cheaper drafter that has something to say costs.

Every cycle the DFlash drafter still absorbs the verifier's states of the newly cached tokens (its context must
hold every committed token whichever drafter proposed them); that is its projection and each layer's keys and
values, not a draft. A row's draft is lookup's (padded to the cycle's width by repeating its last token, q one-hot)
when lookup matched, else the DFlash chain and its q. Which drafter a row uses is a function of its context alone,
so every acceptance rule stays exact: losslessness only asks that the verified tokens be drawn from the q handed to
the rule, which holds row by row (tests/decoding/test_lookup_first.py checks greedy equality and a chi-square test).

    drafter = LookupFirstDrafter(DFlashDrafter(model, temperature=0.0), NgramDrafter(vocab_size=V))
    generate(verifier, prompts, SpecConfig(max_new_tokens=128, gamma=8), drafter=drafter)

One chain a cycle (K = 1): lookup proposes one. On the eager engine a cycle where every row matched is as wide as
the longest match (``ngram.py``'s ragged widths); otherwise ``gamma``.
"""

from __future__ import annotations

import torch

from .drafters import DFlashDrafter
from .ngram import NgramDrafter
from .proposal import Proposal


class LookupFirstDrafter:
    """Prompt lookup where it matches, a DFlash drafter elsewhere (module docstring)."""

    kind = "dflash_lookup"

    def __init__(self, model_drafter: DFlashDrafter, lookup: NgramDrafter) -> None:
        if not isinstance(model_drafter, DFlashDrafter):
            raise ValueError(f"decoder=dflash_lookup drafts with a DFlash drafter, got {type(model_drafter).__name__}")
        self.model_drafter, self.lookup = model_drafter, lookup
        self.feature_layers = model_drafter.feature_layers
        self.allowed: torch.Tensor | None = None  # the protocol's field; both draft in the verifier's vocabulary
        self.cycles = self.lookup_cycles = 0  # cycles, and those lookup drafted for every row (no DFlash forward)

    def reset(self, batch_size: int, capacity: int, engine: str | None = None) -> None:
        self.model_drafter.reset(batch_size, capacity, engine=engine)
        self.lookup.reset(batch_size, capacity, engine=engine)

    def keep_rows(self, index: torch.Tensor) -> None:
        self.model_drafter.keep_rows(index)
        self.lookup.keep_rows(index)

    def release(self) -> None:
        self.model_drafter.release()
        self.lookup.release()

    @torch.no_grad()
    def propose(
        self, new_ids, new_valid, *, gamma: int, K: int, generator, iid: bool, features=None, feature_valid=None
    ) -> Proposal:
        if K != 1:
            raise ValueError(f"dflash_lookup proposes one chain per cycle (K=1), got K={K}")
        if self.lookup.vocab_size is None:
            raise ValueError("dflash_lookup needs the verifier's vocab_size for lookup's one-hot q")
        self.model_drafter.check_gamma(gamma)
        self.model_drafter.absorb(features, feature_valid)
        drafts = self.lookup.lookups(new_ids, new_valid, gamma)
        self.cycles += 1
        matched = [len(d) > 0 for d in drafts]
        if all(matched):  # lookup alone: no drafter forward, and on the eager engine no wider than the longest match
            self.lookup_cycles += 1
            width = max(len(d) for d in drafts) if self.lookup.trim else gamma
            tokens = self.lookup.chains(drafts, width).to(new_ids.device)
            return Proposal(tokens=tokens, q=None, forwards=0, point_mass_vocab=self.lookup.vocab_size)
        model = self.model_drafter.draft(new_ids[:, -1], gamma=gamma, K=1, generator=generator, iid=iid)
        if not any(matched):
            return model
        rows = torch.tensor(matched, device=model.tokens.device)
        looked = self.lookup.chains(drafts, gamma).to(model.tokens.device)
        tokens = torch.where(rows[:, None, None], looked, model.tokens)
        q = model.q
        if q is not None:
            point = torch.zeros_like(q).scatter_(-1, looked[:, 0, :, None], 1.0)
            q = torch.where(rows[:, None, None], point, q)
        return Proposal(tokens=tokens, q=q, forwards=1)
