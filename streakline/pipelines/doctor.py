"""Stage ``doctor``: report the environment and where each model role would get its weights.

    python launch.py stage=doctor model=tiny
    python launch.py stage=doctor model=diffucoder model.drafter.path=/ckpt/drafter

Nothing is downloaded or built: library versions come from package metadata (no heavy imports except
torch, for the CUDA check), and hub checkpoints are only looked up in the local Hugging Face cache.
"""

import importlib.metadata
import os
import platform
from typing import Any

from omegaconf import DictConfig

from streakline.config.schema import ROLES

from .runner import Stage, StageResult

# Distribution names, as pip knows them, under the label the report shows.
PACKAGES = {
    "torch": "torch",
    "deepspeed": "deepspeed",
    "transformers": "transformers",
    "triton": "triton",
    "ray": "ray",
    "hydra": "hydra-core",
}
TINY_SOURCE = "tiny: built by stage=bootstrap"
PARITY_TOLERANCE = 1e-4  # fp32 logits; the parity tests use the same bound


class Doctor(Stage):
    name = "doctor"
    needs_world = False  # it reports where weights would come from; it builds nothing

    def run(self, cfg: DictConfig, stage_run: None) -> StageResult:
        """``metrics``: ``{"environment": {...}, "roles": {role: {...}}}``."""
        report = {"environment": environment(), "precision": precision_report(cfg), "roles": check_roles(cfg)}
        return StageResult(self.name, metrics=report, details={"model": cfg.model.name})

    def report(self, result: StageResult) -> None:
        print(format_report(result.metrics, model=result.details["model"]))


def environment() -> dict[str, Any]:
    """Versions of python and the main libraries, CUDA visibility, and the Triton interpreter switch."""
    env: dict[str, Any] = {"python": platform.python_version()}
    for label, dist in PACKAGES.items():
        try:
            env[label] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            env[label] = None
    env["cuda_available"], env["cuda_devices"] = _cuda()
    env["triton_interpret"] = os.environ.get("TRITON_INTERPRET")
    return env


def precision_report(cfg: DictConfig) -> dict[str, Any]:
    """What the hardware multiplies natively and the precision each stage that applies ``precision`` will use
    (``models/precision.py``), on the device the stages would run on."""
    from streakline.models.precision import report

    from .common.lookup import verifier_params
    from .common.roles import device

    t = cfg.trainer
    found = report(cfg.precision, device(), t.precision, t.autocast, params=verifier_params(cfg))
    return {**found, "trainer": t.precision, "autocast": t.autocast}


def _cuda() -> tuple[bool, int]:
    try:
        import torch
    except ImportError:
        return False, 0
    available = torch.cuda.is_available()
    return available, torch.cuda.device_count() if available else 0


def check_roles(cfg: DictConfig) -> dict[str, dict[str, Any]]:
    """Describe each role's checkpoint preset and where its weights would come from.

    For a role whose architecture is known here (a tiny preset, or a checkpoint folder on this machine) the entry
    also gets its parameter count; a tiny preset is built with fresh weights and checked against
    ``transformers`` (``parity_max_abs``: largest logit difference under the role's attention mode).
    """
    roles = {}
    for role in ROLES:
        node = cfg.model[role]
        source, available = weights_source(node)
        if source == TINY_SOURCE and node.kind == "dflash":  # not a model of the world's: stage=distill trains it
            source = "from scratch: a DFlash drafter, trained by stage=distill"
        roles[role] = {
            "preset": node.name,
            "family": node.family,
            "attention": node.attention,
            "shift": node.shift,
            "gamma": node.gamma,
            "weights": source,
            "available": available,
        }
        imported = node.get("source") is not None and node.path is None  # nothing to probe until it is imported
        roles[role].update(probe_model(node, role) if available and not imported else {})
    return roles


def probe_model(node: DictConfig, role: str) -> dict[str, Any]:
    """Parameter count (from config.json for a folder: no weights are read) and, for a tiny preset, a parity check
    of freshly initialised weights against ``transformers``."""
    from streakline.models import (
        CheckpointError,
        build,
        dflash_config,
        is_dflash,
        locate,
        read_config,
        transformers_max_diff,
    )
    from streakline.models.checkpoint import folder_family

    try:
        if is_dflash(node, role):
            return _probe_dflash(dflash_config(node, role, mask_token_id=0))  # the shapes only
        folder = locate(node, role)
        if folder is not None:
            family = folder_family(folder, node.family)
            return {"parameters": read_config(folder, family).num_parameters(), "family": family}
        model = build(node, role, dtype="float32").eval()
        return {"parameters": model.config.num_parameters(), "parity_max_abs": transformers_max_diff(model)}
    except CheckpointError as err:
        return {"problem": str(err)}


def _probe_dflash(cfg) -> dict[str, Any]:
    """A DFlash drafter's own parameter count (its embedding and head are the verifier's), counted on the meta device:
    no memory for the weights, whatever their size."""

    from streakline.models.dflash import DFlashModel
    from streakline.models.meta import on_meta

    with on_meta():
        model = DFlashModel(cfg)
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "kind": "dflash",
        "target_layer_ids": list(cfg.target_layer_ids),
        "block_size": cfg.block_size,
    }


def weights_source(node: DictConfig) -> tuple[str, bool]:
    """Where one role's weights come from, in the order the model builder will try: path, hub id, arch.

    Returns a description and whether the weights are on this machine now (a tiny model counts as
    available: it is built, not fetched).
    """
    if node.path is None and node.get("source") is not None:  # model=smol: imported from a package on first use
        from streakline.world.imports import describe_source

        return describe_source(node)
    if node.path is not None:
        exists = os.path.isdir(node.path)
        return f"local: {node.path} ({'exists' if exists else 'missing'})", exists
    if node.hub_id is not None:
        cached = _in_hf_cache(node.hub_id)
        where = "in the local HF cache" if cached else "not in the local HF cache; nothing is downloaded unless asked"
        return f"hub: {node.hub_id} ({where})", cached
    return TINY_SOURCE, True


def _in_hf_cache(hub_id: str) -> bool:
    # Checks for config.json only: enough to say the snapshot was fetched, without walking the weights.
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    return isinstance(try_to_load_from_cache(hub_id, "config.json"), str)


def format_report(report: dict[str, Any], model: str) -> str:
    env = report["environment"]
    lines = ["streakline doctor", "environment"]
    for key in ("python", *PACKAGES):
        lines.append(f"  {key:<18} {env[key] or 'not installed'}")
    cuda = f"yes ({env['cuda_devices']} devices)" if env["cuda_available"] else "no"
    lines.append(f"  {'cuda':<18} {cuda}")
    lines.append(f"  {'TRITON_INTERPRET':<18} {env['triton_interpret'] or 'unset'}")
    precision = report.get("precision")
    if precision is not None:
        native = "native" if precision["native_bf16"] else "emulated"
        lines.append(f"precision ({precision['device']}: bf16 {native}: {precision['evidence']})")
        if precision.get("cpu_kind") is not None:
            from streakline.models.precision import CPU_KIND_ENV

            how = f"overridden by ${CPU_KIND_ENV}" if precision["overridden"] else f"detected; ${CPU_KIND_ENV} sets it"
            lines.append(f"  {'cpu kind':<18} {precision['cpu_kind']} ({how})")
        lines.append(f"  {'setting':<18} precision={precision['setting']} -> {precision['resolved']}")
        for stage, use in precision["stages"].items():
            lines.append(f"  {stage:<18} {', '.join(use['roles'])} in {use['precision']}")
            if stage == "distill":  # what distill's line follows
                trainer = f"trainer.precision={precision['trainer']} trainer.autocast={precision['autocast']}"
                lines.append(f"  {'':<18} the trainer: {trainer}")
        if precision.get("kernel_bf16") and precision.get("small") and precision["setting"] == "auto":
            lines.append(
                f"  {'':<18} fp32 kept: this verifier is under 20M parameters, its weights sit in the cache, so the "
                "AVX2 decode kernels' bf16 gains nothing here (a larger model's frozen stages run bf16)"
            )
        elif precision.get("kernel_bf16") and precision["setting"] == "auto":
            lines.append(
                f"  {'':<18} frozen models in bf16 on the AVX2 decode kernels (bf16 widened in registers: half the "
                "bytes of fp32); training keeps fp32, bf16 would be emulated there; precision=fp32 keeps fp32"
            )
        elif not precision["native_bf16"] and precision["setting"] == "auto":
            lines.append(
                f"  {'':<18} fp32 kept: bf16 would be emulated here (slower than fp32); precision=bf16 forces it"
            )
    lines.append(f"roles (model={model})")
    for role, info in report["roles"].items():
        lines.append(
            f"  {role:<9} {info['preset']:<15} family={info['family']} attention={info['attention']} "
            f"shift={str(info['shift']).lower()} gamma={info['gamma']}"
        )
        lines.append(f"  {'':<9} weights: {info['weights']}")
        if "parameters" in info:
            lines.append(f"  {'':<9} parameters: {info['parameters'] / 1e6:.2f}M")
        if "parity_max_abs" in info:
            verdict = "ok" if info["parity_max_abs"] < PARITY_TOLERANCE else "MISMATCH"
            lines.append(
                f"  {'':<9} parity with transformers (fresh weights): max |logit diff| "
                f"{info['parity_max_abs']:.1e} ({verdict})"
            )
        if "problem" in info:
            lines.append(f"  {'':<9} problem: {info['problem']}")
    return "\n".join(lines)


STAGE = Doctor()
