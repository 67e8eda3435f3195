"""What a drafter hands the speculative loop each cycle (``speculative.generate``): the draft chains, the
distribution they were drawn from, and what they cost. Its own module so that every drafter kind (``drafters.py``,
``ngram.py``, ``cross_tokenizer.py``) can import it without importing the others.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Proposal:
    tokens: torch.Tensor  # [B, K, G] draft token ids (verifier vocabulary); G may be below the asked gamma (ngram)
    q: torch.Tensor | None  # [B, G, V] the distribution every chain's slot j was drawn from (None if not needed)
    forwards: int  # drafter forwards this proposal cost (0: no model ran)
    # q is a point mass on the chain (a deterministic drafter, K=1): left None and built by distribution(), only for
    # a rule that reads q, so a model-free drafter never allocates [B, G, V] on the hot path
    point_mass_vocab: int | None = None

    def distribution(self) -> torch.Tensor | None:
        """``q`` as the acceptance rules read it: the stored one, or the one-hot of the chain for a point mass."""
        if self.q is not None or self.point_mass_vocab is None:
            return self.q
        chain = self.tokens[:, 0]  # [B, G]
        q = torch.zeros(*chain.shape, self.point_mass_vocab, device=chain.device)
        return q.scatter_(-1, chain[..., None], 1.0)
