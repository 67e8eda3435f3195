"""The model layer: one transformer core, its KV cache, Hugging Face checkpoint import/export, tokenizers.

    from streakline.models import Transformer, TransformerConfig, KVCache, load_pretrained, save_pretrained, export_like

Knows nothing about stages; ``build(preset)`` (``builder.py``) turns a checkpoint preset into a model.
"""

from .builder import CHECKPOINT_KINDS, build, checkpoint_kind, dflash_config, is_dflash, locate
from .checkpoint import (
    CheckpointError,
    load_pretrained,
    read_config,
    save_pretrained,
    transformers_max_diff,
    weight_names,
)
from .config import ATTENTION_MODES, FAMILIES, FamilySpec, TransformerConfig
from .export import export_like
from .kv_cache import KVCache
from .transformer import Transformer

__all__ = [
    "ATTENTION_MODES",
    "CHECKPOINT_KINDS",
    "FAMILIES",
    "CheckpointError",
    "FamilySpec",
    "KVCache",
    "Transformer",
    "TransformerConfig",
    "build",
    "checkpoint_kind",
    "dflash_config",
    "export_like",
    "is_dflash",
    "locate",
    "load_pretrained",
    "read_config",
    "save_pretrained",
    "transformers_max_diff",
    "weight_names",
]
