"""Token streams: documents tokenized once, joined with an end-of-text token, sampled as fixed-length windows.

Pretraining in ``stage=bootstrap`` draws random windows of ``seq_len`` tokens from one stream per domain (code,
math), so every sequence is full (no padding) and an epoch boundary never matters. Held-out streams are sampled
with a fixed generator so that every evaluation sees the same windows.

    stream = TokenStream.from_texts(texts, tokenizer)
    batch = stream.sample(batch_size=16, seq_len=256, generator=g)      # LongTensor [16, 256]
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class TokenStream:
    """``ids``: the joined documents; ``doc_starts``: where each document begins; ``aligned``: windows start at a
    document start (right for short documents such as word problems, whose question must be in view to learn the
    answer) rather than anywhere (right for long source files)."""

    def __init__(
        self, ids: torch.Tensor, name: str = "", doc_starts: torch.Tensor | None = None, aligned: bool = False
    ) -> None:
        if ids.ndim != 1:
            raise ValueError(f"a token stream is 1-D; got shape {tuple(ids.shape)}")
        self.ids = ids
        self.name = name
        self.doc_starts = doc_starts if doc_starts is not None else torch.zeros(1, dtype=torch.long)
        self.aligned = aligned

    @classmethod
    def from_texts(
        cls, texts: Iterable[str], tokenizer, name: str = "", batch: int = 256, aligned: bool = False
    ) -> TokenStream:
        """Tokenize ``texts`` (no special tokens added) and join them, each followed by the tokenizer's eos."""
        eos = tokenizer.eos_token_id
        if eos is None:
            raise ValueError("the tokenizer has no eos token; documents in a stream are separated by it")
        chunks: list[torch.Tensor] = []
        pending: list[str] = []

        def flush() -> None:
            for ids in tokenizer(pending, add_special_tokens=False)["input_ids"]:
                chunks.append(torch.tensor([*ids, eos], dtype=torch.int32))
            pending.clear()

        for text in texts:
            pending.append(text)
            if len(pending) == batch:
                flush()
        if pending:
            flush()
        if not chunks:
            raise ValueError(f"token stream {name!r} got no documents")
        lengths = torch.tensor([0] + [c.numel() for c in chunks[:-1]])
        return cls(torch.cat(chunks), name, doc_starts=lengths.cumsum(0), aligned=aligned)

    def __len__(self) -> int:
        return self.ids.numel()

    def sample(self, batch_size: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
        """``[batch_size, seq_len]`` long tensor of windows starting at uniformly random offsets (or, aligned, at
        uniformly random document starts)."""
        if len(self) <= seq_len:
            raise ValueError(f"stream {self.name!r} has {len(self)} tokens, fewer than one window of {seq_len}")
        if self.aligned:
            usable = self.doc_starts[self.doc_starts < len(self) - seq_len]  # never empty: the first start is 0
            starts = usable[torch.randint(0, usable.numel(), (batch_size,), generator=generator)]
        else:
            starts = torch.randint(0, len(self) - seq_len, (batch_size,), generator=generator)
        offsets = starts[:, None] + torch.arange(seq_len)
        return self.ids[offsets].long()


def mixed_batch(
    streams: list[TokenStream], weights: list[float], batch_size: int, seq_len: int, generator: torch.Generator
) -> torch.Tensor:
    """A batch whose rows come from ``streams`` chosen with probabilities ``weights`` (one choice per row)."""
    probs = torch.tensor(weights, dtype=torch.float)
    picks = torch.multinomial(probs / probs.sum(), batch_size, replacement=True, generator=generator)
    rows = [streams[int(k)].sample(1, seq_len, generator) for k in picks]
    return torch.cat(rows)
