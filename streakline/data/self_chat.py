"""``self-chat``: user requests the verifier writes itself, for prompt sets as large as the training wants.

A chat model has learnt what users ask. Started at its chat template's user-turn prefix (for SmolLM2-Instruct its
system turn and ``<|im_start|>user\\n``; the plain ``User: `` rendering without a template) and sampled until the turn
ends, it writes one request; seeded samples give as many as asked. What it writes is kept only when it reads as a
request a person might type:

- it ended its turn (a request cut off at the token limit is half a request);
- 3 to 120 words and at most 600 characters;
- mostly Latin script (at least 90% of its letters ASCII): the evaluation sets are English, and so are their users;
- no template debris: no special-token text (``<|``, ``|>``, ``<s>``, ``[INST]``) and no role label opening a line
  (``User:``, ``Assistant:``, ``system``), which would mean the model wrote a conversation, not a request;
- language, not only shape: at least ``KNOWN_SHARE`` (half) of its words are common English words
  (``data/english.py``), so that noise of a request's shape (``'__ ny3c__ it ta son mores andSfh3 each o00 c ...'``,
  4 of 11) is dropped. Measured on SmolLM2-135M-Instruct's 102 requests of the demo's list, the lowest scores 0.62
  (a request naming made-up names); every one passes;
- new: not the same request as an earlier one once case, spacing and trailing punctuation are set aside, and not a
  prompt of an evaluation set (``excluded``: hashes as ``conversations.prompt_hash`` computes them).

This module holds what a request is (the prefix, the filter, the dedup key); ``pipelines/common/self_chat.py``
samples them with the verifier and caches them by content (docs/data.md, "Prompts the verifier writes").

    prefix, end = user_turn(tokenizer, chat_template=True)
    text, why = accept(raw_completion_text, end)        # text, or None and the reason it was dropped

Tests: ``pytest tests/data/test_self_chat.py``.
"""

from __future__ import annotations

import re
from typing import Any

from .english import known_share

SELF_CHAT = "self-chat"  # its name in data.prompt_sources
MARK = "\x00streakline-user-request\x00"  # stands for the request while the template renders around it
MIN_WORDS, MAX_WORDS, MAX_CHARS = 3, 120, 600
ASCII_SHARE = 0.9  # of the letters
KNOWN_SHARE = 0.5  # of the words: common English words (data/english.py)
DEBRIS = ("<|", "|>", "<s>", "</s>", "[INST]", "[/INST]", "<<SYS>>", "\x00")
ROLE_LINE = re.compile(r"^\s*(user|assistant|system|human|ai)\s*[:\n]", re.IGNORECASE | re.MULTILINE)
PLAIN_PREFIX, PLAIN_END = "User: ", "\n"  # conversations.render_prompt's plain rendering of a user turn


class SelfChatError(ValueError):
    """The tokenizer's template gives no place for a user request (no user turn, or one that does not end)."""


def user_turn(tokenizer: Any, chat_template: bool) -> tuple[str, str]:
    """``(prefix, end)``: the text a user request follows (the template's rendering of a conversation up to where its
    one user message starts, system turn included) and the text that ends the request (up to the first newline or
    space after it, e.g. ``<|im_end|>``). Without a template (or with ``chat_template`` off) the plain rendering's
    ``"User: "`` and a newline."""
    if not (chat_template and getattr(tokenizer, "chat_template", None)):
        return PLAIN_PREFIX, PLAIN_END
    text = tokenizer.apply_chat_template([{"role": "user", "content": MARK}], tokenize=False)
    if MARK not in text:
        raise SelfChatError("the tokenizer's chat template renders no user message; use data.chat_template=false")
    prefix, rest = text.split(MARK, 1)
    end = rest.strip(" ").split("\n", 1)[0].strip()
    if not end:
        raise SelfChatError(
            "the tokenizer's chat template closes a user turn with nothing but whitespace, so the end of a request "
            "cannot be told from a newline inside it; use data.chat_template=false"
        )
    return prefix, end


def accept(text: str, end: str) -> tuple[str | None, str]:
    """``(request, "ok")`` for a completion (decoded with special tokens) that is a request ending at ``end``;
    ``(None, reason)`` otherwise, the reason one of ``unended``, ``length``, ``script``, ``debris``, ``language``."""
    if end not in text:
        return None, "unended"
    request = text.split(end, 1)[0].strip()
    words = request.split()
    if not MIN_WORDS <= len(words) <= MAX_WORDS or len(request) > MAX_CHARS:
        return None, "length"
    letters = [c for c in request if c.isalpha()]
    if not letters or sum(c.isascii() for c in letters) < ASCII_SHARE * len(letters):
        return None, "script"
    if any(d in request for d in DEBRIS) or ROLE_LINE.search(request):
        return None, "debris"
    if known_share(request) < KNOWN_SHARE:
        return None, "language"
    return request, "ok"


def dedup_key(request: str) -> str:
    """What two requests share when they are the same request: lower case, runs of whitespace as one space, no
    trailing punctuation."""
    return re.sub(r"\s+", " ", request.lower()).strip().rstrip(".?!:; ")


def record(index: int, request: str) -> dict[str, str]:
    """The source record of the ``index``-th candidate, kept: a one-turn chat prompt with no reference answer."""
    return {"id": f"{SELF_CHAT}-{index:07d}", "prompt": request, "reference": "", "domain": "chat"}
