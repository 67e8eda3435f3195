"""The real shapes of every role, from the project's own builder on the ``meta`` device: no weights, no GPU.

A role's architecture comes from, in order: its preset's ``arch`` block (the tiny worlds, DFlash presets), the
``config.json`` of its ``path`` or of its ``hub_id`` when that is in the local Hugging Face cache, or
:data:`KNOWN_SHAPES`, the published ``config.json`` shapes of the hub checkpoints the shipped presets name (so a
laptop with none of them downloaded still plans at their sizes). An imported preset (``source``) is looked up by its
file, or cut from another role's shapes (``source.from_role`` with ``source.layers``). The preset, with that
``arch`` and no weight source, then goes through the builder's own steps inside ``torch.device("meta")``: its
config (``builder.arch_config``, or ``builder.dflash_config`` for a DFlash drafter) and the model class its kind
registers (``builder.CHECKPOINT_KINDS[checkpoint_kind(preset)]``), which is what ``models.build`` makes of a preset
without weights, less the seeded random fill that follows (on the meta device it holds nothing and costs seconds
at 72B). :class:`ModelShape` reads what was built: parameter count, the largest module (what ZeRO-3 gathers at once)
and the dimensions the activation and KV-cache formulas need. Shapes are kept per preset for the process.

    shape = role_shape(cfg, "drafter")         # ModelShape(params=7_615_616_512, ...) for model=diffucoder

Tests: ``python -m pytest tests/planning -q``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from streakline.config import ConfigError
from streakline.models.builder import CHECKPOINT_KINDS, DTYPES, arch_config, checkpoint_kind, dflash_config, locate
from streakline.models.checkpoint import CheckpointError, read_config
from streakline.models.config import SHAPE_FIELDS
from streakline.models.dflash import DFlashModel
from streakline.models.meta import on_meta

_QWEN25_7B = dict(  # Qwen2.5-7B: the shapes of Dream-v0 and DiffuCoder-7B (Dream architecture from Qwen2.5-Coder-7B)
    vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28, num_kv_heads=4,
    qkv_bias=True, tie_embeddings=False,
)  # fmt: skip
_QWEN3_8B = dict(  # Qwen3-8B, and SDAR-8B, which is built from it
    vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32, num_kv_heads=8,
    head_dim=128, qk_norm=True, tie_embeddings=False,
)  # fmt: skip
_LLAMA2_7B = dict(
    vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32, num_kv_heads=32,
    tie_embeddings=False,
)  # fmt: skip

# hub id (or an imported preset's source file) -> ArchConfig fields, as the checkpoint's config.json gives them.
# Only what fixes tensor shapes: rope_theta, norm eps and positions change values, not sizes.
KNOWN_SHAPES: dict[str, dict[str, Any]] = {
    "Qwen/Qwen2.5-14B-Instruct": dict(
        _QWEN25_7B, hidden_size=5120, intermediate_size=13824, num_layers=48, num_heads=40, num_kv_heads=8
    ),
    "Qwen/Qwen2.5-72B-Instruct": dict(
        _QWEN25_7B, hidden_size=8192, intermediate_size=29568, num_layers=80, num_heads=64, num_kv_heads=8
    ),
    "Qwen/Qwen3-8B": _QWEN3_8B,
    "JetLM/SDAR-8B-Chat-b32": _QWEN3_8B,
    "apple/DiffuCoder-7B-Instruct": _QWEN25_7B,
    "Dream-org/Dream-v0-Instruct-7B": _QWEN25_7B,
    "diffusionfamily/diffullama": _LLAMA2_7B,
    "meta-llama/Llama-2-13b-chat-hf": dict(
        _LLAMA2_7B, hidden_size=5120, intermediate_size=13824, num_layers=40, num_heads=40, num_kv_heads=40
    ),
    "meta-llama/Llama-2-70b-chat-hf": dict(
        _LLAMA2_7B, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64, num_kv_heads=8
    ),
    # LLaDA's config.json says d_model / mlp_hidden_size / n_layers; these are the same numbers in our names
    "GSAI-ML/LLaDA-8B-Instruct": dict(
        vocab_size=126464,
        hidden_size=4096,
        intermediate_size=12288,
        num_layers=32,
        num_heads=32,
        num_kv_heads=32,
        tie_embeddings=False,
    ),  # fmt: skip
    "SmolLM2-135M-Instruct.Q4_1.gguf": dict(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        tie_embeddings=True,
    ),  # fmt: skip
}
_ARCH_FIELDS = ("vocab_size", *SHAPE_FIELDS)


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs of one built model. ``params``: every parameter it owns (a tied matrix once; a DFlash
    drafter's exclude the verifier's embedding and head it borrows); ``largest_module``: the most parameters one
    module holds itself (DeepSpeed's ``largest_layer_params``: what ZeRO-3 gathers at once); ``embedding``: the
    embedding and read-out parameters (they see no per-token matmul in the body)."""

    role: str
    name: str
    kind: str  # "transformer" or "dflash"
    params: int
    largest_module: int
    embedding: int
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    dtype_bytes: int
    feature_size: int = 0  # a DFlash drafter: width of the verifier features it reads (ids x verifier hidden)
    lora_params: int = 0  # trainable adapter parameters when LoRA targets its projections (set by with_lora)

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def body(self) -> int:
        """Parameters applied to every token (the layers), as opposed to a lookup or a read-out at few positions."""
        return self.params - self.embedding

    def with_lora(self, r: int, targets: list[str] | tuple[str, ...]) -> ModelShape:
        """This shape with rank-``r`` adapters on the named projections of every layer (``trainer.lora``)."""
        width = {
            "q_proj": (self.hidden, self.q_dim), "k_proj": (self.hidden, self.kv_dim),
            "v_proj": (self.hidden, self.kv_dim), "o_proj": (self.q_dim, self.hidden),
            "gate_proj": (self.hidden, self.intermediate), "up_proj": (self.hidden, self.intermediate),
            "down_proj": (self.intermediate, self.hidden),
        }  # fmt: skip
        per_layer = sum(r * sum(width[t]) for t in targets if t in width)
        return replace(self, lora_params=per_layer * self.layers)


def _plain(node: Any) -> dict[str, Any]:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)


def role_arch(cfg: DictConfig, role: str) -> dict[str, Any]:
    """ArchConfig fields of ``model.<role>``: its ``arch``, its folder's config.json, or :data:`KNOWN_SHAPES`.
    ConfigError naming the fix when none of them knows the shapes."""
    node = cfg.model[role]
    if node.arch is not None:
        return {k: v for k, v in _plain(node.arch).items() if v is not None}
    source = node.source
    if source is not None and source.from_role:
        arch = role_arch(cfg, source.from_role)
        return {**arch, "num_layers": source.layers} if source.layers else arch
    folder = None
    if node.path or node.hub_id:
        try:
            folder = locate(node, role)
        except CheckpointError:
            if node.path:  # a path the user gave must exist; a hub id may simply not be downloaded
                raise
    if folder is not None:
        config = read_config(folder, node.family)
        return {k: getattr(config, k) for k in _ARCH_FIELDS}
    key = node.hub_id or (source.file if source is not None else None)
    if key in KNOWN_SHAPES:
        return dict(KNOWN_SHAPES[key])
    raise ConfigError(
        f"model.{role} ({node.name}): its shapes are unknown here ({key or 'no hub_id'} is not in the local Hugging "
        f"Face cache nor in planning.shapes.KNOWN_SHAPES); set model.{role}.path to a folder holding its config.json"
    )


def meta_preset(cfg: DictConfig, role: str) -> dict[str, Any]:
    """``model.<role>`` as a from-scratch preset: its shapes as an ``arch`` block and no weight source. Placement
    (``devices``) is the planner's to count, not the builder's to perform."""
    node = _plain(cfg.model[role])
    node.update(arch=role_arch(cfg, role), path=None, hub_id=None, source=None, devices=None)
    return node


def build_meta(cfg: DictConfig, role: str) -> torch.nn.Module:
    """``model.<role>`` built on the meta device at its real shapes, as the builder builds it (no memory used)."""
    return _build_meta(json.dumps(meta_preset(cfg, role), sort_keys=True), role)


@lru_cache(maxsize=64)
def _build_meta(preset_json: str, role: str) -> torch.nn.Module:
    node = json.loads(preset_json)
    model_class = CHECKPOINT_KINDS[checkpoint_kind(node, role)]
    with on_meta():
        if model_class is DFlashModel:
            # the mask token's id fixes no shape; the builder needs one only to fill blocks at decode time
            model = DFlashModel(dflash_config(node, role, mask_token_id=0))
        else:
            model = model_class(arch_config(node))
    return model.to(dtype=DTYPES[node["dtype"]])


def shape_of(model: torch.nn.Module, role: str, name: str) -> ModelShape:
    """The :class:`ModelShape` of a built model (meta or real)."""
    c = model.config
    params = {id(p): p.numel() for p in model.parameters()}  # a tied matrix counts once
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    if isinstance(model, DFlashModel):
        embedding, feature = 0, model.dflash.feature_size
    else:
        embedding = model.embed.weight.numel() + (0 if model.lm_head is None else model.lm_head.weight.numel())
        feature = 0
    return ModelShape(
        role=role,
        name=name,
        kind=model.kind,
        params=sum(params.values()),
        largest_module=largest,
        embedding=embedding,
        layers=c.num_layers,
        hidden=c.hidden_size,
        heads=c.num_heads,
        kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        intermediate=c.intermediate_size,
        vocab=c.vocab_size,
        dtype_bytes=next(model.parameters()).element_size(),
        feature_size=feature,
    )


def role_shape(cfg: DictConfig, role: str) -> ModelShape:
    """``model.<role>``'s :class:`ModelShape`, built on the meta device (see the module docstring)."""
    return shape_of(build_meta(cfg, role), role, cfg.model[role].name)
