"""Tiny random configurations of each family, and a tokenizer with its ids shuffled, shared by the model tests."""

import json
import shutil

import torch

from streakline.models import TransformerConfig

VOCAB = 97  # odd on purpose: nothing may assume a power of two


def tiny_config(family: str, **overrides) -> TransformerConfig:
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=88,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        rope_theta=5000.0,  # not the default, so a lost theta shows up as a parity failure
        rms_norm_eps=1e-5,
        max_position_embeddings=256,
        family=family,
        tie_embeddings=False,
    )
    if family in ("qwen2", "dream"):
        base["qkv_bias"] = True
    if family in ("qwen3", "sdar"):
        base.update(qk_norm=True, head_dim=24)  # head_dim != hidden/heads, as in real Qwen3 checkpoints
    if family == "dream":
        base.update(attention="full", shift=True, mask_token_id=VOCAB - 1)
    if family == "sdar":
        base.update(attention="block_causal", block_size=4, mask_token_id=VOCAB - 1)
    base.update(overrides)
    return TransformerConfig(**base)


def permuted_tokenizer(folder, out, seed=0) -> dict[int, int]:
    """A copy at ``out`` of the tokenizer folder ``folder`` whose non-special ids are shuffled: the same strings
    under other ids. Returns the map old id -> new id."""
    shutil.copytree(folder, out)
    spec = json.loads((out / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    fixed = {t["id"] for t in spec["added_tokens"]}
    movable = sorted(i for i in vocab.values() if i not in fixed)
    perm = torch.randperm(len(movable), generator=torch.Generator().manual_seed(seed)).tolist()
    new_id = {old: movable[p] for old, p in zip(movable, perm, strict=True)}
    spec["model"]["vocab"] = {t: new_id.get(i, i) for t, i in vocab.items()}
    (out / "tokenizer.json").write_text(json.dumps(spec))
    return new_id
