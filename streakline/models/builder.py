"""From a checkpoint preset (``model.verifier``, ``model.drafter``, ``model.target``) to a model.

An explicit builder, ``streakline.models.build``.

A preset names where the weights live and how the model behaves (see ``conf/checkpoint/``). ``locate`` finds the
folder: ``path`` if set, else ``hub_id`` in the local Hugging Face cache (nothing is downloaded: the error says
how to fetch it), else ``None`` for a tiny preset that carries an ``arch`` block and is built from scratch.
``build`` returns the ``Transformer`` with the preset's attention mode, shift and block size applied, on ``device``,
or across the devices the preset's ``devices`` names (``models/placement.py``; the plan is printed first).

    model = build(cfg.model.drafter, role="drafter", dtype=torch.bfloat16, device="cuda")
    model = build(cfg.model.verifier, role="verifier", device="cuda", inference=True)   # frozen, fused on a GPU
    model = build(cfg.model.verifier, role="verifier", dtype=torch.bfloat16)   # with model.verifier.devices=auto
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .checkpoint import CheckpointError, folder_family, load_pretrained, read_config
from .config import SHAPE_FIELDS, TransformerConfig
from .placement import place, plan_for, resolve_devices
from .transformer import Transformer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _get(preset: Any, key: str, default=None):
    return getattr(preset, key, default) if not isinstance(preset, dict) else preset.get(key, default)


def locate(preset: Any, role: str = "verifier") -> Path | None:
    """Folder holding the preset's weights, or None for a from-scratch (tiny) preset."""
    path, hub_id, arch = _get(preset, "path"), _get(preset, "hub_id"), _get(preset, "arch")
    if path:
        folder = Path(path).expanduser()
        if not (folder / "config.json").is_file():
            raise CheckpointError(
                f"model.{role}.path={path} is not a checkpoint folder (no config.json there); "
                "point it at a folder written by save_pretrained or a stage of this pipeline"
            )
        return folder.absolute()
    if hub_id:
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(hub_id, local_files_only=True))
        except Exception as e:  # the hub client raises several types for "not cached"
            raise CheckpointError(
                f"{hub_id} (model.{role}) is not in the local Hugging Face cache and streakline never downloads at "
                f"run time: fetch it first with `huggingface-cli download {hub_id}`, or set model.{role}.path"
            ) from e
    if arch:
        return None
    raise CheckpointError(f"model.{role} names no path, hub_id or arch: set model.{role}.path to a checkpoint folder")


def arch_config(preset: Any) -> TransformerConfig:
    """TransformerConfig of a from-scratch preset: its ``arch`` block plus its behaviour keys."""
    arch = _get(preset, "arch")
    fields = {k: _get(arch, k) for k in _ARCH_KEYS if _get(arch, k) is not None}
    return TransformerConfig(**fields, **_behaviour(preset))


_ARCH_KEYS = ("vocab_size", *SHAPE_FIELDS, "rope_theta", "rms_norm_eps", "max_position_embeddings")


def _behaviour(preset: Any) -> dict:
    out = {"attention": _get(preset, "attention", "causal"), "shift": bool(_get(preset, "shift", False))}
    if _get(preset, "block_size"):
        out["block_size"] = _get(preset, "block_size")
    family = _get(preset, "family")
    if family and family != "auto":
        out["family"] = family
    return out


def _tokenizer_id(folder, token: str) -> int | None:
    from .tokenizer import has_tokenizer, load_tokenizer

    return load_tokenizer(folder).get_vocab().get(token) if has_tokenizer(folder) else None


def build(
    preset: Any,
    role: str = "verifier",
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str = "cpu",
    seed: int = 0,
    inference: bool = False,
) -> Transformer:
    """The model a preset describes: loaded from its folder, or freshly initialised (seeded) when it is tiny; on
    ``device``, or placed across the preset's ``devices`` when it names more than one.

    ``inference``: frozen and in eval mode, and on one GPU its q/k/v and gate/up projections fused
    (``Transformer.fuse_projections``: fewer, larger matmuls per decode step). On a CPU the weights stay as the
    checkpoint has them, so CPU results do not move by a rounding."""
    model = _build(preset, role, dtype=dtype, device=device, seed=seed)
    if inference:
        model.eval().requires_grad_(False)
        if model.layer_devices is None and model.embed.weight.device.type == "cuda":
            model.fuse_projections()
    return model


def _build(preset: Any, role: str, *, dtype, device, seed: int) -> Transformer:
    if isinstance(dtype, str) or dtype is None:
        dtype = DTYPES[dtype or _get(preset, "dtype", "float32")]
    devices = _get(preset, "devices")
    spread = devices is not None and len(resolve_devices(devices)) > 1
    where = "cpu" if spread else device  # a placed model is read into host memory, then moved layer run by run
    folder = locate(preset, role)
    if folder is None:
        model = Transformer(arch_config(preset)).init_weights(seed=seed).to(device=where, dtype=dtype)
    else:
        behaviour = _behaviour(preset)
        # A folder says what it is: its config.json decides the weight layout; the preset's family is the fallback.
        family = folder_family(folder, behaviour.pop("family", None))
        if spread:  # the plan (and a refusal with sizes) before the weights are read
            plan = plan_for(read_config(folder, family), devices, dtype)
        model = load_pretrained(folder, family=family, dtype=dtype, device=where, **behaviour)
        if model.config.mask_token_id is None and _get(preset, "mask_token"):
            # a checkpoint whose config.json names no mask id (a plain transformers save): its tokenizer's id of
            # the preset's mask token, when it has one (distill adds the token to a tokenizer that lacks it)
            model.config.mask_token_id = _tokenizer_id(_get(preset, "tokenizer") or folder, _get(preset, "mask_token"))
    if not spread:
        return model
    if folder is None:
        plan = plan_for(model.config, devices, dtype)
    print(f"model.{role}: {plan.describe()}")
    return place(model, plan)
