"""A model across the devices of a node: its layers split into consecutive runs, one run per device, so a verifier
larger than one GPU (Qwen2.5-72B in bf16 is ~145 GB) decodes on several.

    plan = plan_layers(model.config, ["cuda:0", "cuda:1"], bytes_per_param=2)   # by each device's free memory
    print(plan.describe())        # layers 0-39 on cuda:0 (70.2 GB), layers 40-79 on cuda:1 (70.9 GB)
    place(model, plan)            # moves the modules; Transformer.hidden moves activations between runs

The embedding sits with the first run and the final norm and read-out with the last (a tied read-out is the
embedding, so its logits come from the first device); the KV cache keeps each layer's keys and values on that layer's
device (``KVCache.for_model`` reads ``model.layer_devices``). Only one device computes at a time: this is for fitting
a model, not for speed (tensor parallelism is vLLM's job: ``data.backend=vllm`` gets ``tensor_parallel_size``).

``model.<role>.devices`` asks for it: ``auto`` (every visible GPU) or a list (``[0,1]``, ``[cuda:0,cuda:1]``,
``[cpu,cpu]``: the same code on one CPU, which the tests use). Tests: ``tests/models/test_placement.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from streakline.errors import UserError

from .config import TransformerConfig
from .kv_cache import GIB, device_runs, free_bytes


@dataclass(frozen=True)
class Plan:
    """Which device each layer runs on; the embedding on the first layer's, norm and read-out on the last's."""

    layer_devices: tuple[torch.device, ...]
    layer_bytes: int
    edge_bytes: int  # the embedding or the read-out matrix

    def describe(self) -> str:
        runs = []
        for start, end, device in device_runs(self.layer_devices):
            edges = (start == 0) + (end == len(self.layer_devices))
            gb = ((end - start) * self.layer_bytes + edges * self.edge_bytes) / 1e9
            runs.append(f"layers {start}-{end - 1} on {device} ({gb:.1f} GB)")
        return ", ".join(runs)


class DeviceError(UserError, ValueError):
    """``model.<role>.devices`` names a GPU this machine does not have."""


def resolve_devices(devices, key: str = "model.<role>.devices") -> list[torch.device]:
    """``auto`` -> every visible GPU (else the CPU); a list of ints / names -> devices (an int is a GPU index).
    DeviceError (named after ``key``) for a GPU that is not there: the model would otherwise run elsewhere."""
    if devices == "auto":
        n = torch.cuda.device_count()
        return [torch.device("cuda", i) for i in range(n)] or [torch.device("cpu")]
    out = [torch.device("cuda", d) if isinstance(d, int) else torch.device(str(d)) for d in devices]
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    absent = [d for d in out if d.type == "cuda" and (d.index or 0) >= count]
    if absent:
        given = "[" + ",".join(str(d) for d in devices) + "]"
        have = "no GPU torch can use" if count == 0 else f"{count} GPU{'s' if count > 1 else ''} (cuda:0-{count - 1})"
        raise DeviceError(
            f"{key}={given} names {absent[0]}, but this machine has {have}; set {key}=null (the stage's one device"
            f"{': the CPU here' if count == 0 else ''}), {key}=auto, or name devices it has"
        )
    return out


def _param_counts(cfg: TransformerConfig) -> tuple[int, int]:
    """Parameters of one decoder layer, and of the embedding (the same as an untied read-out)."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if cfg.qkv_bias else 0)
    mlp = 3 * h * cfg.intermediate_size
    return attn + mlp + 2 * h, cfg.vocab_size * h


def plan_layers(
    cfg: TransformerConfig,
    devices: Sequence[torch.device | str],
    bytes_per_param: int,
    free: Sequence[int | None] | None = None,
) -> Plan:
    """Split the layers into one consecutive run per device, in proportion to each device's free memory after the
    embedding (first device) and the read-out (last device); equal runs where free memory cannot be read. Every
    device gets at least one layer."""
    devices = [torch.device(d) for d in devices]
    if not 1 <= len(devices) <= cfg.num_layers:
        raise ValueError(f"{len(devices)} devices for {cfg.num_layers} layers: give between 1 and {cfg.num_layers}")
    layer_params, edge_params = _param_counts(cfg)
    layer_bytes, edge_bytes = layer_params * bytes_per_param, edge_params * bytes_per_param
    free = list(free) if free is not None else [free_bytes(d) for d in devices]
    if any(f is None for f in free) or len(set(devices)) < len(devices):
        room = [1.0] * len(devices)  # unknown, or one device named twice (the CPU test plan): equal shares
    else:
        tied_edges = 1 if cfg.tie_embeddings else 2
        edges = [0] * len(devices)
        edges[0] += edge_bytes
        edges[-1] += edge_bytes * (tied_edges - 1)
        room = [max(f - e, 0) for f, e in zip(free, edges, strict=True)]
    total = sum(room) or len(devices)
    counts = [max(1, round(cfg.num_layers * r / total)) for r in room]
    while sum(counts) > cfg.num_layers:  # rounding: take back from the largest share
        counts[counts.index(max(counts))] -= 1
    while sum(counts) < cfg.num_layers:
        counts[room.index(max(room))] += 1
    layer_devices = tuple(d for d, n in zip(devices, counts, strict=True) for _ in range(n))
    return Plan(layer_devices, layer_bytes, edge_bytes)


def place(model, plan: Plan):
    """Move ``model``'s modules to ``plan``'s devices and record it (``model.layer_devices``); returns ``model``."""
    if len(plan.layer_devices) != len(model.layers):
        raise ValueError(f"the plan places {len(plan.layer_devices)} layers; the model has {len(model.layers)}")
    first, last = plan.layer_devices[0], plan.layer_devices[-1]
    model.embed.to(first)
    for layer, device in zip(model.layers, plan.layer_devices, strict=True):
        layer.to(device)
    model.norm.to(last)
    if model.lm_head is not None:
        model.lm_head.to(last)
    model.layer_devices = list(plan.layer_devices)
    return model


def plan_for(cfg: TransformerConfig, devices, dtype: torch.dtype) -> Plan:
    """The plan ``model.<role>.devices`` asks for, refused with the sizes when the weights cannot fit."""
    from .kv_cache import MemoryLimitError

    resolved = resolve_devices(devices)
    plan = plan_layers(cfg, resolved, torch.tensor([], dtype=dtype).element_size())
    need = cfg.num_layers * plan.layer_bytes + plan.edge_bytes * (1 if cfg.tie_embeddings else 2)
    free = [free_bytes(d) for d in dict.fromkeys(resolved)]
    if all(f is not None for f in free) and need > sum(free):
        raise MemoryLimitError(
            f"the weights need {need / GIB:,.1f} GiB but the {len(free)} devices have {sum(free) / GIB:,.1f} GiB "
            f"free together; give more devices (model.<role>.devices) or a smaller dtype"
        )
    return plan
