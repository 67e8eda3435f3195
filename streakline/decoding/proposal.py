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
