"""Bytes on one GPU: model states under ZeRO, activations, chunked label log-probs, KV caches and DFlash features.

Every function returns bytes (ints) for one GPU from a :class:`~streakline.planning.shapes.ModelShape` and the
sizes a stage runs at; ``stages.py`` adds them into a stage's peak. The reasoning per term is in the comments and in
docs/planning.md.

    model_states(shape, zero_stage=2, world=32, precision="bf16")   # {"weights": .., "gradients": .., "optimizer": ..}
    activations(shape, tokens=4096, checkpointing=True)
    kv_cache(shape, batch=16, positions=768)

Tests: ``python -m pytest tests/planning -q``.
"""

from __future__ import annotations

import math

from .shapes import ModelShape

GIB = 2**30
DEFAULT_CHUNK = 8192  # alignment/chunked.py: vocabulary rows per chunk of the label log-probs
STATIC_CACHE_SLOTS = 256  # models/kv_cache.py: a static cache's capacity is a multiple of this


def model_states(
    shape: ModelShape, *, zero_stage: int, world: int, precision: str = "bf16", trainable: int | None = None
) -> dict[str, int]:
    """Weights, gradients and optimizer states of a model trained with AdamW under DeepSpeed, per GPU.

    bf16 (DeepSpeed's mixed precision): bf16 weights (2 B a parameter), an fp32 master copy and Adam's two fp32
    moments (12 B), bf16 gradients and their fp32 accumulation (6 B). ZeRO-2 partitions the optimizer and gradients
    over ``world`` ranks, ZeRO-3 the weights too; then every rank holds ``4 * largest_module`` bytes of gathered
    bf16 weights (the module computing and the one prefetched), and the bf16 gradient of a module lives only until
    its reduce-scatter into the rank's fp32 partition (4 B). That is DeepSpeed's own estimate, 2P + 18P/N (ZeRO-2)
    and 4L + 18P/N (ZeRO-3), split by what each byte is for. fp32 (``trainer=cpu``): 4 B weights, 4 B gradients,
    8 B moments, no master copy, partitioned the same way. ``trainable``: only that many parameters get gradients
    and moments (LoRA adapters), the rest are frozen weights.
    """
    p = shape.params if trainable is None else trainable
    frozen = shape.params - p if trainable is not None else 0
    n = max(1, world)
    if precision == "fp32":  # the same partitioning, at 4 B weights and gradients and 8 B of moments
        weights = 4 * (p + frozen)
        if zero_stage >= 3:
            weights = math.ceil(weights / n) + 8 * shape.largest_module
        gradients = math.ceil(4 * p / n) if zero_stage >= 2 else 4 * p
        optimizer = math.ceil(8 * p / n) if zero_stage >= 2 else 8 * p
        return {"weights": weights, "gradients": gradients, "optimizer": optimizer}
    weight_bytes = 2 * (p + frozen)
    if zero_stage >= 3:
        weights = math.ceil(weight_bytes / n) + 4 * shape.largest_module
        gradients = math.ceil(4 * p / n)
    elif zero_stage == 2:
        weights, gradients = weight_bytes, math.ceil(6 * p / n)
    else:
        weights, gradients = weight_bytes, 6 * p
    optimizer = math.ceil(12 * p / n) if zero_stage >= 2 else 12 * p
    return {"weights": weights, "gradients": gradients, "optimizer": optimizer}


def frozen_weights(shape: ModelShape, *, zero_stage: int, world: int, devices: int = 1) -> int:
    """A model that only runs forwards (a verifier as the online teacher, a decoder's models), in its dtype: whole
    on each GPU, partitioned by ZeRO-3 when DeepSpeed wraps it with the trainee, or split over ``devices`` GPUs
    when its preset places it (``model.<role>.devices``; the largest device's share, one layer's rounding)."""
    total = shape.params * shape.dtype_bytes
    if zero_stage >= 3 and world > 1:
        return math.ceil(total / world) + 4 * shape.largest_module
    if devices > 1:
        per_layer = (shape.body * shape.dtype_bytes) / max(1, shape.layers)
        return math.ceil(total / devices + per_layer)
    return total


def layer_saved_bytes(shape: ModelShape) -> int:
    """Bytes one layer keeps for backward per token, in bf16 with fp32 RMSNorm: each norm saves its fp32 input and
    bf16 output (6h B each, two norms); attention its q/k/v projections, the rotated q and k and the attention
    output (2q + 3kv elements); the SwiGLU MLP gate, up, silu(gate) and their product (4I elements)."""
    s = shape
    return 2 * 6 * s.hidden + 2 * (2 * s.q_dim + 3 * s.kv_dim + 4 * s.intermediate)


def layer_working_bytes(shape: ModelShape) -> int:
    """Bytes per token a forward without autograd holds at once inside one layer (inference, or the teacher):
    the residual stream and its normed copy, q/k/v, and the MLP's gate and up (bf16)."""
    s = shape
    return 2 * (2 * s.hidden + s.q_dim + 2 * s.kv_dim + 2 * s.intermediate)


def activations(shape: ModelShape, *, tokens: int, checkpointing: bool) -> int:
    """Activations a training forward keeps for backward over ``tokens`` tokens (all rows of a micro batch).

    Without checkpointing every layer keeps :func:`layer_saved_bytes` per token. With it each layer keeps only its
    input (2h B a token) and backward recomputes one layer at a time, which then holds one layer's full set. The
    embedding output and the final norm add one fp32 and one bf16 copy of the stream."""
    per_layer = layer_saved_bytes(shape) * tokens
    stream = 6 * shape.hidden * tokens
    if checkpointing:
        return shape.layers * 2 * shape.hidden * tokens + per_layer + stream
    return shape.layers * per_layer + stream


def attention_mask_bytes(
    *, rows: int, length: int, explicit: bool, bias_layers: int | None = None, bias_bytes: int = 2
) -> int:
    """An explicit ``[rows, S, S]`` boolean mask (packed windows, padded rows), 1 B a query-key pair, and the
    additive bias SDPA makes of it; a plain causal or unpadded full forward (FlashAttention) needs none.

    ``bias_layers`` None (a GPU): one bf16 bias, as the memory-efficient kernel makes it (3 B a pair in all). Else
    (SDPA's default path, a CPU) every layer's call turns the mask into a ``[rows, 1, S, S]`` bias of the compute
    dtype (``bias_bytes``) that autograd keeps for that layer's backward: ``bias_layers`` of them live at once, every
    layer's, or under activation checkpointing the recomputed one's (measured: tests/planning/test_memory.py)."""
    if not explicit:
        return 0
    pairs = rows * length * length
    return pairs * 3 if bias_layers is None else pairs * (1 + bias_bytes * bias_layers)


def label_logprob_bytes(shape: ModelShape, *, slots: int, chunk: int = DEFAULT_CHUNK, teacher: bool = False) -> int:
    """Chunked label log-probs (``alignment/chunked.py``): the slots' hidden states, one fp32 ``[slots, chunk]``
    logit chunk and its gradient in backward; never ``[slots, V]``. A full-vocabulary teacher divergence holds the
    teacher's chunk beside it."""
    chunk = min(chunk, shape.vocab)
    per_chunk = slots * chunk * 4
    return 2 * slots * shape.hidden + per_chunk * (3 if teacher else 2)


def kv_cache(shape: ModelShape, *, batch: int, positions: int, static: bool = True) -> int:
    """Keys and values of every layer for ``batch`` rows of ``positions`` slots in the model's dtype; a static
    cache (the GPU default engine) rounds the capacity up to a multiple of 256 slots."""
    if static:
        positions = -(-positions // STATIC_CACHE_SLOTS) * STATIC_CACHE_SLOTS
    return 2 * shape.layers * shape.kv_dim * positions * batch * shape.dtype_bytes


def feature_bytes(*, tokens: int, layers: int, hidden: int) -> int:
    """DFlash verifier features: ``layers`` residual streams of width ``hidden`` per token in half precision (what
    stage=trajectories stores and what an online teacher hands the drafter each step)."""
    return tokens * layers * hidden * 2


def prefill_bytes(shape: ModelShape, *, batch: int, prompt: int) -> int:
    """A prefill forward's transient: one layer's working set over the whole prompt, and the fp32 logits of each
    row's last position."""
    return layer_working_bytes(shape) * batch * prompt + batch * shape.vocab * 4
