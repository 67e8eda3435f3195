"""Tiny random configurations of each family, shared by the model tests."""

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
