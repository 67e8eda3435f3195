"""Which floating-point precision a model runs in, chosen from what the hardware does natively, never guessed.

bf16 halves the bytes of every weight and activation, and where the hardware multiplies bf16 natively it runs GEMMs
several times faster than fp32 (AMX tiles on Sapphire Rapids and later Xeons, AVX512-BF16 on Cooper Lake, Zen 4 and
later; every NVIDIA GPU from Ampere on). Where bf16 is only emulated (converted to fp32 around every op) it is
slower than fp32 and less exact, so there ``auto`` keeps fp32 for training. A frozen model's forwards are another
matter where the CPU has AVX2 and FMA (the ``avx2`` kind: Zen 2 and 3, Intel before Cooper Lake): there the decode
kernels (``cpu_linear.py``, ``cpu_attention.py``) widen bf16 weights to fp32 in registers, so a bf16 model reads half
the bytes of an fp32 one and sums in fp32, and ``auto`` runs the frozen stages in bf16 (``resolve(frozen=True)``),
for a verifier of at least ``KERNEL_BF16_MIN_PARAMS`` (a smaller one's weights sit in the cache: nothing to halve).
Measured on 2 cores of an AMD EPYC without AVX-512 (SmolLM2-135M, batch 1): a vanilla step of 36 ms in bf16 against
61 in fp32, a 9-token verify window 1.5 steps against 2.1 (``bench/step_costs.py``).

The top-level setting ``precision`` (``auto`` | ``fp32`` | ``bf16``) is the precision of the stages that sample or
score with a frozen model, and of stage=distill's GEMMs (autocast over fp32 weights); ``STAGE_PRECISION`` says which
stage applies it to which role, and ``stage=doctor`` prints what was detected and what each stage will use.
``precision=fp32`` brings back fp32 everywhere; ``precision=bf16`` forces bf16 (with a warning where it is emulated).

A CPU is one of ``CPU_KINDS`` (``Hardware.cpu_kind``): ``amx``, ``avx512_bf16``, ``arm_bf16`` (bf16 native),
``avx2`` (bf16 emulated by torch, widened in registers by the decode kernels) or ``none``, read from its flags.
The environment variable ``STREAKLINE_CPU_KIND`` (``CPU_KIND_ENV``) sets the kind instead, for tests that take
every kind's path on one machine and for users who know better than the flags; ``detect`` reads it in this one
place, so ``precision=auto``, ``stage=doctor`` (which says it was overridden) and ``stage=plan`` all follow it.

    detect("cpu")                      # Hardware("cpu", True, "amx_bf16, avx512_bf16", cpu_kind="amx")
    # STREAKLINE_CPU_KIND=none python launch.py stage=doctor   ->  cpu_kind="none", overridden: auto keeps fp32
    resolve("auto", "cpu")             # "bf16" on such a CPU, "fp32" on one without native bf16
    resolve("auto", "cpu", frozen=True)  # "bf16" there and on an avx2 CPU: what a sampling or decoding stage runs
    torch_dtype("bf16")                # torch.bfloat16
    training_autocast("auto", "fp32")  # bf16 on such a CPU (stage=distill's mixed precision), None elsewhere

Tests: ``pytest tests/models/test_precision.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings

import torch

from streakline.errors import UserError

CHOICES = ("auto", "fp32", "bf16")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# /proc/cpuinfo flags that mean a native bf16 dot product: x86's AMX tiles and AVX512-BF16, arm64's BF16 extension
CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")
# The kinds of CPU that precision tells apart, best first, each with the flag that makes one (``none``: no such flag,
# bf16 is emulated). A kind is what a per-kind choice keys on; ``native_bf16`` follows from it.
CPU_KINDS = {"amx": "amx_bf16", "avx512_bf16": "avx512_bf16", "arm_bf16": "bf16", "avx2": "avx2", "none": None}
# the kinds whose frozen models run bf16 at speed without native bf16: the decode kernels' AVX2 path (cpu_linear.py)
KERNEL_BF16_KINDS = ("avx2",)
# ... for a model at least this large: halving the bytes pays where the weights stream from memory, not where they sit
# in the cache (the tiny world's 8M-parameter verifier, 32 MB in fp32, and the micro world's stay fp32 there)
KERNEL_BF16_MIN_PARAMS = 20_000_000
AVX2_FLAGS = ("avx2", "fma")  # what makes an avx2 CPU: both, as the AVX2 kernels need
CPU_KIND_ENV = "STREAKLINE_CPU_KIND"  # set: the CPU kind, instead of the one the flags say
# The stages that apply ``precision`` and the roles they run with it. stage=distill applies it as mixed precision
# (``training_autocast``, unless trainer.autocast=off): the drafter's and the verifier's forwards and backwards
# under autocast, the weights, the optimizer and the loss reductions in fp32; a bf16 trainer.precision is
# DeepSpeed's own and wins.
# stage=evaluate and stage=decode run the verifier and the drafter in it (a block-diffusion target stays in its preset's
# dtype: the block decoders' check is exact); a T=0 row in bf16 may leave vanilla's output only at a near-tie of the
# verifier's top two logits (evaluation/lossless.py).
STAGE_PRECISION = {
    "trajectories": ("verifier",),
    "distill": ("drafter (autocast over fp32 weights)", "verifier"),
    "evaluate": ("verifier", "drafter"),
    "decode": ("verifier", "drafter"),
}


class PrecisionError(UserError, ValueError):
    """A precision setting that is not one of ``CHOICES``."""


@dataclasses.dataclass(frozen=True)
class Hardware:
    device: str  # "cpu" or "cuda"
    native_bf16: bool
    evidence: str  # what the decision rests on: the CPU flags found, or the GPU's name and compute capability
    cpu_kind: str | None = None  # a CPU's kind (CPU_KINDS); None for another device
    overridden: bool = False  # the kind came from $STREAKLINE_CPU_KIND, not from the flags


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (``flags`` on x86, ``Features`` on arm64); empty elsewhere."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def _torch_says_bf16() -> list[str]:
    """What torch's own CPU probe reports (private helpers, so any may be missing in another version)."""
    found = []
    for name, label in (("_is_amx_tile_supported", "amx_tile"), ("_is_avx512_bf16_supported", "avx512_bf16")):
        probe = getattr(torch.cpu, name, None)
        try:
            if probe is not None and probe():
                found.append(f"{label} (torch)")
        except Exception:  # a probe that fails proves nothing either way
            continue
    return found


def cpu_kind_override() -> str | None:
    """The CPU kind ``$STREAKLINE_CPU_KIND`` sets (None when unset or empty); PrecisionError for a kind not in
    ``CPU_KINDS``."""
    value = os.environ.get(CPU_KIND_ENV, "").strip().lower()
    if not value:
        return None
    if value not in CPU_KINDS:
        raise PrecisionError(
            f"{CPU_KIND_ENV}={value!r} is not a CPU kind; set one of {', '.join(CPU_KINDS)} or unset it to read the "
            "CPU's flags"
        )
    return value


def _kind_of(found: list[str]) -> str:
    """The best kind among the bf16 flags (or torch probe labels) ``found``."""
    # torch's probe says amx_tile where the flags say amx_bf16 (every AMX CPU so far has both)
    labels = {f.removesuffix(" (torch)").replace("amx_tile", "amx_bf16") for f in found}
    return next((kind for kind, flag in CPU_KINDS.items() if flag is None or flag in labels))


def detect(device: str | torch.device = "cpu", flags: frozenset[str] | None = None) -> Hardware:
    """Whether ``device`` multiplies bf16 natively, the evidence and, for a CPU, its kind. ``flags``: CPU flags to
    judge instead of this machine's (tests); without them ``$STREAKLINE_CPU_KIND``, when set, decides the kind."""
    kind = torch.device(device).type
    if kind == "cuda":
        index = torch.device(device).index or 0
        major, minor = torch.cuda.get_device_capability(index)
        name = torch.cuda.get_device_name(index)
        return Hardware("cuda", major >= 8, f"{name}, compute capability {major}.{minor}")
    if kind != "cpu":
        return Hardware(kind, False, f"{kind}: not probed")
    own = flags is None
    flags = cpu_flags() if own else flags
    found = [f for f in CPU_BF16_FLAGS if f in flags]
    if own and not found:  # no /proc/cpuinfo (another OS): torch's probe is the next best evidence
        found = _torch_says_bf16()
    evidence = ", ".join(found) or "no AMX-BF16, AVX512-BF16 or BF16 flag (bf16 would be emulated)"
    if not found and all(f in flags for f in AVX2_FLAGS):
        found, evidence = ["avx2"], f"{evidence}; avx2, fma (the decode kernels widen bf16 in registers)"
    kind = _kind_of(found)
    forced = cpu_kind_override() if own else None
    if forced is not None:
        said = f"{CPU_KIND_ENV}={forced}, overriding the detected {kind} (this machine: {evidence})"
        return Hardware("cpu", _native(forced), said, cpu_kind=forced, overridden=True)
    return Hardware("cpu", _native(kind), evidence, cpu_kind=kind)


def _native(kind: str) -> bool:
    return kind not in ("none", *KERNEL_BF16_KINDS)


def check(setting: str) -> None:
    if setting not in CHOICES:
        raise PrecisionError(f"precision={setting!r} is not one of {', '.join(CHOICES)}; use precision=auto")


def resolve(
    setting: str,
    device: str | torch.device = "cpu",
    hardware: Hardware | None = None,
    frozen: bool = False,
    params: int | None = None,
) -> str:
    """``fp32`` or ``bf16`` for ``setting`` on ``device``: ``auto`` is bf16 exactly where it is native, and for a
    ``frozen`` model (one that samples or scores, never trains) on an ``avx2`` CPU too, where the decode kernels make
    bf16 the faster precision, unless the model is known (``params``) to be under ``KERNEL_BF16_MIN_PARAMS``. A
    forced ``bf16`` where it is neither is honoured with a warning (slower than fp32)."""
    check(setting)
    hw = hardware or detect(device)
    big = params is None or params >= KERNEL_BF16_MIN_PARAMS
    fast = hw.native_bf16 or (frozen and big and hw.cpu_kind in KERNEL_BF16_KINDS)
    if setting == "auto":
        return "bf16" if fast else "fp32"
    if setting == "bf16" and not fast:
        warnings.warn(
            f"precision=bf16 on {hw.device} without native bf16 ({hw.evidence}): it is emulated, slower than fp32 "
            "and less exact; precision=auto picks fp32 here",
            stacklevel=2,
        )
    return setting


def torch_dtype(precision: str) -> torch.dtype:
    """The torch dtype of a resolved precision (``fp32`` or ``bf16``)."""
    return DTYPES[precision]


NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def precision_name(dtype: torch.dtype) -> str:
    """``fp32``, ``bf16`` or ``fp16``: how run keys, the run metadata and the doctor name a dtype."""
    return NAMES[dtype]


def model_dtype(
    setting: str, preset_dtype: str, device: str | torch.device = "cpu", params: int | None = None
) -> torch.dtype:
    """The dtype a frozen model of a preset whose own ``dtype`` is ``preset_dtype`` runs in under ``setting``: the
    resolved precision, except that ``auto`` never raises a preset's half-precision dtype to fp32 (a 70B preset in
    bf16 stays bf16 on hardware without native bf16: fp32 would not fit). ``fp32`` and ``bf16`` are taken as said.
    ``params``: the verifier's size where it is known (``resolve``), None for a checkpoint read from a folder."""
    resolved = resolve(setting, device, frozen=True, params=params)
    if setting == "auto" and resolved == "fp32" and preset_dtype in ("bfloat16", "float16"):
        return {"bfloat16": torch.bfloat16, "float16": torch.float16}[preset_dtype]
    return torch_dtype(resolved)


def training_autocast(
    setting: str,
    trainer_precision: str,
    autocast: str = "auto",
    device: str | torch.device = "cpu",
    hardware: Hardware | None = None,
) -> torch.dtype | None:
    """The autocast dtype stage=distill trains under, or None (no autocast). Only an fp32 trainer autocasts: its
    weights, optimizer state and loss reductions stay fp32 and the GEMMs of the forward and backward run in bf16.
    ``autocast`` (``trainer.autocast``): ``auto`` where the top-level ``setting`` resolves to bf16, ``off`` never,
    ``bf16`` always (with ``resolve``'s warning where it is emulated). A bf16 ``trainer.precision`` is DeepSpeed's
    own mixed precision (bf16 weights, fp32 master copy in the optimizer) and needs no autocast on top."""
    if trainer_precision != "fp32" or autocast == "off":
        return None
    wanted = "bf16" if autocast == "bf16" else setting
    return torch.bfloat16 if resolve(wanted, device, hardware) == "bf16" else None


def report(
    setting: str,
    device: str | torch.device = "cpu",
    trainer_precision: str = "fp32",
    autocast: str = "auto",
    params: int | None = None,
) -> dict[str, object]:
    """What ``stage=doctor`` prints: the hardware, the evidence, the CPU kind (and whether ``$STREAKLINE_CPU_KIND``
    set it), the setting, what it resolves to, and per stage that applies it the roles and the precision they run in
    (distill's from ``trainer.precision`` and ``trainer.autocast`` too)."""
    hw = detect(device)
    resolved = resolve(setting, device, hw, frozen=True, params=params) if setting in CHOICES else None  # frozen
    stages = {stage: {"roles": list(roles), "precision": resolved} for stage, roles in STAGE_PRECISION.items()}
    if trainer_precision != "fp32":  # DeepSpeed's own mixed precision: the weights themselves in half precision
        stages["distill"] = {"roles": ["drafter (DeepSpeed, trainer.precision)"], "precision": trainer_precision}
    elif resolved is not None:
        amp = training_autocast(setting, trainer_precision, autocast, device, hw)
        stages["distill"]["precision"] = "fp32" if amp is None else "bf16"
    return {
        "device": hw.device,
        "native_bf16": hw.native_bf16,
        "evidence": hw.evidence,
        "cpu_kind": hw.cpu_kind,
        "kernel_bf16": hw.cpu_kind in KERNEL_BF16_KINDS,  # frozen models in bf16 on the decode kernels, not natively
        "small": params is not None and params < KERNEL_BF16_MIN_PARAMS,  # ... except a verifier this small
        "overridden": hw.overridden,
        "setting": setting,
        "resolved": resolved,
        "stages": stages,
    }
