"""Seconds from FLOPs and bytes: training steps, prefills and memory-bound decode steps on a cluster's GPUs.

A training step is bounded by its FLOPs at the stated MFU or by ZeRO's collectives over the slowest link,
whichever is longer (DeepSpeed overlaps the two). A decode step reads every weight and the KV cache once from HBM,
at the stated share of its bandwidth, unless its FLOPs at that batch take longer (large batches become compute
bound). The efficiencies are the plan's settings (``stage.mfu``, ``stage.bandwidth_efficiency``), printed with it.

    train_flops(shape, tokens=8192, context=640, slots=2048, checkpointing=True)
    decode_step_seconds(bytes_read=15e9, flops=3e10, cluster=cfg.cluster, bandwidth_efficiency=0.7, mfu=0.4)

Tests: ``python -m pytest tests/planning -q``.
"""

from __future__ import annotations

from .shapes import ModelShape


def forward_flops(shape: ModelShape, *, tokens: int, context: float, slots: int = 0, head: bool = True) -> float:
    """FLOPs of one forward: 2 per body parameter per token, attention's QK^T and AV (4 * q_dim per attended key,
    ``context`` keys per token on average), and the read-out ``2 * h * V`` at the ``slots`` positions read out
    (every token when ``slots`` is 0 and ``head``)."""
    body = 2 * shape.body * tokens
    attention = 4 * shape.layers * shape.q_dim * context * tokens
    read = slots if slots else (tokens if head else 0)
    return body + attention + 2 * shape.hidden * shape.vocab * read


def train_flops(
    shape: ModelShape, *, tokens: int, context: float, slots: int, checkpointing: bool, frozen: bool = False
) -> float:
    """FLOPs of forward and backward: backward costs two forwards (gradients for the inputs and the weights), one
    when the weights are frozen (LoRA: input gradients only, the adapters are negligible); checkpointing recomputes
    the forward once more."""
    f = forward_flops(shape, tokens=tokens, context=context, slots=slots)
    return f * ((2 if frozen else 3) + (1 if checkpointing else 0))


def link_gbps(cluster) -> float:
    """Per-GPU bandwidth of the slowest link a collective over the whole cluster crosses: NVLink within a node,
    the node's network share per GPU across nodes."""
    if cluster.nodes > 1:
        return min(cluster.intra_node_gbps, cluster.inter_node_gbps / cluster.gpus_per_node)
    return cluster.intra_node_gbps


def zero_comm_bytes(params: int, *, zero_stage: int, world: int, element_bytes: int = 2) -> float:
    """Bytes each rank sends per optimizer step in ring collectives of tensors of ``element_bytes`` per element (2
    for a bf16 trainer's; 4 for an fp32 trainer's, whose gradients and weights are fp32 under autocast too), each
    moving (N-1)/N of the tensor: ZeRO-0 all-reduces the gradients (two passes), ZeRO-2 reduce-scatters them and
    all-gathers the updated weights, ZeRO-3 also all-gathers the weights for forward and again for backward."""
    if world <= 1:
        return 0.0
    passes = {0: 2, 2: 2, 3: 3}.get(zero_stage, 2)
    return passes * element_bytes * params * (world - 1) / world


FP32_PER_BF16 = 1 / 16  # dense fp32 (no TF32) over dense bf16 peak: 19.5 / 312 on A100, 67 / 989 on H100


def peak_tflops(cluster, precision: str = "bf16") -> float:
    """One GPU's dense peak for GEMMs in ``precision`` (``bf16`` or ``fp32``)."""
    if precision == "bf16":
        return cluster.bf16_tflops
    return cluster.fp32_tflops or cluster.bf16_tflops * FP32_PER_BF16


def seconds(flops: float, cluster, mfu: float, precision: str = "bf16") -> float:
    """FLOPs on one GPU at ``mfu`` of its peak in ``precision`` (the GEMMs' dtype)."""
    return flops / (peak_tflops(cluster, precision) * 1e12 * mfu)


def decode_step_seconds(*, bytes_read: float, flops: float, cluster, bandwidth_efficiency: float, mfu: float) -> float:
    """One decode step: its HBM reads at ``bandwidth_efficiency`` of the bandwidth, or its FLOPs, the longer."""
    return max(bytes_read / (cluster.hbm_gbps * 1e9 * bandwidth_efficiency), seconds(flops, cluster, mfu))


def human_seconds(s: float) -> str:
    """``42 s``, ``7.5 min``, ``3.2 h``, ``4.1 d``."""
    if s < 90:
        return f"{s:.3g} s"
    if s < 5400:
        return f"{s / 60:.3g} min"
    if s < 2 * 86400:
        return f"{s / 3600:.3g} h"
    return f"{s / 86400:.3g} d"
