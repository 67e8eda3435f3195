"""Architecture description of one transformer of the Llama / Qwen2 / Qwen3 family.

``TransformerConfig`` is what ``streakline.models.Transformer`` is built from. It is filled either from a
checkpoint folder's ``config.json`` (``streakline.models.checkpoint.read_config``) or, in the tiny world, from a
preset's ``arch`` block (``from_arch``). Behaviour that a checkpoint's ``config.json`` does not record (the
attention mode a diffusion model was trained with, whether its logits are shifted) lives here too, so one object
says everything the model code needs.

    from streakline.models import TransformerConfig, Transformer
    cfg = TransformerConfig(vocab_size=4096, hidden_size=128, intermediate_size=384, num_layers=4,
                            num_heads=4, num_kv_heads=2, attention="prefix_causal")
    model = Transformer(cfg)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

ATTENTION_MODES = ("causal", "full", "prefix_causal", "block_causal")


# The TransformerConfig fields that fix tensor shapes besides vocab_size.
SHAPE_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "qkv_bias",
    "qk_norm",
    "tie_embeddings",
)


@dataclass(frozen=True)
class FamilySpec:
    """What a model family's Hugging Face checkpoint looks like; ``checkpoint.py`` reads and writes folders by it."""

    model_type: str  # config.json "model_type"
    architecture: str  # config.json "architectures"
    weights: str | None  # which weight-name table: "llama", "qwen2" or "qwen3"; None: reading it is not implemented
    attention: str  # the attention mode its checkpoints are trained with, unless the folder or preset says otherwise
    shift: bool  # logit i-1 predicts token i (AR-initialised diffusion models)


# The one registry of model families: TransformerConfig.family, checkpoint presets' ``family`` and checkpoint.py all
# use these names. It lives here, not in checkpoint.py, because checkpoint.py imports this module (and this one must
# stay free of torch). config/schema.py:FAMILIES repeats the names; tests/test_registries.py keeps them equal.
FAMILIES: dict[str, FamilySpec] = {
    "llama": FamilySpec("llama", "LlamaForCausalLM", "llama", "causal", False),
    "qwen2": FamilySpec("qwen2", "Qwen2ForCausalLM", "qwen2", "causal", False),
    "qwen3": FamilySpec("qwen3", "Qwen3ForCausalLM", "qwen3", "causal", False),
    "dream": FamilySpec("Dream", "DreamModel", "qwen2", "full", True),
    "sdar": FamilySpec("sdar", "SDARForCausalLM", "qwen3", "block_causal", False),
    # presets may name it (conf/checkpoint/llada-8b.yaml); its model.transformer.blocks.* layout has no table yet
    "llada": FamilySpec("llada", "LLaDAModelLM", None, "full", False),
}


@dataclass
class TransformerConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = False
    qk_norm: bool = False
    tie_embeddings: bool = True
    max_position_embeddings: int = 2048
    # Behaviour, not weights: how the model was trained to attend and read out.
    attention: str = "causal"
    block_size: int | None = None
    shift: bool = False
    family: str = "qwen2"
    mask_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}; set head_dim"
                )
            self.head_dim = self.hidden_size // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} must be a multiple of num_kv_heads {self.num_kv_heads}")
        if self.attention not in ATTENTION_MODES:
            raise ValueError(f"unknown attention mode {self.attention!r}; valid: {', '.join(ATTENTION_MODES)}")
        if self.family not in FAMILIES:
            raise ValueError(f"unknown model family {self.family!r}; valid: {', '.join(FAMILIES)}")
        if self.attention == "block_causal" and not self.block_size:
            raise ValueError("attention 'block_causal' needs block_size (e.g. 16 for the tiny target, 32 for SDAR)")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TransformerConfig:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown TransformerConfig keys {unknown}; valid: {sorted(names)}")
        return cls(**d)

    def num_parameters(self) -> int:
        """Parameter count implied by the shapes (embeddings counted once when tied)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (self.num_heads + 2 * self.num_kv_heads) + self.num_heads * d * h
        if self.qkv_bias:
            attn += d * (self.num_heads + 2 * self.num_kv_heads)
        if self.qk_norm:
            attn += 2 * d
        layer = attn + 3 * h * self.intermediate_size + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return self.num_layers * layer + emb + h
