"""The one transformer implementation: Llama / Qwen2 / Qwen3 family, every attention mode, KV cache.

RMSNorm, rotary position embeddings (configurable theta), grouped-query attention, SwiGLU MLP, optional q/k/v
bias (Qwen2), optional per-head q/k RMSNorm (Qwen3), tied or untied embeddings. Attention follows
``config.attention`` (``causal``, ``full``, ``prefix_causal``, ``block_causal``) unless a forward overrides it or
passes an explicit boolean mask (draft trees, packed windows); see ``masks.py`` for the rules.

Verifiers, diffusion drafters and block-diffusion targets are all this class; they differ only in config.
Checkpoints in Hugging Face format are read and written by ``checkpoint.py``.

Inference speed: ``attention.py`` picks the attention kernel of each forward; a static KV cache
(``kv_cache.py``) keeps a step's shapes fixed, and with the ``graphs`` engine every cached forward after the prefill
replays a CUDA graph (``graphs.py``); ``fuse_projections()`` turns q/k/v and gate/up into one matrix each (fewer,
larger matmuls; the state dict keeps the checkpoint's names).

    model = Transformer(cfg)
    logits = model(input_ids)                                  # [B, T, V]
    cache = KVCache.for_model(model, batch_size=B)
    logits = model(prompt_ids, attention_mask=pad_mask, cache=cache)   # prefill, left padding
    logits = model(next_ids, cache=cache)                              # one cached step
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from . import cpu_linear, cpu_ops
from .attention import attend
from .config import TransformerConfig
from .kv_cache import KVCache
from .masks import build_mask, default_positions


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fast = cpu_ops.rms_norm(x, self.weight, self.eps)  # one C call for a bf16 CPU forward, else None
        if fast is not None:
            return fast
        # Normalise in fp32 and cast back before the weight, as the reference implementations do (bf16 parity).
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rotary_tables(
    position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape ``[B, 1, T, head_dim]`` for integer positions ``[B, T]`` (computed in fp32)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=position_ids.device).float() / head_dim))
    freqs = position_ids[..., None].float() * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    fast = cpu_ops.rotary(x, cos, sin)  # bit for bit this function's bf16 result in one C call, else None
    if fast is not None:
        return fast
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        d, h, hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        self.num_heads, self.num_kv_heads, self.head_dim = h, hkv, d
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, hkv * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, hkv * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None

        self.qkv_proj: nn.Linear | None = None  # fuse(): q, k and v in one matrix (inference)

    def fuse(self) -> None:
        """One ``[q; k; v]`` matrix in place of three (no copy kept: the state dict splits it back on save)."""
        _fuse(self, "qkv_proj", ("q_proj", "k_proj", "v_proj"))

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, T, _ = x.shape
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split([h * d, hkv * d, hkv * d], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return q.view(B, T, h, d), k.view(B, T, hkv, d), v.view(B, T, hkv, d)

    def keys_values(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[B, Hkv, T, D]`` of ``x`` (rotated at ``cos``/``sin``) without queries or attention:
        the rows a DFlash drafter's context adds to every layer (``dflash.py``)."""
        B, T, _ = x.shape
        hkv, d = self.num_kv_heads, self.head_dim
        if self.qkv_proj is not None:  # the k and v rows of the fused matrix only: no queries for context rows
            q_rows = self.num_heads * d
            w, b = self.qkv_proj.weight[q_rows:], _rows(self.qkv_proj.bias, q_rows)
            k, v = cpu_linear.linear(x, w, b).split(hkv * d, dim=-1)  # F.linear, or the kernel as qkv_proj takes it
        else:
            k, v = self.k_proj(x), self.v_proj(x)
        k, v = k.view(B, T, hkv, d), v.view(B, T, hkv, d)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return apply_rotary(k.transpose(1, 2), cos, sin), v.transpose(1, 2)

    def forward(self, x, cos, sin, mask, is_causal, cache: KVCache | None, layer: int, context=None) -> torch.Tensor:
        """context: ``(k, v)`` rows ``[B, Hkv, C, D]`` placed before this forward's (and the cache's) keys; the
        mask's key axis then starts with them."""
        B, T, _ = x.shape
        q, k, v = self._project(x)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q.transpose(1, 2), cos, sin)
        k = apply_rotary(k.transpose(1, 2), cos, sin)
        v = v.transpose(1, 2)
        if cache is not None and getattr(cache, "per_row", False):  # a RowCache attends its rows itself
            out = cache.attend(layer, q, k, v)
        else:
            if cache is not None:
                k, v = cache.update(layer, k, v)
            if context is not None:
                k, v = torch.cat([context[0], k], dim=2), torch.cat([context[1], v], dim=2)
            out = attend(q, k, v, mask, is_causal)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


def _rows(bias: torch.Tensor | None, start: int) -> torch.Tensor | None:
    return None if bias is None else bias[start:]


class MLP(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up_proj: nn.Linear | None = None  # fuse(): gate and up in one matrix (inference)

    def fuse(self) -> None:
        _fuse(self, "gate_up_proj", ("gate_proj", "up_proj"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _fuse(module: nn.Module, fused_name: str, names: tuple[str, ...]) -> None:
    """Replace ``module``'s Linear children ``names`` (same input) by one Linear ``fused_name`` whose output is their
    concatenation; the state dict keeps (and a loaded one may give) the separate names. Idempotent."""
    if getattr(module, fused_name) is not None:
        return
    parts = [getattr(module, n) for n in names]
    w = parts[0].weight
    bias = parts[0].bias is not None
    fused = nn.Linear(w.shape[1], sum(p.out_features for p in parts), bias=bias, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([p.weight for p in parts]))
        if bias:
            fused.bias.copy_(torch.cat([p.bias for p in parts]))
    fused.requires_grad_(w.requires_grad)
    setattr(module, fused_name, fused)
    for n in names:
        delattr(module, n)
    module._fused = (fused_name, names, [p.out_features for p in parts])
    module._register_state_dict_hook(_split_fused)
    module._register_load_state_dict_pre_hook(_join_fused(module))


def _split_fused(module, state_dict, prefix, local_metadata) -> None:
    """State-dict hook of a fused module: the checkpoint's names (q_proj/k_proj/v_proj, gate_proj/up_proj) again,
    so saving, exporting and comparing a fused model sees what an unfused one has."""
    fused_name, names, sizes = module._fused
    for kind in ("weight", "bias"):
        t = state_dict.pop(f"{prefix}{fused_name}.{kind}", None)
        if t is None:
            continue
        for name, part in zip(names, t.split(sizes), strict=True):
            state_dict[f"{prefix}{name}.{kind}"] = part.clone()  # own storage: safetensors refuses shared tensors


def _join_fused(module):
    """Load-state-dict pre-hook of a fused module: a checkpoint's separate matrices are concatenated on the way in."""

    def hook(state_dict, prefix, *_args) -> None:
        fused_name, names, _ = module._fused
        for kind in ("weight", "bias"):
            keys = [f"{prefix}{name}.{kind}" for name in names]
            if all(k in state_dict for k in keys):
                state_dict[f"{prefix}{fused_name}.{kind}"] = torch.cat([state_dict.pop(k) for k in keys])

    return hook


class Block(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask, is_causal, cache, layer):
        x = x + self.attn(self.attn_norm(x), cos, sin, mask, is_causal, cache, layer)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    # The checkpoint kind this class is (``builder.CHECKPOINT_KINDS``, a preset's ``kind``): a model with its own
    # embedding and head. Stages find a drafter's kind by it, not by probing attributes.
    kind: ClassVar[str] = "transformer"

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.gradient_checkpointing = False
        # one device per layer when the model spans several (models/placement.py); None: all on one device
        self.layer_devices: list[torch.device] | None = None

    def init_weights(self, seed: int | None = None, std: float = 0.02) -> Transformer:
        """Fresh weights: normal(0, std) matrices, zero biases, unit norms. Deterministic for a seed."""
        return init_weights(self, seed, std)

    @property
    def output_weight(self) -> torch.Tensor:
        """``[V, hidden]`` read-out matrix (the embedding when tied); losses use it for chunked log-probs."""
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def hidden(
        self,
        input_ids: torch.Tensor,
        *,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        mode: str | None = None,
        prefix_len: torch.Tensor | int | None = None,
        attn_mask: torch.Tensor | None = None,
        graphed: bool = False,
        aux_layers: tuple[int, ...] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Final normalised hidden states ``[B, T, hidden]`` (and, with ``aux_layers``, the chosen layers' states).

        input_ids: ``[B, T]`` new tokens (after whatever ``cache`` holds).
        attention_mask: ``[B, T]`` 1 = real token, 0 = left padding (a ``[B, past+T]`` mask is accepted and
            its last T columns used: the cache already knows which of its slots are real).
        position_ids: ``[B, T]``; default counts real tokens, continuing after the cache.
        mode: attention mode for this forward (default ``config.attention``).
        prefix_len: ``prefix_causal`` only: position where the draft window starts (int or ``[B]``).
        attn_mask: explicit boolean mask ``[B, T, past+T]`` or ``[B, T, T]`` (True = may attend).
        graphed: replay a CUDA graph for this cache-less forward (a full-attention drafter's window on the ``graphs``
            engine; the caller keeps its shapes few). Cached forwards follow their cache's engine instead.
        aux_layers: layer ids whose residual stream is also returned, concatenated in the given order
            ``[B, T, len(ids) * hidden]`` (what a DFlash drafter is conditioned on). Id ``i`` is the stream entering
            layer ``i`` (0: the embeddings; ``num_layers``: the last layer's output before the final norm), the
            convention of vLLM and ``speculators``. Such forwards run eagerly (no CUDA graph).
        """
        if self.layer_devices is not None:  # placed: the inputs go where the embedding is, from wherever they are
            home = self.embed.weight.device
            input_ids, position_ids, attention_mask, attn_mask = (
                _to(t, home) for t in (input_ids, position_ids, attention_mask, attn_mask)
            )
            if isinstance(prefix_len, torch.Tensor):
                prefix_len = prefix_len.to(home)
        B, T = input_ids.shape
        valid = None
        if attention_mask is not None:
            valid = attention_mask[:, -T:].bool()
        if position_ids is None:
            start = cache.next_positions() if cache is not None and cache.length else None
            position_ids = default_positions(valid, B, T, start, input_ids.device)
        mask, is_causal = build_mask(
            mode or self.config.attention,
            position_ids,
            valid,
            cache,
            prefix_len=prefix_len,
            block_size=self.config.block_size,
            explicit=attn_mask,
        )
        if cache is not None:
            cache.begin(position_ids, valid)
        runner = None if aux_layers else _graph_runner(self, cache, graphed, mask)
        aux = None
        if runner is not None:
            x = runner.run(input_ids, position_ids, mask)
        elif aux_layers:
            x, aux = self.body(input_ids, position_ids, mask, is_causal, cache, aux_layers=tuple(aux_layers))
        else:
            x = self.body(input_ids, position_ids, mask, is_causal, cache)
        if cache is not None:
            cache.commit()
        return x if aux is None else (x, aux)

    def body(self, input_ids, position_ids, mask, is_causal, cache: KVCache | None, aux_layers: tuple[int, ...] = ()):
        """Embedding, layers and final norm of one forward whose mask and cache slots are prepared (``hidden``); the
        part a CUDA graph captures. With ``aux_layers``: ``(hidden, aux)`` (see ``hidden``)."""
        bad = [i for i in aux_layers if not 0 <= i <= self.config.num_layers]
        if bad:
            raise ValueError(f"aux layer ids {bad} are outside 0..{self.config.num_layers} (the model's layer count)")
        kept: dict[int, torch.Tensor] = {}
        x = self.embed(input_ids)
        cos, sin = rotary_tables(position_ids, self.config.head_dim, self.config.rope_theta, x.dtype)
        for i, layer in enumerate(self.layers):
            if i in aux_layers:
                kept[i] = x
            if self.layer_devices is not None and x.device != self.layer_devices[i]:  # the next run's device
                x, cos, sin, mask = (_to(t, self.layer_devices[i]) for t in (x, cos, sin, mask))
            if self.gradient_checkpointing and self.training and cache is None:
                x = checkpoint(layer, x, cos, sin, mask, is_causal, None, i, use_reentrant=False)
            else:
                x = layer(x, cos, sin, mask, is_causal, cache, i)
        out = self.norm(x.to(self.norm.weight.device))
        if not aux_layers:
            return out
        kept[self.config.num_layers] = x
        home = out.device
        return out, torch.cat([kept[i].to(home) for i in aux_layers], dim=-1)

    def fuse_projections(self) -> Transformer:
        """For inference: q/k/v and gate/up become one matrix each in every layer (two matmuls fewer per layer and
        no extra weights kept). ``state_dict`` still gives the checkpoint's names; do not train a fused model."""
        fuse_blocks(self.layers)
        return self

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # placed across devices, a tied read-out is the embedding on the first device. A 2D contiguous input: a
        # strided 3D slice (``h[:, -1:]``) sends bf16 F.linear on CPU through bmm with a copy of the whole weight
        # (49152 x 576 for SmolLM2: a second per prefill)
        flat = hidden.to(self.output_weight.device).reshape(-1, hidden.shape[-1]).contiguous()
        return cpu_linear.linear(flat, self.output_weight).view(*hidden.shape[:-1], -1)

    def forward(self, input_ids: torch.Tensor, *, logits_to_keep: int = 0, **kwargs) -> torch.Tensor:
        """Logits ``[B, T, V]`` (or ``[B, logits_to_keep, V]`` for the last positions only), on ``input_ids``'s
        device. kwargs: see hidden."""
        h = self.hidden(input_ids, **kwargs)
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        return self.logits(h).to(input_ids.device)


def fuse_blocks(layers) -> None:
    """Fuse q/k/v and gate/up of every ``Block`` in ``layers`` (``Transformer`` and DFlash drafters alike)."""
    for layer in layers:
        layer.attn.fuse()
        layer.mlp.fuse()


def init_weights(module: nn.Module, seed: int | None = None, std: float = 0.02):
    """``module`` with fresh weights: normal(0, std) matrices, zero biases, unit norms; deterministic for a seed
    (drawn on the CPU in parameter order, so every machine starts from the same weights)."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    for name, p in module.named_parameters():
        with torch.no_grad():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return module


def _graph_runner(model: Transformer, cache: KVCache | None, graphed: bool, mask):
    """The GraphRunner that replays this forward, or None for an eager forward. Graphed: a cached forward after the
    prefill (prompt lengths vary, so the prefill stays eager) on the ``graphs`` engine, and a cache-less forward the
    caller asks for (``graphed``); never under autograd or for a model placed across devices."""
    if torch.is_grad_enabled() or model.layer_devices is not None or mask is None:
        return None
    if cache is not None:
        if cache.engine != "graphs" or cache.length == 0:
            return None
    elif not (graphed and model.embed.weight.device.type == "cuda"):
        return None
    from .graphs import GraphRunner  # CUDA-only machinery, loaded on first use

    owner = cache if cache is not None else model  # the graphs live with the tensors they were recorded on
    if getattr(owner, "graphs", None) is None:
        owner.graphs = GraphRunner(model, cache)  # on a model: a plain attribute (not a submodule or buffer)
    return owner.graphs


def _to(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if t is None else t.to(device, non_blocking=True)
