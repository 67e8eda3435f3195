"""Training telemetry for stage=distill: where a step's time goes, throughput, memory, gradient norm, MFU, run shape.

    telemetry = Telemetry(strategy, engine, trainer_cfg)   # built by the Trainer
    telemetry.start()                                     # hooks on the drafter's and teacher's blocks
    with telemetry.phase("data"):
        batch = next(stream)
    with telemetry.phase("forward"):
        loss, _ = engine(batch)
    strategy.step(engine, loss, clock=telemetry.clock)    # times "backward" and "optimizer"
    telemetry.count(batch)                                # label tokens and samples: CPU tensors, no device sync
    record = telemetry.report(step)                       # at log_every, on every rank (one small all_gather)
    telemetry.stop()

What ``report`` gives (docs/telemetry.md has the table): the gradient norm before clipping (DeepSpeed's own global
value, ``strategy.grad_norm``), seconds per step, label tokens/s in total and per rank, samples/s, the label tokens
seen since step 0, peak memory (CUDA max allocated and reserved, else the process's peak resident set; the largest
rank's), achieved model TFLOP/s and MFU against the device's bf16 peak (``PEAK_BF16_TFLOPS``; None where the device
is not in the table), and seconds per step by phase: data, teacher forward, drafter forward+backward, optimizer,
checkpoint, other.

Cost with ``trainer.profile=false`` (the default): per micro-step a few ``perf_counter`` calls and two module hooks
that read tensor shapes; per log step one all_gather of a few numbers and the one sync that reading the loss and the
gradient norm already makes. No device sync per step. On a GPU the phase times then measure the host (kernels run
asynchronously), so they are logged only with ``trainer.profile=true``, which synchronises the device around every
phase; on a CPU the host is the device and they are always logged.

    python -m pytest tests/alignment/test_telemetry.py -q
"""

from __future__ import annotations

import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .stopping import step_examples

# Dense bf16 tensor-core peaks in TFLOP/s per device, from NVIDIA's datasheets (the "with sparsity" figures are
# twice these and no training step reaches them). Matched in order against torch.cuda.get_device_name, so the
# PCIe and NVL H100s come before the SXM one ("NVIDIA H100 80GB HBM3").
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.4),
    ("H200", 989.4),
    ("A100", 312.0),
)

# What a manifest should not hold: numbers of the wall clock and the machine, not of the trained drafter. The run's
# result metrics (fit's return, the manifest) leave them out, so a run killed and resumed has the same manifest
# metrics as an uninterrupted one (tests/pipelines/test_kill_harness.py); the log and W&B keep them.
WALL_CLOCK_KEYS = ("step_time", "samples_per_s", "tflops_per_s", "mfu")
WALL_CLOCK_PREFIXES = ("time/", "memory/")

CUDA_MEMORY_KEYS = ("memory/peak_allocated_gb", "memory/peak_reserved_gb")  # logged on a GPU, RSS_KEY elsewhere
RSS_KEY = "memory/peak_rss_gb"
# What a CPU run does not log: CUDA's memory counters, and MFU, which needs a device peak (None is left out of W&B)
GPU_ONLY_KEYS = (*CUDA_MEMORY_KEYS, "mfu")
PHASES = ("data", "teacher", "drafter", "optimizer", "checkpoint", "other")  # the logged split, time/<phase>
# What each rank counts between gathers: label tokens and samples of its micro-batches, and the tokens its drafter
# and teacher ran (their first block's input shape, padding included: the work the device did)
COUNTERS = ("label_tokens", "samples", "drafter_tokens", "teacher_tokens")
GB = 1024**3


def is_wall_clock(key: str) -> bool:
    """True for a telemetry key that measures time or memory (``step_time``, ``time/data``, ``memory/...``)."""
    return key in WALL_CLOCK_KEYS or key.startswith(WALL_CLOCK_PREFIXES)


def device_peak_tflops(name: str) -> float | None:
    """Dense bf16 peak TFLOP/s of a device named like ``torch.cuda.get_device_name`` (``"NVIDIA H100 80GB HBM3"``
    -> 989.4); None for a device not in ``PEAK_BF16_TFLOPS`` (any CPU, older or other GPUs)."""
    for pattern, peak in PEAK_BF16_TFLOPS:
        if pattern in name:
            return peak
    return None


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def model_flops(trainable: int, drafter_tokens: int, teacher: int = 0, teacher_tokens: int = 0) -> float:
    """Model FLOPs of training steps that ran ``drafter_tokens`` tokens through a drafter with ``trainable``
    parameters and ``teacher_tokens`` through a frozen teacher of ``teacher`` parameters: 6 per trainable
    parameter and token (forward 2, backward 4) plus 2 per teacher parameter and token (forward only).

    An estimate, as MFU usually is: attention's own FLOPs are left out, and so are frozen drafter parameters (LoRA,
    ``trainer.freeze_embeddings``), which still cost a forward and an input gradient, so MFU reads low there."""
    return 6.0 * trainable * drafter_tokens + 2.0 * teacher * teacher_tokens


def mfu(flops: float, seconds: float, devices: int, peak_tflops: float | None) -> float | None:
    """Model FLOPs utilisation: ``flops`` done by ``devices`` devices in ``seconds``, over their bf16 peak; None
    when the peak is unknown."""
    if peak_tflops is None or seconds <= 0 or devices < 1:
        return None
    return flops / seconds / (devices * peak_tflops * 1e12)


def peak_memory(device: torch.device) -> dict[str, float]:
    """This process's peak memory in GiB since it started: CUDA's max allocated and reserved on a GPU, else the
    peak resident set (``getrusage``). Host-side counters only: no device sync."""
    if device.type == "cuda":
        allocated, reserved = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
        return dict(zip(CUDA_MEMORY_KEYS, (allocated / GB, reserved / GB), strict=True))
    try:
        import resource
    except ImportError:  # not on Windows
        return {}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {RSS_KEY: rss * (1 if sys.platform == "darwin" else 1024) / GB}  # KiB on Linux, bytes on macOS


def _numel(p: torch.nn.Parameter) -> int:
    return int(getattr(p, "ds_numel", p.numel()))  # ZeRO-3 leaves an empty tensor and keeps the size in ds_numel


def teacher_of(module: nn.Module) -> nn.Module | None:
    """The frozen verifier a train module runs as teacher or feature source, if it holds one. Both train modules
    (``DraftTrainModule``, ``DFlashTrainModule``) keep it in a list, out of their submodules, so it is never
    trained, saved or partitioned."""
    held = getattr(module, "_verifier", None) or []
    return held[0] if held else None


def parameter_counts(module: nn.Module) -> dict[str, int]:
    """``trainable`` and ``frozen`` parameters of the train module (ZeRO-3 partitions counted whole) and
    ``teacher``: those of the verifier it holds outside its submodules (0 without one)."""
    params = list(module.parameters())
    trainable = sum(_numel(p) for p in params if p.requires_grad)
    teacher = teacher_of(module)
    return {
        "trainable": trainable,
        "frozen": sum(_numel(p) for p in params) - trainable,
        "teacher": sum(_numel(p) for p in teacher.parameters()) if teacher is not None else 0,
    }


def blocks_of(model: nn.Module) -> nn.ModuleList | None:
    """The transformer blocks of a model (the first non-empty ``layers`` list among its modules: a Transformer, a
    DFlashModel, the same inside a PEFT wrapper), or None."""
    for m in model.modules():
        layers = getattr(m, "layers", None)
        if isinstance(layers, nn.ModuleList) and len(layers):
            return layers
    return None


class _Phase:
    """A reusable context manager for one phase of a clock (cheaper per step than a generator-based one)."""

    __slots__ = ("clock", "name")

    def __init__(self, clock: PhaseClock, name: str) -> None:
        self.clock, self.name = clock, name

    def __enter__(self) -> None:
        self.clock.start(self.name)

    def __exit__(self, *exc) -> None:
        self.clock.stop(self.name)


class PhaseClock:
    """Seconds spent in named phases, accumulated until ``take``. Phases nest (the teacher's forward runs inside the
    train module's forward); ``sync``, when given, runs before every start and stop (``torch.cuda.synchronize``
    under ``trainer.profile=true``) so that device work lands in the phase that launched it."""

    def __init__(self, sync: Callable[[], None] | None = None) -> None:
        self.sync = sync
        self.totals: dict[str, float] = defaultdict(float)
        self._open: list[tuple[str, float]] = []
        self._phases: dict[str, _Phase] = {}

    @property
    def current(self) -> str | None:
        return self._open[-1][0] if self._open else None

    def start(self, name: str) -> None:
        if self.sync is not None:
            self.sync()
        self._open.append((name, time.perf_counter()))

    def stop(self, name: str) -> None:
        if self.sync is not None:
            self.sync()
        now = time.perf_counter()
        if all(opened != name for opened, _ in self._open):
            return
        while self._open:  # an exception inside a nested phase may have left it open: close it with its parent
            opened, t0 = self._open.pop()
            self.totals[opened] += now - t0
            if opened == name:
                return

    def phase(self, name: str) -> _Phase:
        """``with clock.phase("data"): ...`` times the block as ``name``."""
        found = self._phases.get(name)
        if found is None:
            found = self._phases[name] = _Phase(self, name)
        return found

    def take(self) -> dict[str, float]:
        out = dict(self.totals)
        self.totals.clear()
        return out


class Telemetry:
    """Counts and clocks of the training loop between two log steps; ``report`` turns them into the logged record.

    Counters are per rank; ``report`` and ``fold`` gather them (collectives: every rank calls them at the same step).
    ``label_tokens_seen`` is the label tokens of all ranks since step 0: the trainer saves it with each checkpoint
    and sets it back on resume (None when resumed from a checkpoint older than this counter: it is not logged then).
    """

    def __init__(self, strategy, engine, cfg) -> None:
        self.strategy, self.engine = strategy, engine
        self.device = strategy.device
        self.profile = bool(getattr(cfg, "profile", False))
        sync = self.device.type == "cuda" and self.profile
        self.clock = PhaseClock((lambda: torch.cuda.synchronize(self.device)) if sync else None)
        self.log_phases = self.profile or self.device.type != "cuda"
        self.params = parameter_counts(engine.module)
        self.peak_tflops = device_peak_tflops(device_name(self.device))
        self.label_tokens_seen: int | None = 0
        self.local = dict.fromkeys(COUNTERS, 0)  # this rank, since the last gather
        self.interval = dict.fromkeys(COUNTERS, 0)  # all ranks, since the last report
        self._hooks: list[Any] = []
        self._mark, self._step = time.perf_counter(), 0

    def __deepcopy__(self, memo) -> Telemetry:
        # A deep copy of a hooked module (the LoRA-merged copy distill evaluates) copies its hooks, and so this
        # object: share it instead of copying the strategy's process group, which cannot be copied. The copy's
        # forwards run outside the "forward" phase, so they count nothing.
        return self

    # ------------------------------------------------------------------ the loop's hooks
    def start(self, step: int = 0) -> None:
        """Begin the first interval at ``step`` and hook the drafter's and the teacher's blocks: the first block's
        input shape counts the tokens each runs (only inside the train module's forward, so evaluation and
        activation-checkpointing recomputes do not count), and the teacher's blocks are timed as ``teacher``."""
        self.stop()
        self._mark, self._step = time.perf_counter(), step
        self.clock.take()
        module = self.engine.module
        drafter = blocks_of(getattr(module, "drafter", module))
        if drafter is not None:
            self._hooks.append(drafter[0].register_forward_pre_hook(self._drafter_runs))
        teacher = teacher_of(module)
        blocks = blocks_of(teacher) if teacher is not None else None
        if blocks is not None:
            self._hooks.append(blocks[0].register_forward_pre_hook(self._teacher_starts))
            self._hooks.append(blocks[-1].register_forward_hook(self._teacher_ends))

    def stop(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def phase(self, name: str):
        return self.clock.phase(name)

    def count(self, batch) -> None:
        """Add one micro-batch's label tokens and samples (rows). The batch is still on the CPU: no device sync."""
        self.local["label_tokens"] += int(batch.valid.sum())
        self.local["samples"] += int(batch.valid.shape[0])

    def _drafter_runs(self, block, args) -> None:
        if self.clock.current == "forward":
            self.local["drafter_tokens"] += args[0].shape[:-1].numel()  # x [B, L, H]

    def _teacher_starts(self, block, args) -> None:
        if self.clock.current == "forward":
            self.local["teacher_tokens"] += args[0].shape[:-1].numel()
            self.clock.start("teacher")

    def _teacher_ends(self, block, args, output) -> None:
        if self.clock.current == "teacher":
            self.clock.stop("teacher")

    # ------------------------------------------------------------------ gathering and the record
    def fold(self) -> list[list[float]]:
        """Gather every rank's counters (collective) into the interval's and ``label_tokens_seen``; returns each
        rank's row ``[counters..., peak memory...]``."""
        memory = list(peak_memory(self.device).values())
        rows = self.strategy.gather([*map(float, self.local.values()), *memory])
        for i, key in enumerate(COUNTERS):
            self.interval[key] += int(sum(row[i] for row in rows))
        if self.label_tokens_seen is not None:
            self.label_tokens_seen += int(sum(row[0] for row in rows))
        self.local = dict.fromkeys(COUNTERS, 0)
        return rows

    def report(self, step: int) -> dict[str, Any]:
        """The telemetry record for the steps since the last report, ending at optimizer step ``step``; call on
        every rank (it gathers). The gradient norm is the last optimizer step's."""
        rows = self.fold()
        now = time.perf_counter()
        phases = self.clock.take()
        steps = max(1, step - self._step)
        # evaluation is not training; checkpointing is, but it is reported on its own line, not in throughput
        train_s = max(now - self._mark - phases.get("eval", 0.0) - phases.get("checkpoint", 0.0), 1e-9)
        label, samples, drafter_tokens, teacher_tokens = (self.interval[k] for k in COUNTERS)
        world = self.strategy.world_size
        flops = model_flops(self.params["trainable"], drafter_tokens, self.params["teacher"], teacher_tokens)
        out: dict[str, Any] = {
            "grad_norm": self.strategy.grad_norm(self.engine),
            "step_time": train_s / steps,
            "label_tokens_per_s": label / train_s,
            "label_tokens_per_s_per_rank": label / train_s / world,
            "samples_per_s": samples / train_s,
            "tflops_per_s": flops / train_s / 1e12,
            "mfu": mfu(flops, train_s, world, self.peak_tflops),
        }
        if self.label_tokens_seen is not None:
            out["label_tokens_seen"] = self.label_tokens_seen
        for i, key in enumerate(peak_memory(self.device), start=len(COUNTERS)):
            out[key] = max(row[i] for row in rows)  # the fullest rank: the one that runs out first
        if self.log_phases:
            split = {
                "data": phases.get("data", 0.0),
                "teacher": phases.get("teacher", 0.0),
                "drafter": phases.get("forward", 0.0) - phases.get("teacher", 0.0) + phases.get("backward", 0.0),
                "optimizer": phases.get("optimizer", 0.0),
                "checkpoint": phases.get("checkpoint", 0.0),
            }
            split["other"] = max(0.0, train_s + split["checkpoint"] - sum(split.values()))
            out.update({f"time/{k}": v / steps for k, v in split.items()})
        self.interval = dict.fromkeys(COUNTERS, 0)
        self._mark, self._step = now, step
        return out


def run_metadata(strategy, engine, windows, cfg, params: dict[str, int] | None = None) -> dict[str, Any]:
    """The shape of a distill run, for the W&B config and the manifest: nodes, ranks per node, world size, device,
    micro batch, gradient accumulation, global batch (examples per optimizer step: trajectories with up to
    ``windows_per_example`` windows each), ZeRO stage, precision, parameter counts, the dataset's examples, windows
    and tokens (prompt + completion, every trajectory) and the git commit."""
    from streakline.artifacts import git_sha
    from streakline.models.precision import precision_name

    world = strategy.world_size
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))  # torchrun sets it; a plain process is a node of one
    params = params or parameter_counts(engine.module)
    peak = device_peak_tflops(device_name(strategy.device))
    return {
        "nodes": max(1, world // max(1, per_node)),
        "ranks_per_node": per_node,
        "world_size": world,
        "device": device_name(strategy.device),
        "micro_batch_size": cfg.micro_batch_size,
        "grad_accum": cfg.grad_accum,
        "global_batch": step_examples(cfg, world),
        "windows_per_example": windows.windows_per_seq,
        "zero_stage": cfg.zero_stage,
        "precision": cfg.precision,
        "autocast": "off" if getattr(strategy, "autocast", None) is None else precision_name(strategy.autocast),
        "params_trainable": params["trainable"],
        "params_frozen": params["frozen"],
        "params_teacher": params["teacher"],
        "dataset_examples": len(windows),
        "dataset_windows": windows.num_windows,
        "dataset_tokens": getattr(windows, "num_tokens", None),
        "peak_tflops": peak if peak is not None else "unknown",
        "git_commit": git_sha(),
    }
