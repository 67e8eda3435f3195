"""Plain autoregressive generation with the verifier alone: the baseline every speedup divides by.

Batched over ragged prompts (left padding), KV-cached, greedy at temperature 0. Rows stop at their eos or at
``max_new_tokens``; the batch stops when every row has. ``stage=bootstrap`` uses it for the verifier's greedy
continuations that its sanity report scores the drafter against.

    out = greedy_generate(model, [[5, 6, 7], [8]], max_new_tokens=32, eos_token_id=0)   # list of id lists
"""

from __future__ import annotations

import torch

from streakline.errors import UserError
from streakline.models import KVCache, Transformer


def left_pad(prompts: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [B, P], attention_mask [B, P])`` with each prompt right-aligned (left padding)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), P, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, P - len(p) :] = torch.tensor(p)
        mask[i, P - len(p) :] = 1
    return ids, mask


class PositionLimitError(UserError, ValueError):
    """A decode that would run past a model's ``max_position_embeddings``: positions beyond it were never trained,
    so the output would be silently wrong rather than an error."""


# the setting a too-long decode is fixed with, as the command that decodes names it: stage=decode reads the decoder
# group's; stage=evaluate (evaluation/suite.py) re-raises with its own stage.max_new_tokens
NEW_TOKENS_KNOB = "decoder.max_new_tokens"


def check_positions(model: Transformer, prompt_len: int, extra: int, role: str, what: str = "max_new_tokens") -> None:
    """Raise PositionLimitError when ``prompt_len`` prompt tokens plus ``extra`` more positions fed to ``model`` exceed
    its ``max_position_embeddings``. ``extra`` counts what is fed, not what is produced: a decode of N new tokens
    feeds N - 1 of them (the last one is emitted, never fed back), plus a draft window or block where one is
    appended."""
    limit = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    if limit and prompt_len + extra > limit:
        raise PositionLimitError(
            f"a prompt of {prompt_len} tokens plus {extra} more positions ({what}) needs {prompt_len + extra} "
            f"positions, beyond the {role}'s max_position_embeddings={limit}; shorten the prompt or lower "
            f"{NEW_TOKENS_KNOB} (and decoder.gamma)"
        )


@torch.no_grad()
def greedy_generate(
    model: Transformer,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_token_id: int | None = None,
    engine: str | None = None,
) -> list[list[int]]:
    """Greedy continuation of each prompt; the eos token, when produced, ends (and is kept in) a row's output.
    engine: the KV cache engine (``models/kv_cache.py``; None: the model's, else auto)."""
    device = model.embed.weight.device
    ids, mask = left_pad(prompts)
    ids, mask = ids.to(device), mask.to(device)
    B = ids.shape[0]
    # the last new token is never fed back, so N new tokens take N - 1 positions past the prompt
    check_positions(model, ids.shape[1], max_new_tokens - 1, "model", "max_new_tokens - 1")
    cache = KVCache.for_model(model, B, capacity=ids.shape[1] + max_new_tokens, engine=engine)
    try:
        return _greedy(model, ids, mask, cache, max_new_tokens, eos_token_id)
    finally:
        cache.release()


def _greedy(model, ids, mask, cache, max_new_tokens, eos_token_id) -> list[list[int]]:
    device, B = ids.device, ids.shape[0]
    padded = bool((mask == 0).any())
    logits = model(ids, attention_mask=mask if padded else None, cache=cache, logits_to_keep=1)
    out: list[list[int]] = [[] for _ in range(B)]
    done = torch.zeros(B, dtype=torch.bool, device=device)
    positions = mask.sum(1)  # next position id of each row
    for step in range(max_new_tokens):
        nxt = logits[:, -1].argmax(-1)
        for i in range(B):
            if not done[i]:
                out[i].append(int(nxt[i]))
        if eos_token_id is not None:
            done |= nxt == eos_token_id
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        logits = model(nxt[:, None], cache=cache, position_ids=positions[:, None])
        positions = positions + 1
    return out
