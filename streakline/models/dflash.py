"""DFlash drafters: a few transformer layers that draft a whole block in one forward, conditioned on the verifier.

DFlash (arXiv 2602.06036; served by vLLM, SGLang and TensorRT-LLM; trained by ``speculators`` and SpecForge) is a
block-diffusion drafter that owns no embedding and no LM head: it reads the *verifier's* hidden states at a few
chosen layers and drafts with the verifier's own embedding and head (frozen, shared, never copied here).

    features  the verifier's residual streams at ``target_layer_ids`` for every context token, concatenated
              ``[T, L * H_target]`` (``Transformer.hidden(aux_layers=...)``), then ``fc`` (no bias) and RMSNorm:
              one context row per token, ``[T, H]``, the same for every draft layer
    block     ``[x_p, MASK x (B - 1)]`` at positions ``p .. p + B - 1``: ``x_p`` is the newest token, whose
              verifier state is not in the context yet (at decode time the bonus token); embedded by the verifier
    layers    Qwen3-style (pre-norm, q/k RMSNorm, SwiGLU). In every layer the context rows pass through that
              layer's ``k_proj``/``k_norm``/``v_proj`` and are placed before the block's own keys and values; only
              the block has queries. A block query sees every context row before ``p`` and the whole block
              (bidirectional)
    output    final norm, the verifier's head; slot ``k`` (1 .. B - 1) is the draft for position ``p + k``

Layer ids follow vLLM/``speculators``: id ``i`` is the stream *entering* verifier layer ``i`` (the reference code of
the paper's authors numbers them one lower).

    cfg = DFlashConfig(layers=TransformerConfig(...), target_layer_ids=(1, 3), block_size=8, mask_token_id=5)
    drafter = DFlashModel(cfg).init_weights(seed=0)
    drafter.share(verifier)                          # the verifier's embedding and head, not copied
    h, aux = verifier.hidden(ids, aux_layers=cfg.target_layer_ids)
    logits = drafter(block_ids, block_pos, features=aux, feature_pos=pos, attn_mask=mask)   # training, packed
    cache = KVCache.for_model(drafter, B, capacity)  # decoding: context rows are cached per layer
    drafter.add_context(aux, cache, valid)           # rows of newly verified tokens
    logits = drafter.draft(block_ids, cache)         # one block after the cached context

The checkpoint layout (``save_dflash``/``load_dflash``) is the ``speculators`` one, so an export is served by
``vllm serve <folder>`` and a published DFlash drafter can start a streak distillation (``docs/dflash.md``).
Tests: ``python -m pytest tests/models/test_dflash.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from . import cpu_linear
from .config import TransformerConfig
from .draft_vocab import DraftVocab
from .kv_cache import KVCache
from .masks import build_mask, default_positions
from .transformer import Block, RMSNorm, fuse_blocks, init_weights, rotary_tables


@dataclass
class DFlashConfig:
    """A DFlash drafter: its layers' shapes (``layers``: hidden size, heads, vocabulary = the verifier's), which
    verifier layers it reads, the block it drafts and the mask token that fills the block."""

    layers: TransformerConfig
    target_layer_ids: tuple[int, ...]
    block_size: int
    mask_token_id: int
    target_hidden_size: int | None = None  # None: the drafter's hidden size
    verifier: str | None = None  # the verifier's name or path, recorded in exports
    # N < V: the drafter predicts over N target tokens with a head of its own (``use_vocab``; ``draft_vocab.py``)
    draft_vocab_size: int | None = None

    def __post_init__(self) -> None:
        self.target_layer_ids = tuple(int(i) for i in self.target_layer_ids)
        if not self.target_layer_ids:
            raise ValueError("a DFlash drafter reads at least one verifier layer (target_layer_ids is empty)")
        if self.block_size < 2:
            raise ValueError(
                f"a DFlash block holds the newest token and at least one mask; block_size={self.block_size}"
            )
        if self.target_hidden_size is None:
            self.target_hidden_size = self.layers.hidden_size
        if self.draft_vocab_size == self.layers.vocab_size:
            self.draft_vocab_size = None  # the whole vocabulary: the verifier's own head
        if self.draft_vocab_size is not None and not 0 < self.draft_vocab_size < self.layers.vocab_size:
            raise ValueError(
                f"draft_vocab_size={self.draft_vocab_size} must lie in 1 .. {self.layers.vocab_size} (the vocabulary)"
            )

    @property
    def feature_size(self) -> int:
        return len(self.target_layer_ids) * self.target_hidden_size


class DFlashLayer(Block):
    """One draft layer: the transformer's block (same parts and names), with the context's keys and values in front
    of the block's own."""

    def forward(self, x, cos, sin, mask, cache, layer, context=None):
        x = x + self.attn(self.attn_norm(x), cos, sin, mask, False, cache, layer, context=context)
        return x + self.mlp(self.mlp_norm(x))


class DFlashModel(nn.Module):
    """The trainable part of a DFlash drafter (``fc``, ``hidden_norm``, the layers, ``norm``); the embedding and
    the head are the verifier's (``share``)."""

    kind: ClassVar[str] = "dflash"  # its checkpoint kind (``builder.CHECKPOINT_KINDS``, a preset's ``kind``)

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.dflash = cfg
        self.config = cfg.layers  # the shapes a KVCache and the attention code read
        h = cfg.layers.hidden_size
        self.fc = nn.Linear(cfg.feature_size, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.layers.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg.layers) for _ in range(cfg.layers.num_layers))
        self.norm = RMSNorm(h, cfg.layers.rms_norm_eps)
        self.layer_devices = None  # never placed across devices: a few layers
        self._shared: tuple[nn.Embedding, torch.Tensor] | None = None
        # A draft vocabulary (cfg.draft_vocab_size): its own head of N rows, frozen, and the target ids of its rows
        # (not a parameter: ``dflash_checkpoint`` stores them as speculators' t2d/d2t maps).
        self.draft_vocab: DraftVocab | None = None
        self.lm_head: nn.Linear | None = None
        if cfg.draft_vocab_size is not None:
            self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False).requires_grad_(False)

    # -------------------------------------------------------------------------------------------- sharing
    def share(self, verifier) -> DFlashModel:
        """Draft with ``verifier``'s embedding and read-out (held by reference, not registered: never trained,
        saved or copied with this model). Checks that the shapes fit."""
        v = verifier.config
        if v.vocab_size != self.config.vocab_size:
            raise ValueError(
                f"the DFlash drafter's vocabulary ({self.config.vocab_size}) is not the verifier's ({v.vocab_size}): "
                "a DFlash drafter drafts with the verifier's own head; export it for this verifier"
            )
        if v.hidden_size != self.config.hidden_size or v.hidden_size != self.dflash.target_hidden_size:
            raise ValueError(
                f"the DFlash drafter has hidden size {self.config.hidden_size} (reads {self.dflash.target_hidden_size}"
                f") but the verifier's is {v.hidden_size}: it shares the verifier's embedding and head"
            )
        bad = [i for i in self.dflash.target_layer_ids if not 0 <= i <= v.num_layers]
        if bad:
            raise ValueError(f"the DFlash drafter reads verifier layers {bad}; the verifier has {v.num_layers} layers")
        self._shared = (verifier.embed, verifier.output_weight)
        return self

    def use_vocab(self, vocab: DraftVocab) -> DFlashModel:
        """Draft over ``vocab``'s N target tokens, with a head of the shared verifier head's rows ``vocab.ids``
        (``share`` first), frozen. Tokens outside ``vocab`` get no logit: ``logits`` has N columns,
        ``target_logits`` gives them back over the whole vocabulary with -inf elsewhere, so they are never drafted.
        (A checkpoint's own head is loaded by ``dflash_checkpoint.load_dflash``.)"""
        if vocab.vocab_size != self.config.vocab_size:
            V = self.config.vocab_size
            raise ValueError(f"a draft vocabulary over {vocab.vocab_size} tokens for a drafter of {V}")
        ref = self.fc.weight
        self.lm_head = nn.Linear(self.config.hidden_size, vocab.size, bias=False, device=ref.device, dtype=ref.dtype)
        with torch.no_grad():
            self.lm_head.weight.copy_(vocab.head(self.output_weight))
        self.lm_head.requires_grad_(False)  # the verifier's rows: frozen, as the whole head is
        self.draft_vocab, self.dflash.draft_vocab_size = vocab, vocab.size
        return self

    def target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` ``[..., N]`` of a drafter with a draft vocabulary over the whole vocabulary ``[..., V]``: -inf
        at every token outside it (probability 0: never drafted, which every acceptance rule handles losslessly).
        The identity without one."""
        if self.draft_vocab is None:
            return logits
        ids = self.draft_vocab.ids.to(logits.device).expand(*logits.shape[:-1], -1)
        full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        return full.scatter_(-1, ids, logits)

    @property
    def embed(self) -> nn.Embedding:
        if self._shared is None:
            raise RuntimeError("a DFlash drafter drafts with the verifier's embedding: call drafter.share(verifier)")
        return self._shared[0]

    @property
    def output_weight(self) -> torch.Tensor:
        if self._shared is None:
            raise RuntimeError("a DFlash drafter drafts with the verifier's head: call drafter.share(verifier)")
        return self._shared[1]

    def init_weights(self, seed: int | None = None, std: float = 0.02) -> DFlashModel:
        return init_weights(self, seed, std)

    def fuse_projections(self) -> DFlashModel:
        """For inference, as ``Transformer.fuse_projections``: q/k/v and gate/up one matrix each in every layer (the
        context rows then use only the k/v rows). Do not train a fused model."""
        fuse_blocks(self.layers)
        return self

    # -------------------------------------------------------------------------------------------- forwards
    def context_rows(self, features: torch.Tensor) -> torch.Tensor:
        """``[B, T, H]`` context rows of the verifier features ``[B, T, L * H_target]``."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., V]`` over the verifier's head, or ``[..., N]`` over a draft vocabulary's (``use_vocab``)."""
        weight = self.output_weight if self.lm_head is None else self.lm_head.weight
        return cpu_linear.linear(hidden, weight)  # F.linear but for a CPU decode's few rows (cpu_linear.py)

    def _rotary(self, pos: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary_tables(pos, self.config.head_dim, self.config.rope_theta, dtype)

    def hidden(
        self,
        block_ids: torch.Tensor,
        block_pos: torch.Tensor,
        *,
        features: torch.Tensor | None = None,
        feature_pos: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final normalised hidden states ``[B, Q, H]`` of the block rows ``block_ids`` ``[B, Q]`` (any number of
        blocks packed in one row) at positions ``block_pos``, after the context ``features`` ``[B, C, F]`` at
        ``feature_pos``. ``attn_mask`` ``[B, Q, C + Q]`` (True = may attend; keys are the C context rows, then the
        Q block rows); None: every row sees the whole context and every block row (one block)."""
        x = self.embed(block_ids)
        cos, sin = self._rotary(block_pos, x.dtype)
        context = None
        if features is not None:
            ctx = self.context_rows(features)
            cos_c, sin_c = self._rotary(feature_pos, x.dtype)
        mask = None if attn_mask is None else attn_mask[:, None]
        for i, layer in enumerate(self.layers):
            if features is not None:
                context = layer.attn.keys_values(ctx, cos_c, sin_c)
            x = layer(x, cos, sin, mask, None, i, context=context)
        return self.norm(x)

    def forward(self, block_ids: torch.Tensor, block_pos: torch.Tensor, **kwargs) -> torch.Tensor:
        """Logits ``[B, Q, V]`` over the verifier's vocabulary; kwargs: see ``hidden``."""
        return self.logits(self.hidden(block_ids, block_pos, **kwargs))

    # -------------------------------------------------------------------------------------------- decoding
    def add_context(self, features: torch.Tensor, cache: KVCache, valid: torch.Tensor | None = None) -> None:
        """Append the context rows of ``features`` ``[B, T, F]`` (right-aligned, ``valid`` marks real ones; None:
        all) to ``cache``: each layer's keys and values, at the positions that continue each row's context."""
        B, T, _ = features.shape
        if T == 0:
            return
        start = cache.next_positions() if cache.length else None
        pos = default_positions(valid, B, T, start, features.device)
        ctx = self.context_rows(features)
        cos, sin = self._rotary(pos, ctx.dtype)
        cache.begin(pos, valid)
        for i, layer in enumerate(self.layers):
            k, v = layer.attn.keys_values(ctx, cos, sin)
            cache.update(i, k, v)
        cache.commit()

    def draft(self, block_ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Logits ``[B, Q, V]`` of one block ``[B, Q]`` placed right after each row's cached context (every
        block row sees the whole context and the whole block); the block never stays in the cache."""
        B, Q = block_ids.shape
        start = cache.next_positions()
        pos = start[:, None] + torch.arange(Q, device=block_ids.device)
        mask, _ = build_mask("full", pos, None, cache)
        x = self.embed(block_ids)
        cos, sin = self._rotary(pos, x.dtype)
        cache.begin(pos, None)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, cache, i)
        cache.commit()
        cache.crop(cache.length - Q)
        return self.logits(self.norm(x))


def block_inputs(last_token: torch.Tensor, block_size: int, mask_token_id: int) -> torch.Tensor:
    """``[B, block_size]`` block ``[x_p, MASK x (block_size - 1)]`` for the newest tokens ``last_token`` ``[B]``."""
    block = torch.full((last_token.shape[0], block_size), mask_token_id, dtype=torch.long, device=last_token.device)
    block[:, 0] = last_token
    return block


def packed_blocks(
    ids: torch.Tensor,
    anchors: torch.Tensor,
    block_size: int,
    mask_token_id: int,
    context_valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Many blocks in one forward (training): for each row of ``ids`` ``[B, T]`` and its ``anchors`` ``[B, n]``
    (block starts p: the block is ``[ids[p], MASK x (block_size - 1)]``), returns the packed block ids and positions
    ``[B, n * block_size]`` and the mask ``[B, n * block_size, T + n * block_size]``: a row of block j sees the
    context rows before its anchor (where ``context_valid``, when given) and the rows of block j, nothing else. The
    context rows are the verifier features of ``ids`` at positions ``0 .. T - 1``. Equal, block by block, to one
    forward per block with only the context before its anchor (``tests/models/test_dflash.py``)."""
    B, n = anchors.shape
    L = block_size
    device = ids.device
    offsets = torch.arange(L, device=device)
    block_pos = (anchors[:, :, None] + offsets).reshape(B, n * L)
    block_ids = torch.full((B, n, L), mask_token_id, dtype=torch.long, device=device)
    block_ids[:, :, 0] = ids.gather(1, anchors)
    T = ids.shape[1]
    sees_context = torch.arange(T, device=device)[None, None, :] < anchors[:, :, None]  # [B, n, T]
    if context_valid is not None:
        sees_context = sees_context & context_valid[:, None, :].bool()
    sees_context = sees_context[:, :, None, :].expand(B, n, L, T).reshape(B, n * L, T)
    block_of = torch.arange(n * L, device=device) // L
    own_block = (block_of[:, None] == block_of[None, :]).expand(B, -1, -1)
    return block_ids.view(B, n * L), block_pos, torch.cat([sees_context, own_block], dim=-1)
