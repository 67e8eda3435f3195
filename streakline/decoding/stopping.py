"""When a generated row stops: eos tokens, a token budget, stop strings.

``StopCriteria.cut(tokens, n_new)`` looks only at the last ``n_new`` tokens (those the latest cycle emitted) and
returns ``(length to cut the row to, reason)`` with reason ``"eos"``, ``"stop"`` (a stop string) or ``"length"``
(the token budget), or None to go on. The token that ends a row (an eos, the token that completes
a stop string) is kept, as ``transformers`` does.

    stop = StopCriteria(max_new_tokens=64, eos_token_ids=[0], stop_strings=["\\n\\n"], tokenizer=tok)
    stop.cut(row_tokens, n_new=3)   # -> None or (length <= len(row_tokens), "eos" | "stop" | "length")
"""

from __future__ import annotations

from collections.abc import Iterable


class StopCriteria:
    def __init__(
        self,
        max_new_tokens: int,
        eos_token_ids: Iterable[int] = (),
        stop_strings: Iterable[str] = (),
        tokenizer=None,
    ) -> None:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.max_new_tokens = max_new_tokens
        self.eos = {int(e) for e in eos_token_ids if e is not None}
        self.stop_strings = [s for s in stop_strings if s]
        if self.stop_strings and tokenizer is None:
            raise ValueError("stop strings need a tokenizer to decode the generated text")
        self.tokenizer = tokenizer
        # Every token decodes to at least one character except a few special ones, so a stop string of c characters
        # spans at most c tokens (plus slack for byte-level pieces that decode to nothing on their own).
        self.window = max((len(s) for s in self.stop_strings), default=0) + 4

    def cut(self, tokens: list[int], n_new: int) -> tuple[int, str] | None:
        first_new = max(0, len(tokens) - n_new)
        for i in range(first_new, len(tokens)):
            if tokens[i] in self.eos:
                return i + 1, "eos"
            if self.stop_strings:
                text = self.tokenizer.decode(tokens[max(0, i + 1 - self.window) : i + 1])
                if any(s in text for s in self.stop_strings):
                    return i + 1, "stop"
            if i + 1 >= self.max_new_tokens:
                return i + 1, "length"
        return None
