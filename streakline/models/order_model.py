"""SPOT's order model: which masked position of a block-diffusion target's block gets committed next.

``q_phi(position | hypothetical state, stale distribution)`` (docs/algorithms.md section 8). It reads, per block
position, only the *stale* top-k probabilities of the last real target forward and which positions are committed
(for real, or along a hypothetical path of drafted commits); never hidden states or token ids, so one checkpoint
serves any target and tokenizer with the same top-k.

    from streakline.models.order_model import OrderModel, OrderModelConfig, order_features
    model = OrderModel(OrderModelConfig())                                  # about 0.61M parameters
    logits = model(order_features(topk_probs, real, path, depth), eligible)  # [N, L], -inf where ineligible
    model.save(folder); model = OrderModel.load(folder)

Features (``F = 2k + 10``, k = top_k), per position of an ``[N, L]`` block:
  * ``k`` stale probabilities, in the target's rank order (rank 0 = the token the target would take), and
    their logs, ``log(max(p, 1e-6))`` (``LOG_FLOOR``), so missing / tiny probabilities stay finite;
  * 8 summary statistics: entropy of the top-k, ``-sum p log p`` over the k probabilities as they are (not
    renormalised); margin ``p[rank 0] - p[rank 1]``; tail mass ``1 - sum(top-k)`` (clamped at 0); max prob of
    the top-k; is-masked (masked in the hypothetical state: neither really committed nor on the path); relative
    position in the block ``i / (L - 1)``; fraction of the block still masked in the hypothetical state; depth
    along the path divided by ``DEPTH_SCALE`` = 8 (the paper's horizon H, so training depths lie in [0, 7/8]);
  * 2 path features: committed in the real state (the root); committed along the hypothetical path.

Features are standardised inside the model with a per-feature mean and standard deviation (buffers saved with
the weights; the trainer sets them from the training set with ``set_normalisation``, identity until then): the
probabilities differ by hundredths between positions while the clamped logs span [-13.8, 0], and without it a few
hundred steps stay further below the stale-confidence ranking (docs/spot.md has the numbers).

Architecture: standardisation + Linear(F -> d) + learned position embedding (``max_block`` slots) + pre-norm
TransformerEncoder (``layers`` x (d, ``heads``, FFN ``ffn``), GELU, dropout 0, final LayerNorm) + Linear(d -> 1).
Tests: ``python -m pytest tests/models/test_order_model.py``.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from torch import nn

from .checkpoint import CheckpointError

LOG_FLOOR = 1e-6  # clamp before log: stale probabilities of 0 (padding, fp16 underflow) stay finite
DEPTH_SCALE = 8.0  # depth feature = depth / 8
N_SUMMARY = 8
N_PATH = 2
FORMAT = "streakline-order-model"
FORMAT_VERSION = 1
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


@dataclass
class OrderModelConfig:
    top_k: int = 32  # stale probabilities per position (the features' width depends on it)
    d_model: int = 128
    layers: int = 3
    heads: int = 8
    ffn: int = 512
    max_block: int = 64  # learned position slots: the largest block size the model can serve
    # The draft-free decoder whose commit order it learnt (stage=spot records them; None: not recorded, not checked).
    # Not part of the architecture: SpotDrafter refuses to draft for another rule or threshold.
    rule: str | None = None
    threshold: float | None = None  # only for rule="threshold"

    @property
    def n_features(self) -> int:
        return 2 * self.top_k + N_SUMMARY + N_PATH


def order_features(
    topk_probs: torch.Tensor,
    real_committed: torch.Tensor,
    path_committed: torch.Tensor,
    depth: torch.Tensor,
    top_k: int | None = None,
) -> torch.Tensor:
    """Per-position features ``[N, L, 2k + 10]`` (layout in the module docstring).

    topk_probs ``[N, L, k']`` stale probabilities in rank order; real_committed / path_committed ``[N, L]`` bool;
    depth ``[N]`` number of commits along the hypothetical path. ``top_k``: pad (with probability 0) or cut the
    last axis to this width first, e.g. when the vocabulary is smaller than the model's k.
    """
    p = topk_probs.float()
    if top_k is not None and p.shape[-1] != top_k:
        p = p[..., :top_k] if p.shape[-1] > top_k else nn.functional.pad(p, (0, top_k - p.shape[-1]))
    N, L, k = p.shape
    if k < 2:
        raise ValueError(f"order features need at least 2 stale probabilities per position, got {k}")
    logp = p.clamp_min(LOG_FLOOR).log()
    real, path = real_committed.bool(), path_committed.bool()
    masked = ~(real | path)
    entropy = -(p * logp).sum(-1)
    margin = p[..., 0] - p[..., 1]
    tail = (1.0 - p.sum(-1)).clamp_min(0.0)
    top = p.max(-1).values
    rel = (torch.arange(L, device=p.device, dtype=p.dtype) / max(L - 1, 1)).expand(N, L)
    frac = masked.float().mean(-1, keepdim=True).expand(N, L)
    dep = (depth.to(p.dtype) / DEPTH_SCALE)[:, None].expand(N, L)
    summary = torch.stack([entropy, margin, tail, top, masked.float(), rel, frac, dep], dim=-1)
    return torch.cat([p, logp, summary, real.float()[..., None], path.float()[..., None]], dim=-1)


class OrderModel(nn.Module):
    """Scores every block position; ``forward`` returns logits ``[N, L]`` (softmax over eligible positions = q)."""

    def __init__(self, config: OrderModelConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.inp = nn.Linear(c.n_features, c.d_model)
        self.pos = nn.Embedding(c.max_block, c.d_model)
        layer = nn.TransformerEncoderLayer(
            c.d_model, c.heads, c.ffn, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        # Pre-norm layers (stabler from scratch) end with a LayerNorm; nested tensors only matter with padding masks.
        self.encoder = nn.TransformerEncoder(layer, c.layers, norm=nn.LayerNorm(c.d_model), enable_nested_tensor=False)
        self.out = nn.Linear(c.d_model, 1)
        nn.init.normal_(self.pos.weight, std=0.02)
        self.register_buffer("feature_mean", torch.zeros(c.n_features))
        self.register_buffer("feature_std", torch.ones(c.n_features))

    @torch.no_grad()
    def set_normalisation(self, features: torch.Tensor, floor: float = 1e-3) -> None:
        """Standardise with the mean and standard deviation of ``features`` ``[..., F]`` (e.g. a training sample);
        ``floor`` keeps a constant feature (a std of 0) from blowing up."""
        flat = features.reshape(-1, features.shape[-1]).double()
        self.feature_mean.copy_(flat.mean(0))
        self.feature_std.copy_(flat.std(0).clamp_min(floor))

    def forward(self, features: torch.Tensor, eligible: torch.Tensor) -> torch.Tensor:
        """features ``[N, L, F]`` (``order_features``), eligible ``[N, L]`` bool -> logits ``[N, L]``, ``-inf``
        where ineligible (a row with no eligible position is all ``-inf``; callers skip it)."""
        N, L, F = features.shape
        if F != self.config.n_features:
            raise ValueError(
                f"features have width {F}, the order model expects {self.config.n_features} (top_k={self.config.top_k})"
            )
        if L > self.config.max_block:
            raise ValueError(f"block size {L} exceeds the order model's max_block {self.config.max_block}")
        x = (features - self.feature_mean) / self.feature_std
        h = self.inp(x) + self.pos.weight[:L]
        logits = self.out(self.encoder(h)).squeeze(-1)
        return logits.masked_fill(~eligible.bool(), float("-inf"))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def save(self, folder: str | os.PathLike) -> Path:
        """Write ``config.json`` and ``model.safetensors`` into ``folder`` (created if missing)."""
        from safetensors.torch import save

        from streakline.artifacts import atomic_file, write_json_atomic

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}
        with atomic_file(folder / WEIGHTS_NAME, "wb") as f:
            f.write(save(state))
        meta = {"format": FORMAT, "version": FORMAT_VERSION, "config": asdict(self.config)}
        write_json_atomic(folder / CONFIG_NAME, meta)
        return folder

    @classmethod
    def load(cls, folder: str | os.PathLike, device: torch.device | str = "cpu") -> OrderModel:
        """The model saved in ``folder``; CheckpointError naming the fix when it is missing or damaged."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        folder = Path(folder)
        fix = "rerun `python launch.py stage=spot` (or point decoder.artifact at a folder it wrote)"
        try:
            meta = json.loads((folder / CONFIG_NAME).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise CheckpointError(f"{folder} holds no order model ({CONFIG_NAME} is missing); {fix}") from None
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{folder / CONFIG_NAME} cannot be read ({e}); {fix}") from e
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise CheckpointError(f"{folder / CONFIG_NAME} does not describe a streakline order model; {fix}")
        try:
            known = {f.name for f in fields(OrderModelConfig)}
            config = OrderModelConfig(**{k: v for k, v in meta["config"].items() if k in known})
            model = cls(config)
            state = load_file(str(folder / WEIGHTS_NAME))
            model.load_state_dict(state)
        except FileNotFoundError:
            raise CheckpointError(f"{folder} holds no order-model weights ({WEIGHTS_NAME} is missing); {fix}") from None
        except (KeyError, TypeError, RuntimeError, OSError, SafetensorError) as e:
            raise CheckpointError(f"the order model in {folder} is damaged ({type(e).__name__}: {e}); {fix}") from e
        return model.to(device).eval()
