"""Tokenizers: loading from a local folder, special-token lookup, identity hashes, adding a mask token.

Tokenizers are always ``transformers.AutoTokenizer`` objects read from a folder (``trust_remote_code`` is never
enabled). Diffusion drafters need a mask token; ``mask_token_id`` finds it by its string and fails with a message
naming the fix, and ``add_mask_token`` adds one (embedding initialised to the mean embedding,
docs/algorithms.md section 1) when the config asks for it.

    tok = load_tokenizer("/ckpt/diffucoder")
    mask = mask_token_id(tok, "<|mask|>", role="drafter")
"""

from __future__ import annotations

import hashlib
import json
import os

import torch

from .checkpoint import CheckpointError
from .transformer import Transformer


def load_tokenizer(folder: str | os.PathLike):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"cannot load a tokenizer from {folder} ({e}); point model.<role>.tokenizer at a folder with "
            "tokenizer.json / tokenizer_config.json"
        ) from e


def mask_token_id(tokenizer, token: str | None, role: str = "drafter") -> int:
    """Id of ``token`` in ``tokenizer``; an error naming the fix when it is absent."""
    if token is None:
        if tokenizer.mask_token_id is not None:
            return tokenizer.mask_token_id
        raise CheckpointError(
            f"the {role} has no mask token: set model.{role}.mask_token to one of its special tokens, "
            "or add one with streakline.models.tokenizer.add_mask_token"
        )
    vocab = tokenizer.get_vocab()
    if token not in vocab:
        specials = ", ".join(sorted(tokenizer.all_special_tokens)[:12])
        raise CheckpointError(
            f"the {role} tokenizer has no token {token!r} (special tokens: {specials}); set model.{role}.mask_token "
            "to one it has, or add it with streakline.models.tokenizer.add_mask_token"
        )
    return vocab[token]


def tokenizer_hash(tokenizer) -> str:
    """12-hex identity of a tokenizer's vocabulary and special tokens: two tokenizers that encode alike agree."""
    payload = {"vocab": sorted(tokenizer.get_vocab().items()), "special": sorted(tokenizer.all_special_tokens)}
    return hashlib.sha256(json.dumps(payload, ensure_ascii=False).encode()).hexdigest()[:12]


@torch.no_grad()
def add_mask_token(model: Transformer, tokenizer, token: str = "<|mask|>") -> int:
    """Add ``token`` to ``tokenizer`` and give it the mean input embedding (and mean output row when untied).

    Uses a spare row when the embedding is already larger than the tokenizer (common: vocabularies are padded);
    otherwise grows the embedding by one row. Returns the new id and records it in ``model.config``.
    """
    if token in tokenizer.get_vocab():
        raise CheckpointError(f"the tokenizer already has {token!r}; use it as the mask token instead of adding it")
    tokenizer.add_special_tokens({"mask_token": token})
    new_id = tokenizer.convert_tokens_to_ids(token)
    V = model.config.vocab_size
    if new_id >= V:
        _grow_vocab(model, new_id + 1)
    model.embed.weight[new_id] = model.embed.weight[:V].mean(0)
    if model.lm_head is not None:
        model.lm_head.weight[new_id] = model.lm_head.weight[:V].mean(0)
    model.config.mask_token_id = new_id
    return new_id


def _grow_vocab(model: Transformer, size: int) -> None:
    old = model.config.vocab_size
    emb = torch.nn.Embedding(size, model.config.hidden_size, dtype=model.embed.weight.dtype)
    emb.weight[:old] = model.embed.weight
    model.embed = emb.to(model.embed.weight.device)
    if model.lm_head is not None:
        head = torch.nn.Linear(model.config.hidden_size, size, bias=False, dtype=model.lm_head.weight.dtype)
        head.weight[:old] = model.lm_head.weight
        model.lm_head = head.to(model.lm_head.weight.device)
    model.config.vocab_size = size


def has_tokenizer(folder: str | os.PathLike) -> bool:
    """True when ``folder`` holds a tokenizer ``transformers`` can load (``tokenizer.json`` or its config)."""
    from pathlib import Path

    return any((Path(folder) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json"))
