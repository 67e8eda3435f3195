"""One planner per stage (``STAGE_PLANNERS``): memory per GPU, disk and time of that stage for a composed config.

Each planner takes the config and the roles' shapes (:class:`Shapes`: ``shapes.role_shape``, built once) and
returns a :class:`StagePlan`; ``verdicts.py`` adds the verdict and the fix. What a config does not say (prompt
length, efficiencies) comes from the plan's settings (:func:`assumptions`).

    plan = STAGE_PLANNERS["distill"](cfg, Shapes(cfg))     # StagePlan(memory={"weights": ..., ...}, ...)

Tests: ``python -m pytest tests/planning -q``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from omegaconf import DictConfig, OmegaConf

from streakline.config import ConfigError
from streakline.config.schema import AUTO_BATCH_CAP
from streakline.config.validate import stage_settings_node

from . import memory as mem
from . import timing
from .shapes import ModelShape, role_shape

DEFAULT_STAGES = ("trajectories", "distill", "evaluate", "spot", "spiffy", "sweep")
TEACHER_LOSSES = ("distillspec", "ar_distill")  # alignment/losses.py: the losses that read a verifier teacher


@dataclass
class StagePlan:
    """A stage's plan: ``memory`` (bytes per GPU, by what they are for; their sum is the peak), ``disk`` (bytes),
    ``seconds`` (the whole stage) and ``step`` (one step or one batch, with ``step_label``), the GPUs it uses,
    the usable bytes per GPU, the lines of reasoning printed with it, and after :func:`plan_stage` the fix."""

    stage: str
    what: str  # one line: the model(s) and settings planned
    memory: dict[str, int]
    disk: dict[str, int]
    step: float
    step_label: str
    seconds: float
    gpus: int
    usable: int
    notes: list[str] = field(default_factory=list)
    refusal: str | None = None  # the stage itself would refuse (features past data.max_feature_gb)
    fix: str | None = None  # what to change, as the line prints it
    fix_overrides: list[str] = field(default_factory=list)  # the same as command-line overrides
    fix_peak: int | None = None

    @property
    def peak(self) -> int:
        return sum(self.memory.values())

    @property
    def fits(self) -> bool:
        return self.refusal is None and self.peak <= self.usable

    @property
    def verdict(self) -> str:
        gib = mem.GIB
        if self.fits:
            return f"fits: {self.peak / gib:.1f} of {self.usable / gib:.1f} GiB usable per GPU"
        why = self.refusal or f"{self.peak / gib:.1f} GiB per GPU, {self.usable / gib:.1f} usable"
        if self.fix is None:
            return f"does not fit: {why}; no change tried here fits it (more nodes, a larger GPU or a smaller model)"
        at = f" ({self.fix_peak / gib:.1f} GiB)" if self.fix_peak is not None else ""
        return f"does not fit: {why}; fix: {self.fix}{at}"


# ------------------------------------------------------------------------------------------------ common pieces
class Shapes(dict):
    """role -> ModelShape, built on first use (a stage that never reads the target never builds it)."""

    def __init__(self, cfg: DictConfig) -> None:
        super().__init__()
        self.cfg = cfg

    def __missing__(self, role: str) -> ModelShape:
        self[role] = role_shape(self.cfg, role)
        return self[role]


def assumptions(cfg: DictConfig) -> DictConfig:
    """The plan's settings (``PlanStage``): ``cfg.stage`` under stage=plan, else ``settings.plan`` over the schema
    (the Slurm launcher plans a distill job before it submits it)."""
    return cfg.stage if cfg.stage.name == "plan" else settings_of(cfg, "plan")


def mfu(cfg: DictConfig) -> float:
    """``stage.mfu``, or the median MFU that the telemetry of the distill run ``stage.mfu_from`` logged (a run
    folder or its ``metrics.jsonl``; docs/telemetry.md). That MFU counts 6 x trainable parameters per token and
    leaves attention and recompute out, so against this plan's fuller FLOP count it errs towards longer times."""
    a = assumptions(cfg)
    return a.mfu if not a.mfu_from else measured_mfu(a.mfu_from)


def measured_mfu(path: str) -> float:
    """The median of the non-null ``mfu`` values in a distill run's ``metrics.jsonl``; ConfigError naming the fix."""
    import json
    import statistics
    from pathlib import Path

    file = Path(path).expanduser()
    file = file / "metrics.jsonl" if file.is_dir() else file
    if not file.is_file():
        raise ConfigError(f"stage.mfu_from={path}: no metrics.jsonl there; name a distill run folder or its file")
    values = []
    for line in file.read_text(encoding="utf-8").splitlines():
        record = json.loads(line) if line.strip() else {}
        if isinstance(record, dict) and isinstance(record.get("mfu"), int | float):
            values.append(float(record["mfu"]))
    if not values:
        raise ConfigError(
            f"stage.mfu_from={path}: {file} logs no MFU (a CPU run logs none); name a GPU run or set stage.mfu"
        )
    return statistics.median(values)


def world(cfg: DictConfig) -> int:
    return cfg.cluster.nodes * cfg.cluster.gpus_per_node


def gemm_precision(cfg: DictConfig) -> str:
    """The dtype distill's GEMMs run in on the planned GPUs: bf16 for a bf16 trainer, and for an fp32 trainer under
    ``trainer.autocast`` (``auto`` follows the top-level ``precision``; every GPU a cluster preset names multiplies
    bf16 natively, the CPU preset is judged by this machine's flags); fp32 with ``trainer.autocast=off`` or
    ``precision=fp32``."""
    from streakline.models.precision import Hardware, detect, training_autocast

    t = cfg.trainer
    if t.precision == "bf16":
        return "bf16"
    gpu = cfg.cluster.name != "cpu"
    hardware = Hardware("cuda", True, "a planned GPU") if gpu else detect("cpu")
    amp = training_autocast(cfg.get("precision", "auto"), t.precision, t.get("autocast", "auto"), hardware=hardware)
    return "fp32" if amp is None else "bf16"


def usable(cfg: DictConfig) -> int:
    return int(cfg.cluster.gpu_memory_gib * mem.GIB * assumptions(cfg).usable_memory)


def devices_of(cfg: DictConfig, role: str) -> int:
    """GPUs ``model.<role>.devices`` spreads the role over: none (1), ``auto`` (a node's), or the list's length.
    Counted here from the cluster, never by asking this machine's CUDA."""
    devices = cfg.model[role].devices
    if devices is None:
        return 1
    if devices == "auto":
        return cfg.cluster.gpus_per_node
    return max(1, len(devices)) if isinstance(devices, list | tuple) or OmegaConf.is_list(devices) else 1


def settings_of(cfg: DictConfig, name: str) -> DictConfig:
    """Stage ``name``'s settings as that stage would read them: ``cfg.stage`` when the config runs that stage (a
    ``stage=evaluate stage.batch_size=8`` job checked before submission, a run checked at its start), else its
    schema with ``settings.<name>`` over it."""
    if cfg.stage.name == name:
        return cfg.stage
    return stage_settings_node(name, cfg.settings.get(name) or {})


def _gamma(cfg: DictConfig, drafter: ModelShape) -> int:
    node = cfg.model.drafter
    if drafter.kind == "dflash":
        return int(node.block_size) - 1
    return int(cfg.method.gamma or node.gamma)


def _gib(n: float) -> str:
    return f"{n / mem.GIB:.1f} GiB"


# ---------------------------------------------------------------------------------------------------- distill
def plan_distill(cfg: DictConfig, shapes: Shapes) -> StagePlan:
    t, m, c = cfg.trainer, cfg.method, cfg.cluster
    d = shapes["drafter"]
    n = world(cfg)
    gamma = _gamma(cfg, d)
    a = assumptions(cfg)
    prompt, completion = a.prompt_tokens, cfg.data.max_new_tokens
    seq = prompt + completion
    w = min(t.windows_per_seq, max(1, completion // t.stride))  # data.py caps W at a trajectory's offsets
    mb = t.micro_batch_size
    slots = mb * w * gamma
    dflash = d.kind == "dflash"
    online_teacher = m.loss in TEACHER_LOSSES and m.teacher == "online"
    needs_verifier = online_teacher or (dflash and m.features == "online")
    if dflash:  # every window is one block of a packed forward over the verifier's context rows (alignment/dflash.py)
        rows, length = mb, seq + w * (gamma + 1)
        layout = f"{w} blocks of {gamma + 1} packed after {seq} context rows"
    elif cfg.model.drafter.attention == "prefix_causal":  # windows packed after the clean sequence (windows.py)
        rows, length = mb, seq + w * gamma
        layout = f"{w} windows of {gamma} packed after {seq} tokens"
    else:  # full attention: the prefix would see the window, so one window per row (data.unpack_windows)
        rows, length = mb * w, seq + gamma
        layout = f"{w} windows of {gamma}, one per row of up to {seq + gamma} tokens"
    tokens = rows * length

    if t.lora.enabled:
        trainable = d.with_lora(t.lora.r, list(t.lora.targets)).lora_params
    elif t.freeze_embeddings and not dflash:
        trainable = d.params - d.embedding
    else:
        trainable = None
    states = mem.model_states(d, zero_stage=t.zero_stage, world=n, precision=t.precision, trainable=trainable)
    if t.lora.enabled:  # the adapters are weights beside the frozen base (whose count they are not part of)
        states["weights"] += (4 if t.precision == "fp32" else 2) * trainable
    act_scale = 2 if t.precision == "fp32" else 1  # the formulas count bf16 activations
    # on a CPU, SDPA keeps an additive bias of the mask per layer (memory.attention_mask_bytes)
    bias_layers = (1 if t.activation_checkpointing else d.layers) if c.name == "cpu" else None
    memory = {
        "weights": states["weights"],
        "gradients": states["gradients"],
        "optimizer states": states["optimizer"],
        "activations": act_scale * mem.activations(d, tokens=tokens, checkpointing=t.activation_checkpointing),
        "attention masks": mem.attention_mask_bytes(
            rows=rows, length=length, explicit=True, bias_layers=bias_layers, bias_bytes=2 * act_scale
        ),
        # a DFlash drafter reads out through the verifier's head, which has the same width and vocabulary
        "label log-probs": mem.label_logprob_bytes(d, slots=slots, teacher=online_teacher),
    }
    notes = [f"windows: micro batch {mb} x {layout}; {slots} label slots per micro batch"]
    verifier = shapes["verifier"] if needs_verifier or heldout(cfg) else None
    if needs_verifier:
        v = verifier
        memory["teacher weights"] = mem.frozen_weights(v, zero_stage=t.zero_stage, world=n)
        memory["teacher activations"] = mem.layer_working_bytes(v) * mb * seq
        why = "the online teacher" if online_teacher else "the online DFlash features"
        notes.append(f"verifier {v.name} runs a no-grad forward per micro batch for {why}")
    elif m.loss in TEACHER_LOSSES:
        k = max(1, cfg.data.topk_logprobs)
        memory["stored top-k"] = slots * k * 12  # int64 ids + fp32 log-probs per slot
    if dflash:
        ids = d.feature_size // max(1, shapes["verifier"].hidden)
        memory["DFlash features"] = mem.feature_bytes(tokens=mb * seq, layers=ids, hidden=shapes["verifier"].hidden)
    if heldout(cfg) and not needs_verifier:
        memory["held-out verifier (rank 0)"] = mem.frozen_weights(
            verifier, zero_stage=0, world=1, devices=devices_of(cfg, "verifier")
        )
        notes.append(
            f"rank 0 holds the verifier {verifier.name} for the held-out check every {t.eval_every} steps "
            "(trainer.eval_prompts=0 leaves it out)"
        )

    # time: FLOPs of one optimizer step on one rank, or ZeRO's collectives, the longer
    micro = t.grad_accum
    context = length if cfg.model.drafter.attention == "full" else length / 2
    flops = micro * timing.train_flops(
        d, tokens=tokens, context=context, slots=slots, checkpointing=t.activation_checkpointing,
        frozen=bool(t.lora.enabled),
    )  # fmt: skip
    if needs_verifier:
        flops += micro * timing.forward_flops(
            verifier, tokens=mb * seq, context=seq / 2, slots=slots if online_teacher else 0, head=online_teacher
        )
    gemms = gemm_precision(cfg)
    compute = timing.seconds(flops, c, mfu(cfg), gemms)
    element = 2 if t.precision == "bf16" else 4  # an fp32 trainer's gradients and weights are fp32, autocast or not
    comm_bytes = timing.zero_comm_bytes(trainable or d.params, zero_stage=t.zero_stage, world=n, element_bytes=element)
    comm = comm_bytes / (timing.link_gbps(c) * 1e9)
    step = max(compute, comm)
    bound = "compute" if compute >= comm else "communication"
    notes.append(
        f"step: {flops / 1e12:.0f} TFLOP per rank in {gemms} at MFU {mfu(cfg):.2f} of "
        f"{timing.peak_tflops(c, gemms):.4g} TFLOP/s = {timing.human_seconds(compute)}; "
        f"ZeRO-{t.zero_stage} moves {comm_bytes / 1e9:.1f} GB per rank at {timing.link_gbps(c):.0f} GB/s = "
        f"{timing.human_seconds(comm)}; {bound} bound"
    )

    saves = -(-t.max_steps // t.save_every)  # every save_every steps, the last at max_steps
    kept = saves if t.keep_last is None else min(saves, t.keep_last)
    exports = saves if t.keep_exports is None else min(saves, t.keep_exports)
    # fp32 weights and two moments (12 B a parameter, memory.py's model states); bf16 adds an fp32 master copy (14)
    ds_bytes = d.params * (14 if t.precision == "bf16" else 12)
    if trainable is not None:
        ds_bytes = 2 * d.params + 12 * trainable
    disk = {
        "DeepSpeed checkpoints": kept * ds_bytes,
        "exports": (exports + 1) * d.params * d.dtype_bytes,  # checkpoints/step-* and the final drafter/
    }
    notes.append(
        f"disk: {kept} DeepSpeed checkpoint(s) (trainer.keep_last) of {ds_bytes / 1e9:.1f} GB, "
        f"{exports} export(s) (trainer.keep_exports) + drafter/ of {d.params * d.dtype_bytes / 1e9:.1f} GB"
    )
    what = (
        f"drafter {d.name} ({d.params / 1e9:.2f}B, {t.precision}), ZeRO-{t.zero_stage} over {n} GPUs, "
        f"activation checkpointing {'on' if t.activation_checkpointing else 'off'}, method {m.loss}"
    )
    return StagePlan("distill", what, memory, disk, step, "optimizer step", step * t.max_steps, n, usable(cfg), notes)


def heldout(cfg: DictConfig) -> bool:
    t = cfg.trainer
    return bool(t.eval_prompts and t.eval_sources)


# --------------------------------------------------------------------------------------------- decoding stages
def _decode(
    cfg: DictConfig, shape: ModelShape, role: str, *, batch: int, prompt: int, new: int, sequences: int, workers: int
) -> tuple[dict[str, int], float, float, list[str]]:
    """Memory, batch seconds and stage seconds of decoding ``sequences`` rows with ``shape`` at ``batch``: weights
    (split over the role's devices), a static KV cache for prompt + new positions, a prefill's transient; each
    step reads all weights and the cache (memory bound at small batches)."""
    c, s = cfg.cluster, assumptions(cfg)
    dev = devices_of(cfg, role)
    kv = mem.kv_cache(shape, batch=batch, positions=prompt + new)
    memory = {
        f"{role} weights": mem.frozen_weights(shape, zero_stage=0, world=1, devices=dev),
        f"{role} KV cache": math.ceil(kv / dev),
        "prefill": mem.prefill_bytes(shape, batch=batch, prompt=prompt),
    }
    # one device computes at a time (models/placement.py): a placed model reads all its bytes in sequence
    read = shape.params * shape.dtype_bytes + mem.kv_cache(
        shape, batch=batch, positions=prompt + new // 2, static=False
    )
    step_flops = timing.forward_flops(shape, tokens=batch, context=prompt + new / 2, slots=batch)
    step = timing.decode_step_seconds(
        bytes_read=read, flops=step_flops, cluster=c, bandwidth_efficiency=s.bandwidth_efficiency, mfu=mfu(cfg)
    )
    prefill = timing.seconds(
        timing.forward_flops(shape, tokens=batch * prompt, context=prompt / 2, slots=batch), c, mfu(cfg)
    )
    per_batch = prefill + new * step
    batches = math.ceil(sequences / batch / max(1, workers))
    notes = [
        f"{role} {shape.name}: decode step reads {read / 1e9:.1f} GB at {s.bandwidth_efficiency:.0%} of "
        f"{c.hbm_gbps:.0f} GB/s = {timing.human_seconds(step)}; {batches} batch(es) of {batch} per worker x "
        f"({new} steps + prefill) on {workers} worker(s) of {dev} GPU(s)"
    ]
    return memory, per_batch, batches * per_batch, notes


def trajectory_batch(cfg: DictConfig) -> int:
    """The rows stage=trajectories decodes together on the planned GPUs: ``data.batch_size``, or with it unset
    (chosen from free memory at run time) the GPU cap of that choice; the plan then says whether it fits."""
    return cfg.data.batch_size or AUTO_BATCH_CAP["cuda"]


def plan_trajectories(cfg: DictConfig, shapes: Shapes) -> StagePlan:
    data = cfg.data
    v = shapes["verifier"]
    a = assumptions(cfg)
    prompt, new = a.prompt_tokens, data.max_new_tokens
    rows = (data.max_prompts or a.prompts) * data.samples_per_prompt
    dev = devices_of(cfg, "verifier")
    # launcher=ray: one worker per verifier copy over the whole cluster; in process: one
    workers = max(1, world(cfg) // dev) if cfg.launcher.name == "ray" else 1
    batch = trajectory_batch(cfg)
    memory, per_batch, seconds, notes = _decode(
        cfg, v, "verifier", batch=batch, prompt=prompt, new=new, sequences=rows, workers=workers
    )
    if data.feature_layers:
        memory["DFlash features"] = mem.feature_bytes(
            tokens=batch * (prompt + new), layers=len(data.feature_layers), hidden=v.hidden
        )
    tokens = rows * (prompt + new)
    disk = {"trajectory shards": tokens * 4}  # int32 token ids in parquet (before compression)
    if data.topk_logprobs:
        disk["top-k teachers"] = rows * new * data.topk_logprobs * 8  # an int32 id and an fp32 log-prob per rank
    refusal = None
    if data.feature_layers:
        disk["features"] = mem.feature_bytes(tokens=tokens, layers=len(data.feature_layers), hidden=v.hidden)
        if disk["features"] > data.max_feature_gb * 1e9:
            refusal = (
                f"the features take {disk['features'] / 1e9:.0f} GB, past data.max_feature_gb={data.max_feature_gb} "
                "(the stage refuses before any work)"
            )
    if workers == 1 and world(cfg) > dev:
        notes.append(f"launcher=ray would run {world(cfg) // dev} workers over the cluster instead of one")
    what = f"verifier {v.name} ({v.params / 1e9:.2f}B) on {dev} GPU(s), {rows} rows of {prompt} + {new} tokens"
    return StagePlan(
        "trajectories", what, memory, disk, per_batch, "batch", seconds, workers * dev, usable(cfg), notes, refusal
    )


def plan_evaluate(cfg: DictConfig, shapes: Shapes) -> StagePlan:
    s = settings_of(cfg, "evaluate")
    v, d = shapes["verifier"], shapes["drafter"]
    a = assumptions(cfg)
    prompt, new, batch = a.prompt_tokens, s.max_new_tokens, s.batch_size
    rows = (len(s.methods) or a.eval_methods) * len(s.temperatures) + len(s.k_grid) * len(s.drafter_temperature_grid)
    sequences = rows * len(s.benchmarks) * s.prompts
    # vanilla decoding bounds every row from above: a speculative row takes fewer verifier steps
    memory, per_batch, seconds, notes = _decode(
        cfg, v, "verifier", batch=batch, prompt=prompt, new=new, sequences=sequences, workers=1
    )
    gamma = _gamma(cfg, d)
    # a DFlash drafter's parameters are its layers only: it drafts with the verifier's embedding and head
    memory["drafter weights"] = d.params * d.dtype_bytes
    memory["drafter KV cache"] = mem.kv_cache(d, batch=batch, positions=prompt + new + gamma)
    notes.append(
        f"{rows} rows (methods x temperatures + the K x drafter-temperature grid) x {len(s.benchmarks)} benchmarks "
        f"x {s.prompts} prompts; each row timed as vanilla decoding, an upper bound"
    )
    what = f"verifier {v.name} + drafter {d.name}, batch {batch}, {sequences} decodes of {new} tokens"
    return StagePlan("evaluate", what, memory, {"results": sequences * new * 8}, per_batch, "batch", seconds, 1,
                     usable(cfg), notes)  # fmt: skip


def _plan_traces(name: str, cfg: DictConfig, shapes: Shapes) -> StagePlan:
    s = settings_of(cfg, name)
    tgt = shapes["target"]
    prompt = assumptions(cfg).prompt_tokens
    # a draft-free block decoder commits at least one token per target forward: as many steps as tokens, at most
    memory, per_batch, seconds, notes = _decode(
        cfg, tgt, "target", batch=s.batch_size, prompt=prompt, new=s.max_new_tokens, sequences=s.prompts, workers=1
    )
    notes.append(f"one target forward per committed token bounds the trace decode; {name}'s own model is small")
    disk = {"traces": s.prompts * s.max_new_tokens * s.top_k * 8}  # top-k ids and probabilities per position
    what = f"target {tgt.name} ({tgt.params / 1e9:.2f}B), {s.prompts} prompts x {s.max_new_tokens} tokens"
    return StagePlan(name, what, memory, disk, per_batch, "batch", seconds, devices_of(cfg, "target"), usable(cfg),
                     notes)  # fmt: skip


def plan_spot(cfg: DictConfig, shapes: Shapes) -> StagePlan:
    return _plan_traces("spot", cfg, shapes)


def plan_spiffy(cfg: DictConfig, shapes: Shapes) -> StagePlan:
    return _plan_traces("spiffy", cfg, shapes)


def plan_sweep(cfg: DictConfig, shapes: Shapes) -> StagePlan:
    """stage=sweep evaluates every export of the experiment's distill runs (Fig. 7) with the evaluate settings, at
    one verifier temperature: the evaluate stage's models and caches, its decodes once per export and run. The
    distill runs it trains first (``settings.sweep.train``) are each a stage=distill plan."""
    s, e, t = settings_of(cfg, "sweep"), settings_of(cfg, "evaluate"), cfg.trainer
    v = shapes["verifier"]
    runs = max(1, len(s.train))
    saves = -(-t.max_steps // t.save_every)
    exports = (saves if t.keep_exports is None else min(saves, t.keep_exports)) + 1  # and the base drafter
    sequences = runs * exports * len(e.benchmarks) * e.prompts
    memory, per_batch, seconds, notes = _decode(
        cfg, v, "verifier", batch=e.batch_size, prompt=assumptions(cfg).prompt_tokens, new=e.max_new_tokens,
        sequences=sequences, workers=1,
    )  # fmt: skip
    d = shapes["drafter"]
    memory["drafter weights"] = d.params * d.dtype_bytes
    memory["drafter KV cache"] = mem.kv_cache(d, batch=e.batch_size, positions=assumptions(cfg).prompt_tokens
                                              + e.max_new_tokens + _gamma(cfg, d))  # fmt: skip
    notes.append(f"{runs} distill run(s) x {exports} checkpoints (exports and the base) x {len(e.benchmarks)} "
                 f"benchmarks x {e.prompts} prompts, timed as vanilla decoding")  # fmt: skip
    what = f"verifier {v.name} + drafter {d.name}, {sequences} decodes of {e.max_new_tokens} tokens"
    return StagePlan("sweep", what, memory, {"history": sequences * 64}, per_batch, "batch", seconds, 1,
                     usable(cfg), notes)  # fmt: skip


# The stages stage=plan knows, by name (one signature: (cfg, shapes) -> StagePlan).
STAGE_PLANNERS: dict[str, Callable[[DictConfig, Shapes], StagePlan]] = {
    "trajectories": plan_trajectories,
    "distill": plan_distill,
    "evaluate": plan_evaluate,
    "spot": plan_spot,
    "spiffy": plan_spiffy,
    "sweep": plan_sweep,
}
