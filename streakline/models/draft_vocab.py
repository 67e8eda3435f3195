"""A draft vocabulary: the N target tokens a drafter predicts, and the maps ``speculators`` stores for it.

A drafter that shares its verifier's vocabulary spends most of a small drafter's compute in the head (SmolLM2's
49,152 rows against two 576-wide layers; EAGLE-3 drafts over 32k of Llama-3's 128k). Over the N most frequent target
tokens of its training data instead, the head shrinks to N rows, and a token outside them is one the drafter never
proposes: its drafter probability is 0, which every acceptance rule handles losslessly (the verifier's own token is
then emitted, as for any rejected draft).

The maps, in ``speculators``' convention (its DFlash and EAGLE-3 checkpoints carry them as buffers):

- ``t2d`` ``[V]`` bool: True where target id ``t`` is in the draft vocabulary;
- ``d2t`` ``[N]`` int64 offsets: draft id ``d`` is target id ``d + d2t[d]``;
- draft ids follow target ids in increasing order, so ``ids = arange(N) + d2t`` is sorted and the draft head is the
  verifier head's rows ``ids`` (``speculators`` fills ``lm_head`` with ``verifier_lm_head[t2d]``).

    counts = count_tokens(completions, vocab_size=49152)        # occurrences of each target id
    vocab = DraftVocab.from_counts(counts, 16384, keep=[eos_id])  # the 16,384 most frequent, eos always
    vocab.coverage(held_out_counts)    # share of held-out tokens it can draft: the ceiling of per-token acceptance
    t2d, d2t = vocab.maps()            # what an export stores; DraftVocab.from_maps(t2d, d2t) reads them back

Tests: ``pytest tests/models/test_draft_vocab.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch


class DraftVocabError(ValueError):
    """A draft vocabulary that cannot be built or read: sizes out of range, maps that disagree."""


def count_tokens(rows: Iterable[Sequence[int]], vocab_size: int) -> np.ndarray:
    """``[vocab_size]`` int64 occurrences of every target id in ``rows`` (token id lists, e.g. completions)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for row in rows:
        ids = np.asarray(row, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise DraftVocabError(f"token ids must lie in [0, {vocab_size}), got [{ids.min()}, {ids.max()}]")
        counts += np.bincount(ids, minlength=vocab_size)
    return counts


@dataclass(frozen=True)
class DraftVocab:
    ids: torch.Tensor  # [N] int64, the target ids of draft ids 0 .. N-1, increasing
    vocab_size: int  # V, the target vocabulary's size

    def __post_init__(self) -> None:
        ids = self.ids
        if ids.dim() != 1 or ids.dtype != torch.long or not len(ids):
            raise DraftVocabError(f"a draft vocabulary is a non-empty 1-d int64 id list, got {tuple(ids.shape)}")
        if int(ids[0]) < 0 or int(ids[-1]) >= self.vocab_size:
            raise DraftVocabError(f"draft ids must name target ids in [0, {self.vocab_size})")
        if len(ids) > 1 and not bool((ids[1:] > ids[:-1]).all()):
            raise DraftVocabError("draft ids must follow target ids in increasing order, each once")

    @property
    def size(self) -> int:
        return len(self.ids)

    @classmethod
    def from_counts(cls, counts: np.ndarray | torch.Tensor, n: int, keep: Iterable[int] = ()) -> DraftVocab:
        """The ``n`` target ids of largest count (ties: the lower id), the ids in ``keep`` (eos, say) always among
        them; ``n`` = V gives the whole vocabulary."""
        counts = torch.as_tensor(np.asarray(counts), dtype=torch.long)
        V, keep = len(counts), sorted({int(k) for k in keep})
        if not 1 <= n <= V:
            raise DraftVocabError(f"a draft vocabulary of {n} tokens from a vocabulary of {V}: choose 1 .. {V}")
        if len(keep) > n or (keep and not 0 <= keep[0] <= keep[-1] < V):
            raise DraftVocabError(f"keep={keep} must be at most {n} target ids in [0, {V})")
        score = counts.clone()
        score[keep] = torch.iinfo(torch.long).max  # kept ids first, whatever their count
        # a stable sort on (-count) keeps equal counts in id order, so ties go to the lower id
        order = torch.sort(-score, stable=True).indices[:n]
        return cls(torch.sort(order).values, V)

    @classmethod
    def from_maps(cls, t2d: torch.Tensor, d2t: torch.Tensor) -> DraftVocab:
        """Read ``speculators``' maps back, checking that they describe one vocabulary."""
        t2d, d2t = torch.as_tensor(t2d), torch.as_tensor(d2t)
        if t2d.dim() != 1 or d2t.dim() != 1:
            raise DraftVocabError(f"t2d and d2t are 1-d, got {tuple(t2d.shape)} and {tuple(d2t.shape)}")
        ids = torch.nonzero(t2d.bool()).flatten()
        if len(ids) != len(d2t):
            raise DraftVocabError(f"t2d marks {len(ids)} target ids but d2t maps {len(d2t)} draft ids")
        if not torch.equal(torch.arange(len(d2t)) + d2t.long(), ids):
            raise DraftVocabError("d2t does not send each draft id to the target id t2d marks for it")
        return cls(ids, len(t2d))

    def maps(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(t2d [V] bool, d2t [N] int64)`` as ``speculators`` stores them."""
        t2d = torch.zeros(self.vocab_size, dtype=torch.bool)
        t2d[self.ids] = True
        return t2d, self.ids - torch.arange(self.size)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target ids of draft ids (any shape)."""
        return self.ids.to(draft_ids.device)[draft_ids]

    def to_draft(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids of target ids (any shape), -1 where a target id is outside the draft vocabulary."""
        lookup = torch.full((self.vocab_size,), -1, dtype=torch.long, device=target_ids.device)
        lookup[self.ids.to(target_ids.device)] = torch.arange(self.size, device=target_ids.device)
        return lookup[target_ids]

    def head(self, weight: torch.Tensor) -> torch.Tensor:
        """The draft head: the rows ``ids`` of a target head ``[V, H]``."""
        if weight.shape[0] != self.vocab_size:
            raise DraftVocabError(f"a head of {weight.shape[0]} rows for a draft vocabulary over {self.vocab_size}")
        return weight[self.ids.to(weight.device)]

    def coverage(self, counts: np.ndarray | torch.Tensor) -> float:
        """The share of the token occurrences ``counts`` (``[V]``, e.g. of held-out verifier text) that lie in the
        draft vocabulary: no drafter over it accepts more of them per token than this."""
        counts = torch.as_tensor(np.asarray(counts), dtype=torch.long)
        total = int(counts.sum())
        return float(counts[self.ids].sum()) / total if total else 1.0
