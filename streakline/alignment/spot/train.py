"""Train SPOT's order model on trace examples and measure held-out next-commit accuracy against the baseline.

    from streakline.alignment.spot.train import SpotTrainConfig, evaluate, train_order_model
    model, metrics = train_order_model(train, heldout, OrderModelConfig(), SpotTrainConfig(steps=600))
    metrics["heldout"]["accuracy"], metrics["heldout"]["baseline_accuracy"], metrics["heldout"]["by_depth"]

Loss: cross-entropy of the label over the eligible positions (the order model's logits are -inf elsewhere).
Before the first step the model's feature standardisation is set from a sample of the training examples.
Optimiser: AdamW, linear warm-up over the first 5% of steps then cosine decay to 10% of ``lr``, gradient clipping
at 1. Batches are drawn with replacement by a generator seeded from ``seed``, and the model is initialised under
that seed too, so a run is deterministic on a given machine and thread count. ``device``: where the model trains
(the stage passes ``pipelines.common.roles.device()``); the model is initialised and standardised on the CPU, the
batch indices come from a CPU generator and the features are built on the CPU, and only tensors move, so a run
sees the same examples on every machine and the CPU results do not depend on this argument.
Metric: next-commit accuracy = how often the argmax over eligible positions is the label; the baseline is the
stale-confidence ranking (``data.confidence_baseline``). Both overall and per depth d.
Tests: ``python -m pytest tests/alignment/test_spot.py``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from streakline.models.order_model import OrderModel, OrderModelConfig, order_features

from .data import SpotExamples, confidence_baseline


@dataclass
class SpotTrainConfig:
    steps: int = 600
    batch_size: int = 64
    lr: float = 1.0e-3
    weight_decay: float = 0.01
    seed: int = 0
    eval_batch: int = 1024  # examples per evaluation forward
    norm_examples: int = 4096  # training examples the feature mean / std are computed from


def _features(model: OrderModel, data: SpotExamples, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Features and eligibility of ``data[index]``, built where the examples are (the CPU), on the model's device."""
    feats = order_features(
        data.stale(index), data.real[index], data.path[index], data.depth[index], top_k=model.config.top_k
    )
    where = model.feature_mean.device
    return feats.to(where), data.eligible[index].to(where)


def _lr(step: int, steps: int, lr: float) -> float:
    warm = max(1, steps // 20)
    if step < warm:
        return lr * (step + 1) / warm
    progress = (step - warm) / max(1, steps - warm)
    return lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


@torch.no_grad()
def predict(model: OrderModel, data: SpotExamples, batch: int = 1024) -> torch.Tensor:
    """``[N]`` the model's argmax eligible position per example."""
    model.eval()
    out = []
    for begin in range(0, len(data), batch):
        index = torch.arange(begin, min(begin + batch, len(data)))
        out.append(model(*_features(model, data, index)).argmax(dim=1).cpu())
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


def evaluate(model: OrderModel, data: SpotExamples, batch: int = 1024) -> dict[str, Any]:
    """Next-commit accuracy of the model and of the stale-confidence baseline, overall and per depth."""
    if len(data) == 0:
        raise ValueError("no examples to evaluate on")
    hit = predict(model, data, batch) == data.label
    base = confidence_baseline(data) == data.label
    by_depth = {}
    for d in sorted(set(data.depth.tolist())):
        sel = data.depth == d
        by_depth[str(d)] = {
            "examples": int(sel.sum()),
            "accuracy": float(hit[sel].float().mean()),
            "baseline_accuracy": float(base[sel].float().mean()),
        }
    return {
        "examples": len(data),
        "accuracy": float(hit.float().mean()),
        "baseline_accuracy": float(base.float().mean()),
        "by_depth": by_depth,
    }


def train_order_model(
    train: SpotExamples,
    heldout: SpotExamples | None,
    model_cfg: OrderModelConfig,
    cfg: SpotTrainConfig,
    *,
    progress: bool = True,
    device: str | torch.device = "cpu",
) -> tuple[OrderModel, dict[str, Any]]:
    """Fit a fresh order model on ``train``; returns it (in eval mode, on ``device``) and metrics: final training
    loss, seconds, parameter count, and held-out accuracy vs baseline (``heldout`` key; None without held-out
    examples)."""
    if len(train) == 0:
        raise ValueError("no training examples")
    if cfg.steps < 1 or cfg.batch_size < 1:
        raise ValueError(f"steps and batch_size must be >= 1, got {cfg.steps} and {cfg.batch_size}")
    if train.topk_probs.shape[1] > model_cfg.max_block:
        raise ValueError(f"block size {train.topk_probs.shape[1]} exceeds the order model's max_block")
    started = time.perf_counter()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = OrderModel(model_cfg)
    # Standardise the features with statistics of (an evenly spaced sample of) the training examples.
    sample = torch.linspace(0, len(train) - 1, min(len(train), cfg.norm_examples)).long()
    model.set_normalisation(_features(model, train, sample)[0])
    model.to(device).train()  # initialised and standardised on the CPU: the same start on every machine
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(cfg.seed)  # on the CPU: the same batches on every machine
    bar = tqdm(range(cfg.steps), desc="order model", unit="step", disable=not progress, dynamic_ncols=True)
    ema = None
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = _lr(step, cfg.steps, cfg.lr)
        index = torch.randint(0, len(train), (cfg.batch_size,), generator=gen)
        logits = model(*_features(model, train, index))
        loss = torch.nn.functional.cross_entropy(logits, train.label[index].to(logits.device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        value = loss.detach().item()
        ema = value if ema is None else 0.95 * ema + 0.05 * value
        if step % 10 == 0 or step == cfg.steps - 1:
            bar.set_postfix(loss=f"{ema:.3f}")
    bar.close()
    model.eval()
    metrics: dict[str, Any] = {
        "train_loss": ema,
        "train_examples": len(train),
        "parameters": model.num_parameters(),
        "train_seconds": time.perf_counter() - started,
        "heldout": evaluate(model, heldout, cfg.eval_batch) if heldout is not None and len(heldout) else None,
    }
    return model, metrics
