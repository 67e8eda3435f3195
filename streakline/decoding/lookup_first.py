"""Prompt lookup first, the DFlash drafter where it finds nothing (``decoder=dflash_lookup``).

On a small verifier neither drafter wins everywhere: prompt lookup (``ngram.py``) drafts for free and is right most
of the time on code that repeats its context, but finds a match in only part of the cycles (27% on chat in the
SmolLM2 study); a trained DFlash drafter drafts every cycle but costs a forward and half a verifier step. This
drafter asks lookup first, row by row, and runs the DFlash draft only when a row without a match wants it (its
drafts have lately paid: ``floor`` below), so a cycle costs what the cheaper drafter that has something to say costs.

Every cycle the DFlash drafter still absorbs the verifier's states of the newly cached tokens (its context must
hold every committed token whichever drafter proposed them); that is its projection and each layer's keys and
values, not a draft. A row's draft is lookup's (padded to the cycle's width by repeating its last token, q one-hot)
when lookup matched, else the DFlash chain and its q (or nothing). Which drafter a row uses is a function of its tokens,
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

# A row's model streak is an exponential average of the drafts accepted in its DFlash cycles, this weight on the latest
STREAK_WEIGHT = 0.25
PROBE_EVERY = 8  # a row below the floor still drafts with the model every this many cycles, to see if it got better


class LookupFirstDrafter:
    """Prompt lookup where it matches, a DFlash drafter elsewhere (module docstring).

    ``floor``: a row whose DFlash drafts have lately been accepted for fewer than this many tokens a cycle (an
    exponential average, ``STREAK_WEIGHT`` on the latest) stops paying for them: where lookup finds nothing it
    drafts nothing (a plain verifier step), and tries the model again every ``PROBE_EVERY`` cycles. A DFlash cycle
    that costs c vanilla steps breaks even at c - 1 accepted tokens (0.5 for SmolLM2's on 2 CPU cores). 0: always
    draft with the model. The choice reads only the row's accepted counts, so it stays a function of its tokens."""

    kind = "dflash_lookup"

    def __init__(self, model_drafter: DFlashDrafter, lookup: NgramDrafter, *, floor: float = 0.0) -> None:
        if not isinstance(model_drafter, DFlashDrafter):
            raise ValueError(f"decoder=dflash_lookup drafts with a DFlash drafter, got {type(model_drafter).__name__}")
        if not floor >= 0:
            raise ValueError(f"decoder.lookup_floor must be >= 0 (accepted tokens a DFlash cycle), got {floor}")
        self.model_drafter, self.lookup, self.floor = model_drafter, lookup, floor
        self.feature_layers = model_drafter.feature_layers
        self.allowed: torch.Tensor | None = None  # the protocol's field; both draft in the verifier's vocabulary
        self.cycles = self.lookup_cycles = 0  # cycles, and those with no DFlash forward
        self._state(0)

    def _state(self, batch_size: int) -> None:
        self.used_model = [False] * batch_size  # whether the row's last draft was the DFlash drafter's
        self.streak: list[float | None] = [None] * batch_size  # its model streak (None: not drafted yet)
        self.idle = [0] * batch_size  # cycles since its last model draft

    def reset(self, batch_size: int, capacity: int, engine: str | None = None) -> None:
        self.model_drafter.reset(batch_size, capacity, engine=engine)
        self.lookup.reset(batch_size, capacity, engine=engine)
        self._state(batch_size)

    def keep_rows(self, index: torch.Tensor) -> None:
        self.model_drafter.keep_rows(index)
        self.lookup.keep_rows(index)
        keep = index.tolist()
        self.used_model = [self.used_model[i] for i in keep]
        self.streak = [self.streak[i] for i in keep]
        self.idle = [self.idle[i] for i in keep]

    def release(self) -> None:
        self.model_drafter.release()
        self.lookup.release()

    def _learn(self, new_ids: torch.Tensor, new_valid: torch.Tensor | None) -> None:
        """The tokens cached since the last call are the last cycle's accepted drafts and the token after them."""
        counts = [new_ids.shape[1]] * new_ids.shape[0] if new_valid is None else new_valid.sum(1).tolist()
        for b, n in enumerate(counts):
            if self.used_model[b]:
                s = self.streak[b]
                self.streak[b] = n - 1 if s is None else (1 - STREAK_WEIGHT) * s + STREAK_WEIGHT * (n - 1)

    def _wants_model(self, b: int) -> bool:
        s = self.streak[b]
        return self.floor <= 0 or s is None or s >= self.floor or self.idle[b] + 1 >= PROBE_EVERY

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
        self._learn(new_ids, new_valid)
        drafts = self.lookup.lookups(new_ids, new_valid, gamma)
        self.cycles += 1
        model_rows = [not len(d) and self._wants_model(b) for b, d in enumerate(drafts)]
        self.used_model = model_rows
        self.idle = [0 if m else i + 1 for m, i in zip(model_rows, self.idle, strict=True)]
        if not any(model_rows):  # lookup or nothing: no drafter forward, on the eager engine as wide as the longest
            self.lookup_cycles += 1  # match (0: a plain verifier step)
            width = max(len(d) for d in drafts) if self.lookup.trim else gamma
            tokens = self.lookup.chains(drafts, width).to(new_ids.device)
            return Proposal(tokens=tokens, q=None, forwards=0, point_mass_vocab=self.lookup.vocab_size)
        model = self.model_drafter.draft(new_ids[:, -1], gamma=gamma, K=1, generator=generator, iid=iid)
        if all(model_rows):
            return model
        rows = torch.tensor(model_rows, device=model.tokens.device)
        looked = self.lookup.chains(drafts, gamma).to(model.tokens.device)  # a row without a match: its pending token
        tokens = torch.where(rows[:, None, None], model.tokens, looked)
        point = torch.zeros_like(model.q).scatter_(-1, looked[:, 0, :, None], 1.0)
        q = torch.where(rows[:, None, None], model.q, point)
        return Proposal(tokens=tokens, q=q, forwards=1)
