"""Training from scratch for the models of a world this project builds (``stage=bootstrap``).

Three objectives, one loop:
    causal_lm_loss         the verifier: next-token cross-entropy
    mdm_window_loss        the diffusion drafter: masked-diffusion CE on draft windows after clean prefixes,
                           many windows packed into one forward (``mdm``; docs/algorithms.md sections 1, 4 and 6)
    block_diffusion_loss   the block-diffusion target: every block noised and denoised from the clean earlier
                           blocks, noisy and clean halves in one forward (section 7)

``pretrain`` runs AdamW with linear warmup and cosine decay, gradient clipping, a progress bar, a held-out
evaluation at step 0, every ``eval_every`` steps and at the end, and appends every record to a JSONL file.
The distillation trainer (DeepSpeed, LoRA, resume) is a separate, larger thing; this loop is for tiny models on
one process.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from streakline.models import Transformer

from .blocks import block_diffusion_input, noise_blocks
from .windows import pack_windows

MDM_EPS = 1e-3  # smallest mask rate: keeps the 1/t weight bounded


def causal_lm_loss(
    model: Transformer, ids: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean next-token cross-entropy of ``ids`` ``[B, T]`` and next-token accuracy."""
    logits = model(ids[:, :-1]).float()
    targets = ids[:, 1:]
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    return loss, (logits.argmax(-1) == targets).float().mean()


def window_noise(
    shape: tuple[int, int, int], generator: torch.Generator | None, full: bool = False, full_share: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-window mask rate ``t ~ U(eps, 1)`` (``[B, K, 1]``) and which slots are masked (``[B, K, W]``);
    at least one masked slot per window, so every window carries signal. ``full``: every slot masked (t = 1),
    the situation of a drafter at inference; ``full_share``: that fraction of windows fully masked. ``generator``
    None: the global torch RNG (distill's ``method=mdm``, whose checkpoints save it)."""
    B, K, W = shape
    if full:
        return torch.ones(B, K, 1), torch.ones(B, K, W, dtype=torch.bool)
    rate = MDM_EPS + (1 - MDM_EPS) * torch.rand(B, K, 1, generator=generator)
    if full_share:
        rate = torch.where(torch.rand(B, K, 1, generator=generator) < full_share, torch.ones_like(rate), rate)
    masked = torch.rand(B, K, W, generator=generator) < rate
    forced = torch.randint(0, W, (B, K, 1), generator=generator)
    masked.scatter_(2, forced, True)
    return rate, masked


def window_offsets(batch: int, windows: int, seq_len: int, width: int, generator: torch.Generator) -> torch.Tensor:
    """``[batch, windows]`` random window offsets in ``[1, seq_len - width]`` (each window fully inside)."""
    return torch.randint(1, seq_len - width + 1, (batch, windows), generator=generator)


def mdm_window_loss(
    model: Transformer,
    ids: torch.Tensor,
    generator: torch.Generator,
    *,
    width: int,
    windows: int,
    mask_id: int,
    full_mask: bool = False,
    full_share: float = 0.0,
    ar_weight: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked-diffusion loss on ``windows`` packed draft windows per row of ``ids`` ``[B, T]``.

    Each window hides its slots with rate t and is trained to recover them from the clean prefix before it and
    its own unmasked slots, weighted 1/t (the ``mdm`` loss). ``ar_weight`` > 0 adds that much next-token loss on
    the clean stream of the same forward (free: it is causal and computed anyway), the way real diffusion
    drafters start from an AR model (Dream, DiffuCoder). ``full_share``: fraction of windows trained fully masked
    (t = 1), the one-step drafting situation. Returns (loss, slot accuracy on masked slots).
    """
    B, T = ids.shape
    # Offsets and noise are drawn on the generator's device (the CPU: the same draws on every machine), then moved
    # to ids' device (pack_windows checks the offsets where they are drawn, then moves them).
    offsets = window_offsets(B, windows, T, width, generator)
    rate, masked = window_noise((B, windows, width), generator, full=full_mask, full_share=full_share)
    rate, masked = rate.to(ids.device), masked.to(ids.device)
    positions = offsets.to(ids.device)[:, :, None] + torch.arange(width, device=ids.device)
    labels = torch.gather(ids, 1, positions.flatten(1)).view(B, windows, width)
    fill = torch.where(masked, torch.full_like(labels, mask_id), labels)
    packed = pack_windows(ids, offsets, width, mask_id, shift=model.config.shift, fill=fill)
    hidden = model.hidden(packed.input_ids, position_ids=packed.position_ids, attn_mask=packed.attn_mask)
    index = packed.logit_index.flatten(1)
    picked = torch.gather(hidden, 1, index[:, :, None].expand(-1, -1, hidden.shape[-1]))
    logits = model.logits(picked).float().view(B, windows, width, -1)
    ce = F.cross_entropy(logits.flatten(0, 2), packed.labels.flatten(), reduction="none").view(B, windows, width)
    use = masked & packed.valid
    loss = (ce * use / rate).sum() / packed.valid.sum().clamp(min=1)
    if ar_weight:
        clean_logits = model.logits(hidden[:, : T - 1]).float()
        loss = loss + ar_weight * F.cross_entropy(clean_logits.flatten(0, 1), ids[:, 1:].flatten())
    accuracy = ((logits.argmax(-1) == packed.labels) & use).sum() / use.sum().clamp(min=1)
    return loss, accuracy


def block_diffusion_loss(
    model: Transformer, ids: torch.Tensor, generator: torch.Generator, *, mask_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-diffusion loss of ``ids`` ``[B, T]``: masked CE weighted 1/t over the noisy half, normalised by the
    number of positions. Returns (loss, accuracy on masked positions)."""
    B, T = ids.shape
    L = model.config.block_size
    noisy, masked, rate = noise_blocks(ids, L, mask_id, generator, eps=MDM_EPS)
    input_ids, position_ids, attn_mask = block_diffusion_input(ids, noisy, L)
    both = model.hidden(input_ids, position_ids=position_ids, attn_mask=attn_mask)
    hidden = both[:, :T]
    if model.config.shift:
        # Token i is read from position i - 1: inside a block from the noisy stream, at a block's first position from
        # the clean stream (at decode time the previous block sits clean in the cache). Position 0 predicts nothing.
        last = ((torch.arange(T, device=ids.device) + 1) % L == 0)[None, :, None]  # j + 1 starts a block
        hidden = torch.where(last, both[:, T:], hidden).roll(1, dims=1)
        masked = masked.clone()
        masked[:, 0] = False
    logits = model.logits(hidden).float()
    ce = F.cross_entropy(logits.flatten(0, 1), ids.flatten(), reduction="none").view(B, T)
    loss = (ce * masked / rate).sum() / (B * T)
    accuracy = ((logits.argmax(-1) == ids) & masked).sum() / masked.sum().clamp(min=1)
    return loss, accuracy


def lr_at(step: int, peak: float, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup to ``peak`` over ``warmup`` steps, then cosine decay to ``peak * min_ratio`` at ``total``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def _optimizer(model: Transformer, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    # Decay matrices only: norms, biases and (tied) embeddings keep their scale.
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def pretrain(
    model: Transformer,
    *,
    name: str,
    pcfg,
    next_batch: Callable[[], torch.Tensor],
    step_loss: Callable[[Transformer, torch.Tensor], torch.Tensor | tuple[torch.Tensor, torch.Tensor]],
    evaluate: Callable[[Transformer], dict[str, float]],
    metrics_path: Path | None = None,
    progress: bool = True,
) -> list[dict]:
    """Train ``model`` for ``pcfg.steps`` steps; returns the evaluation records (the first is at step 0).

    pcfg: a ``PretrainConfig`` (steps, lr, warmup_steps, min_lr_ratio, weight_decay, grad_clip, eval_every).
    next_batch() -> ``[B, T]`` token ids; step_loss(model, batch) -> loss or (loss, accuracy);
    evaluate(model) -> metrics dict (run under ``torch.no_grad`` in eval mode).
    """
    opt = _optimizer(model, pcfg.lr, pcfg.weight_decay)
    evals: list[dict] = []

    def log(record: dict) -> None:
        if metrics_path is not None:
            with open(metrics_path, "a") as f:
                f.write(json.dumps({"model": name, **record}) + "\n")

    def run_eval(step: int) -> None:
        model.eval()
        with torch.no_grad():
            record = {"step": step, "eval": evaluate(model)}
        model.train()
        evals.append(record)
        log(record)

    model.train()
    run_eval(0)
    bar = tqdm(range(pcfg.steps), desc=f"train {name}", disable=not progress, dynamic_ncols=True)
    tokens, t0 = 0, time.perf_counter()
    for step in bar:
        lr = lr_at(step, pcfg.lr, pcfg.warmup_steps, pcfg.steps, pcfg.min_lr_ratio)
        for group in opt.param_groups:
            group["lr"] = lr
        batch = next_batch()
        out = step_loss(model, batch)
        loss, accuracy = out if isinstance(out, tuple) else (out, None)
        accuracy = None if accuracy is None else float(accuracy.detach())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), pcfg.grad_clip)
        opt.step()
        tokens += batch.numel()
        rate = tokens / (time.perf_counter() - t0)
        value = float(loss.detach())
        record = {"step": step + 1, "loss": value, "lr": lr, "grad_norm": float(grad_norm), "tokens_per_s": rate}
        if accuracy is not None:
            record["accuracy"] = accuracy
        log(record)
        bar.set_postfix(loss=f"{value:.3f}", tok_s=f"{rate:.0f}")
        if (step + 1) % pcfg.eval_every == 0 and step + 1 != pcfg.steps:
            run_eval(step + 1)
    run_eval(pcfg.steps)
    model.eval()
    return evals
