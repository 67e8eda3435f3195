"""Prompt-lookup drafting (``decoder=ngram``): the training-free baseline a trained drafter has to beat.

No model drafts. Each cycle, for n from ``n_max`` down to ``n_min``, the last n committed tokens of a row (the
pending token included) are looked up in the row's earlier context (prompt and output); at the latest earlier
occurrence, the up-to-gamma tokens that followed it are the draft. The first n that matches wins; a row without a
match drafts nothing. This is the ``ngram`` method of vLLM and of "prompt lookup decoding"; on small targets it is
the drafter to beat (Mainardi et al., EACL 2026, docs/decoding.md).

Lossless like every drafter: the draft is a deterministic function of the context, so its q is one-hot at the
drafted token, and every acceptance rule stays exact (leviathan accepts with probability p(x), and on a rejection
samples ``norm(max(p - q, 0))``, which is p with x removed).

Width. On the eager engine a cycle drafts only as many tokens as the longest match of the batch supplies (zero: a
plain verifier step, no wider than vanilla's), so a miss costs nothing; rows with shorter matches are padded by
repeating their last draft (one-hot too, so still exact). The static engines (a GPU's fixed shapes, CUDA graphs)
always get ``gamma`` tokens.

    drafter = NgramDrafter(n_max=4, n_min=2)
    generate(verifier, prompts, SpecConfig(max_new_tokens=128, gamma=8), drafter=drafter)
    lookup(np.array([5, 6, 7, 9, 5, 6]), n_min=1, n_max=3, k=4)     # -> array([7, 9, 5, 6]): after "5 6"

Tests: ``python -m pytest tests/decoding/test_ngram.py``.
"""

from __future__ import annotations

import numpy as np
import torch

from .proposal import Proposal

NGRAM_MAX = 4  # the longest suffix looked up (decoder.ngram_max)
NGRAM_MIN = 2  # the shortest (decoder.ngram_min): a 1-token match proposes too often to pay on a CPU


def lookup(context: np.ndarray, *, n_min: int, n_max: int, k: int) -> np.ndarray:
    """The up-to-``k`` tokens that followed the latest earlier occurrence of ``context``'s last n tokens, for the
    largest n in ``[n_min, n_max]`` that occurs earlier; an empty array when none does."""
    L = len(context)
    if k < 1:
        return context[:0]
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        # starts 0 .. L-1-n: every occurrence but the suffix itself, each followed by at least one token
        windows = np.lib.stride_tricks.sliding_window_view(context[: L - 1], n)
        hits = np.flatnonzero((windows == context[L - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return context[start : start + k]
    return context[:0]


class NgramDrafter:
    """Prompt lookup as a drafter of ``speculative.generate`` (module docstring); one chain (K = 1)."""

    kind = "ngram"
    needs_model = False  # registry.speculative_setup builds it from the decoder settings alone

    def __init__(self, *, n_max: int = NGRAM_MAX, n_min: int = NGRAM_MIN, vocab_size: int | None = None) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"ngram lookup needs 1 <= decoder.ngram_min <= decoder.ngram_max, got {n_min} and {n_max}")
        self.n_max, self.n_min = n_max, n_min
        self.vocab_size = vocab_size  # q's width; None: read from the verifier by generate (set_vocab)
        self.allowed: torch.Tensor | None = None  # the protocol's field: drafts are context tokens, always allowed
        self.rows: list[np.ndarray] = []
        self.trim = True

    def reset(self, batch_size: int, capacity: int, engine: str | None = None) -> None:
        self.rows = [np.zeros(0, dtype=np.int64) for _ in range(batch_size)]
        # fixed shapes on the static engines (what "auto" picks on a GPU); ragged widths on the eager one
        self.trim = engine in (None, "eager") or (engine == "auto" and not torch.cuda.is_available())

    def keep_rows(self, index: torch.Tensor) -> None:
        self.rows = [self.rows[i] for i in index.tolist()]

    def release(self) -> None:
        self.rows = []

    @torch.no_grad()
    def propose(self, new_ids, new_valid, *, gamma: int, K: int, generator, iid: bool) -> Proposal:
        if K != 1:
            raise ValueError(f"ngram proposes one chain per cycle (K=1), got K={K}")
        if self.vocab_size is None:
            raise ValueError("NgramDrafter needs vocab_size (the verifier's) for its one-hot q")
        drafts = self.lookups(new_ids, new_valid, gamma)
        width = max((len(d) for d in drafts), default=0) if self.trim else gamma
        tokens = self.chains(drafts, width).to(new_ids.device)
        # q is one-hot on the draft: Proposal.distribution() builds it only for a rule that reads q
        return Proposal(tokens=tokens, q=None, forwards=0, point_mass_vocab=self.vocab_size)

    def lookups(self, new_ids: torch.Tensor, new_valid: torch.Tensor | None, gamma: int) -> list[np.ndarray]:
        """Each row's draft (up to ``gamma`` tokens, empty without a match), after adding the tokens committed since
        the last call (``new_ids`` ``[B, n]``, ``new_valid`` marking the real ones of a ragged batch) to its context."""
        ids = new_ids.cpu().numpy()
        valid = None if new_valid is None else new_valid.cpu().numpy()
        drafts = []
        for b in range(len(self.rows)):
            new = ids[b] if valid is None else ids[b][valid[b]]
            self.rows[b] = np.concatenate([self.rows[b], new])
            drafts.append(lookup(self.rows[b], n_min=self.n_min, n_max=self.n_max, k=gamma))
        return drafts

    def chains(self, drafts: list[np.ndarray], width: int) -> torch.Tensor:
        """``[B, 1, width]`` draft chains: each draft padded by repeating its last token (a row without one: its
        pending token), so the padding is one-hot too and every acceptance rule stays exact."""
        tokens = torch.zeros(len(drafts), 1, width, dtype=torch.long)
        for b, d in enumerate(drafts):
            if width:
                fill = d[-1] if len(d) else self.rows[b][-1]
                tokens[b, 0] = torch.from_numpy(np.concatenate([d, np.full(width - len(d), fill, dtype=np.int64)]))
        return tokens
