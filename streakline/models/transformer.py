"""The one transformer implementation: Llama / Qwen2 / Qwen3 family, every attention mode, KV cache.

RMSNorm, rotary position embeddings (configurable theta), grouped-query attention, SwiGLU MLP, optional q/k/v
bias (Qwen2), optional per-head q/k RMSNorm (Qwen3), tied or untied embeddings. Attention follows
``config.attention`` (``causal``, ``full``, ``prefix_causal``, ``block_causal``) unless a forward overrides it or
passes an explicit boolean mask (draft trees, packed windows); see ``masks.py`` for the rules.

Verifiers, diffusion drafters and block-diffusion targets are all this class; they differ only in config.
Checkpoints in Hugging Face format are read and written by ``checkpoint.py``.

    model = Transformer(cfg)
    logits = model(input_ids)                                  # [B, T, V]
    cache = KVCache.for_model(model, batch_size=B)
    logits = model(prompt_ids, attention_mask=pad_mask, cache=cache)   # prefill, left padding
    logits = model(next_ids, cache=cache)                              # one cached step
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .config import TransformerConfig
from .kv_cache import KVCache
from .masks import build_mask, default_positions


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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

    def forward(self, x, cos, sin, mask, is_causal, cache: KVCache | None, layer: int) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q.transpose(1, 2), cos, sin)
        k = apply_rotary(k.transpose(1, 2), cos, sin)
        v = v.transpose(1, 2)
        if cache is not None:
            k, v = cache.update(layer, k, v)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=self.num_kv_heads != self.num_heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        for name, p in self.named_parameters():
            with torch.no_grad():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * std)
        return self

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
    ) -> torch.Tensor:
        """Final normalised hidden states ``[B, T, hidden]``.

        input_ids: ``[B, T]`` new tokens (after whatever ``cache`` holds).
        attention_mask: ``[B, T]`` 1 = real token, 0 = left padding (a ``[B, past+T]`` mask is accepted and
            its last T columns used: the cache already knows which of its slots are real).
        position_ids: ``[B, T]``; default counts real tokens, continuing after the cache.
        mode: attention mode for this forward (default ``config.attention``).
        prefix_len: ``prefix_causal`` only: position where the draft window starts (int or ``[B]``).
        attn_mask: explicit boolean mask ``[B, T, past+T]`` or ``[B, T, T]`` (True = may attend).
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
        x = self.embed(input_ids)
        cos, sin = rotary_tables(position_ids, self.config.head_dim, self.config.rope_theta, x.dtype)
        if cache is not None:
            cache.begin(position_ids, valid)
        for i, layer in enumerate(self.layers):
            if self.layer_devices is not None and x.device != self.layer_devices[i]:  # the next run's device
                x, cos, sin, mask = (_to(t, self.layer_devices[i]) for t in (x, cos, sin, mask))
            if self.gradient_checkpointing and self.training and cache is None:
                x = checkpoint(layer, x, cos, sin, mask, is_causal, None, i, use_reentrant=False)
            else:
                x = layer(x, cos, sin, mask, is_causal, cache, i)
        if cache is not None:
            cache.commit()
        return self.norm(x.to(self.norm.weight.device))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # placed across devices, a tied read-out is the embedding on the first device
        return F.linear(hidden.to(self.output_weight.device), self.output_weight)

    def forward(self, input_ids: torch.Tensor, *, logits_to_keep: int = 0, **kwargs) -> torch.Tensor:
        """Logits ``[B, T, V]`` (or ``[B, logits_to_keep, V]`` for the last positions only), on ``input_ids``'s
        device. kwargs: see hidden."""
        h = self.hidden(input_ids, **kwargs)
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        return self.logits(h).to(input_ids.device)


def _to(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if t is None else t.to(device, non_blocking=True)
