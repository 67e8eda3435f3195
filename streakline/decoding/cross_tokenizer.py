"""Drafting across tokenizers: a drafter whose vocabulary differs from the verifier's (docs/algorithms.md section 1).

Token strings connect the two vocabularies. ``VocabBridge`` maps every drafter id onto the verifier id with the
same raw token string (same-family tokenizers, byte pieces included) or, failing that, the same decoded text
(different conventions, e.g. sentencepiece against byte-level); the other drafter ids (special tokens, pieces
the verifier lacks) are *unmappable* and get -inf logits before sampling, so a draft
never contains them. Greedy acceptance needs no drafter probabilities, so it stays lossless whatever the drafter
proposes; leviathan gets the drafter distribution pushed onto verifier ids (summed when several drafter ids map
to one verifier id).

``CrossTokenizerDrafter`` wraps any drafter (``ar`` or ``diffusion``). The verifier's committed ids are decoded to
text and re-encoded with the drafter's tokenizer every cycle, and the inner drafter drafts from that context from
scratch (its KV cache cannot be extended: re-encoding can change how the tail of the text is split). That costs a
drafter prefill per cycle; same-tokenizer pairs never take this path.

    bridge = VocabBridge(drafter_tokenizer, verifier_tokenizer)
    drafter = CrossTokenizerDrafter(DiffusionDrafter(model), bridge, verifier_tokenizer, drafter_tokenizer)

Tests: ``python -m pytest tests/decoding/test_cross_tokenizer.py``.
"""

from __future__ import annotations

import torch

from .drafters import Proposal
from .vanilla import left_pad


class VocabBridge:
    def __init__(self, drafter_tokenizer, verifier_tokenizer, drafter_vocab: int | None = None) -> None:
        """``drafter_vocab``: the drafter model's vocabulary size when it pads past the tokenizer's."""
        # Two passes: identical raw token strings first (same-family tokenizers, byte pieces included), then
        # identical decoded text (different conventions, e.g. a sentencepiece drafter for a byte-level verifier).
        v_specials, d_specials = set(verifier_tokenizer.all_special_ids), set(drafter_tokenizer.all_special_ids)
        v_pieces: dict[str, int] = {}
        v_texts: dict[str, int] = {}
        for j, piece in enumerate(verifier_tokenizer.convert_ids_to_tokens(list(range(len(verifier_tokenizer))))):
            if j in v_specials or piece is None:
                continue
            v_pieces.setdefault(piece, j)  # the lowest id wins when two agree
            text = verifier_tokenizer.decode([j])
            if text and "\ufffd" not in text:
                v_texts.setdefault(text, j)
        to_verifier = torch.full((max(len(drafter_tokenizer), drafter_vocab or 0),), -1, dtype=torch.long)
        d_ids = list(range(len(drafter_tokenizer)))
        for i, piece in zip(d_ids, drafter_tokenizer.convert_ids_to_tokens(d_ids), strict=True):
            if i in d_specials or piece is None:
                continue
            if piece in v_pieces:
                to_verifier[i] = v_pieces[piece]
                continue
            text = drafter_tokenizer.decode([i])
            if text and "\ufffd" not in text:
                to_verifier[i] = v_texts.get(text, -1)
        self.to_verifier = to_verifier
        self.mappable = to_verifier >= 0
        self.verifier_vocab = len(verifier_tokenizer)
        if not bool(self.mappable.any()):
            raise ValueError(
                "no drafter token has the text of any verifier token: these tokenizers cannot draft for each other"
            )

    @property
    def coverage(self) -> float:
        """Fraction of drafter ids that map onto a verifier id."""
        return float(self.mappable.float().mean())

    def ids(self, drafter_ids: torch.Tensor) -> torch.Tensor:
        return self.to_verifier.to(drafter_ids.device)[drafter_ids]

    def distribution(self, q: torch.Tensor, verifier_vocab: int) -> torch.Tensor:
        """``[..., V_verifier]`` from a drafter distribution ``[..., V_drafter]`` (zero outside the mappable ids)."""
        out = q.new_zeros(*q.shape[:-1], verifier_vocab)
        m = self.mappable.to(q.device)
        index = self.to_verifier.to(q.device)[m].expand(*q.shape[:-1], -1)
        return out.scatter_add_(-1, index, q[..., m])


class CrossTokenizerDrafter:
    """Any drafter, made to draft for a verifier with another tokenizer by re-encoding the text every cycle."""

    def __init__(self, inner, bridge: VocabBridge, verifier_tokenizer, drafter_tokenizer) -> None:
        self.inner, self.bridge = inner, bridge
        self.v_tok, self.d_tok = verifier_tokenizer, drafter_tokenizer
        self.kind = f"cross_tokenizer({inner.kind})"
        inner.allowed = bridge.mappable
        self.history: list[list[int]] = []

    def reset(self, batch_size: int, capacity: int, engine: str | None = None) -> None:
        self.history = [[] for _ in range(batch_size)]
        self.capacity, self.engine = capacity, engine

    def release(self) -> None:
        self.inner.release()

    def keep_rows(self, index: torch.Tensor) -> None:
        self.history = [self.history[i] for i in index.tolist()]

    @torch.no_grad()
    def propose(self, new_ids, new_valid, *, gamma: int, K: int, generator, iid: bool) -> Proposal:
        valid = torch.ones_like(new_ids, dtype=torch.bool) if new_valid is None else new_valid.bool()
        contexts = []
        for row, (ids, ok) in enumerate(zip(new_ids.tolist(), valid.tolist(), strict=True)):
            self.history[row].extend(t for t, v in zip(ids, ok, strict=True) if v)
            text = self.v_tok.decode(self.history[row])
            encoded = self.d_tok(text, add_special_tokens=False)["input_ids"]
            if not encoded:
                raise ValueError("the drafter's tokenizer encodes this context to nothing; give a non-empty prompt")
            contexts.append(encoded)
        ids, mask = left_pad(contexts)
        ragged = len({len(c) for c in contexts}) > 1
        self.inner.reset(len(contexts), ids.shape[1] + 2 * gamma + 2, engine=self.engine)
        inner = self.inner.propose(
            ids.to(new_ids.device),
            mask.bool().to(new_ids.device) if ragged else None,
            gamma=gamma,
            K=K,
            generator=generator,
            iid=iid,
        )
        inner_q = inner.distribution()
        q = None if inner_q is None else self.bridge.distribution(inner_q, self.bridge.verifier_vocab)
        return Proposal(tokens=self.bridge.ids(inner.tokens), q=q, forwards=inner.forwards)
