"""From a checkpoint preset (``model.verifier``, ``model.drafter``, ``model.target``) to a model.

An explicit builder, ``streakline.models.build``.

A preset names where the weights live and how the model behaves (see ``conf/checkpoint/``). ``locate`` finds the
folder: ``path`` if set, else ``hub_id`` in the local Hugging Face cache (nothing is downloaded: the error says
how to fetch it), else ``None`` for a tiny preset that carries an ``arch`` block and is built from scratch.
``build`` returns the ``Transformer`` with the preset's attention mode, shift and block size applied, on ``device``,
or across the devices the preset's ``devices`` names (``models/placement.py``; the plan is printed first).

A DFlash preset (``kind: dflash``), or a ``path`` whose folder holds a DFlash drafter (``is_dflash``), builds a
``DFlashModel`` instead: ``load_dflash(folder)``, or from its ``arch`` block, seeded. It owns no embedding or head,
so the caller shares the verifier's before any forward (``drafter.share(verifier)``; a forward without it says so).
``CHECKPOINT_KINDS`` registers the model class of each kind (``Transformer.kind``, ``DFlashModel.kind``), and
``checkpoint_kind(preset)`` says which one a preset or folder builds, without reading weights.

    model = build(cfg.model.drafter, role="drafter", dtype=torch.bfloat16, device="cuda")
    model = build(cfg.model.verifier, role="verifier", device="cuda", inference=True)   # frozen, fused on a GPU
    model = build(cfg.model.verifier, role="verifier", dtype=torch.bfloat16)   # with model.verifier.devices=auto
    drafter = build(cfg.model.drafter, "drafter").share(verifier)                # model.drafter=micro-dflash
    checkpoint_kind(cfg.model.drafter, "drafter")                                # "transformer" or "dflash"
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from . import cpu_linear
from .checkpoint import CheckpointError, folder_family, load_pretrained, read_config
from .config import SHAPE_FIELDS, TransformerConfig
from .dflash import DFlashConfig, DFlashModel
from .dflash_checkpoint import is_dflash_folder, load_dflash, read_dflash_config
from .placement import place, plan_for, resolve_devices
from .transformer import Transformer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# What a preset builds, by its kind (config/schema.py:CHECKPOINT_KINDS repeats the names; tests/test_registries.py
# keeps the two equal).
CHECKPOINT_KINDS: dict[str, type[Transformer] | type[DFlashModel]] = {m.kind: m for m in (Transformer, DFlashModel)}


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
) -> Transformer | DFlashModel:
    """The model a preset describes: loaded from its folder, or freshly initialised (seeded) when it is tiny; on
    ``device``, or placed across the preset's ``devices`` when it names more than one. A ``Transformer``, or for a
    DFlash preset or folder (``is_dflash``) a ``DFlashModel``, which drafts only after ``share(verifier)``.

    ``inference``: frozen and in eval mode, and on one GPU its q/k/v and gate/up projections fused
    (``Transformer.fuse_projections``: fewer, larger matmuls per decode step). On a CPU a bf16 model's Linear layers
    take the skinny decode kernel where this CPU runs it (``cpu_linear.py``), fused as well, since that kernel gives
    a fused matrix's rows exactly what the separate ones give; elsewhere on a CPU the weights stay as the checkpoint
    has them, so CPU results do not move by a rounding."""
    dtype = _dtype(preset, dtype)
    make = _build_dflash if is_dflash(preset, role) else _build
    model = make(preset, role, dtype=dtype, device=device, seed=seed)
    if inference:
        model.eval().requires_grad_(False)
        # a DFlash drafter's parameters are its layers' (the embedding is the verifier's, shared later)
        on = next(model.parameters()).device.type
        if model.layer_devices is None and on == "cuda":
            model.fuse_projections()
        elif on == "cpu" and dtype == torch.bfloat16 and cpu_linear.available():
            cpu_linear.use_kernels(model.fuse_projections())
    return model


def _dtype(preset: Any, dtype: torch.dtype | str | None) -> torch.dtype:
    if isinstance(dtype, str) or dtype is None:
        return DTYPES[dtype or _get(preset, "dtype", "float32")]
    return dtype


def _build(preset: Any, role: str, *, dtype: torch.dtype, device, seed: int) -> Transformer:
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


def checkpoint_kind(preset: Any, role: str = "drafter") -> str:
    """Which of ``CHECKPOINT_KINDS`` ``preset`` builds: ``"dflash"`` for a DFlash preset or folder (``is_dflash``),
    else ``"transformer"``. Reads at most the folder's config.json, never weights or a tokenizer."""
    return DFlashModel.kind if is_dflash(preset, role) else Transformer.kind


# ------------------------------------------------------------------------------------------------- DFlash drafters
def is_dflash(preset: Any, role: str = "drafter") -> bool:
    """Whether ``preset`` builds a DFlash drafter: it says ``kind: dflash``, or its weights folder (``path``, or a
    cached ``hub_id``) is a DFlash checkpoint (``models/dflash_checkpoint.py``, either format)."""
    if _get(preset, "kind", "transformer") == "dflash":
        return True
    if not (_get(preset, "path") or _get(preset, "hub_id")):
        return False
    try:
        folder = locate(preset, role)
    except CheckpointError:
        return False  # not there: building it says why
    return folder is not None and is_dflash_folder(folder)


def dflash_config(preset: Any, role: str = "drafter", *, mask_token_id: int | None = None) -> DFlashConfig:
    """The ``DFlashConfig`` a DFlash preset builds, without reading weights: its folder's ``config.json``, or for a
    from-scratch preset its ``arch`` block, ``target_layer_ids``, ``block_size`` and the id of ``mask_token`` in its
    ``tokenizer`` (the verifier's; ``mask_token_id`` instead, for a caller that only wants the shapes). A
    ``kind: dflash`` preset whose folder disagrees with it is refused."""
    folder = locate(preset, role)
    name = _get(preset, "name")
    if folder is not None:
        if not is_dflash_folder(folder):
            raise CheckpointError(
                f"model.{role} ({name}) is a DFlash preset but {folder} holds no DFlash drafter (its config.json has "
                f"no speculators_model_type 'dflash' or dflash_config); point model.{role}.path at a DFlash export"
            )
        cfg = read_dflash_config(folder)
        if _get(preset, "kind", "transformer") == "dflash":
            _check_agrees(preset, role, cfg, folder)
        return cfg
    token = _get(preset, "mask_token")
    tokenizer = _get(preset, "tokenizer")
    mask_id = mask_token_id
    if mask_id is None and token and tokenizer:
        mask_id = _tokenizer_id(tokenizer, token)
    if mask_id is None:
        raise CheckpointError(
            f"model.{role} ({name}) is a DFlash drafter built from scratch, which fills its blocks with the "
            f"verifier's mask token: set model.{role}.mask_token to a token of the verifier's tokenizer and "
            f"model.{role}.tokenizer to that tokenizer's folder (a world's stages set it; now {token!r} in "
            f"{tokenizer})"
        )
    arch = _get(preset, "arch")
    fields = {k: _get(arch, k) for k in _ARCH_KEYS if _get(arch, k) is not None}
    # the layers are Qwen3's whatever the verifier's family (full attention within a block); no embedding to tie
    fields.update(family="qwen3", attention="full", tie_embeddings=False, mask_token_id=mask_id)
    layers = TransformerConfig(**fields)
    return DFlashConfig(
        layers=layers,
        target_layer_ids=tuple(_get(preset, "target_layer_ids") or ()),
        block_size=int(_get(preset, "block_size") or 0),
        mask_token_id=mask_id,
    )


def _check_agrees(preset: Any, role: str, cfg: DFlashConfig, folder: Path) -> None:
    """A ``kind: dflash`` preset names the drafter it expects; a folder holding another is refused, not run."""
    want = {
        "block_size": _get(preset, "block_size"),
        "target_layer_ids": tuple(_get(preset, "target_layer_ids") or ()) or None,
    }
    have = {"block_size": cfg.block_size, "target_layer_ids": cfg.target_layer_ids}
    arch = _get(preset, "arch")
    for k in ("hidden_size", "num_layers", "vocab_size"):
        want[f"arch.{k}"] = _get(arch, k) if arch is not None else None
        have[f"arch.{k}"] = getattr(cfg.layers, k)
    wrong = [f"{k}={want[k]} (the folder: {have[k]})" for k in want if want[k] is not None and want[k] != have[k]]
    if wrong:
        raise CheckpointError(
            f"model.{role} ({_get(preset, 'name')}) expects a DFlash drafter with {', '.join(wrong)}, but {folder} "
            f"holds another; use the preset made for that drafter, or override those fields (model.{role}.<field>)"
        )


def _build_dflash(preset: Any, role: str, *, dtype: torch.dtype, device, seed: int) -> DFlashModel:
    devices = _get(preset, "devices")
    if devices is not None and len(resolve_devices(devices)) > 1:
        raise CheckpointError(
            f"model.{role}.devices={devices}: a DFlash drafter is a few layers and runs on one device; set "
            f"model.{role}.devices=null"
        )
    cfg = dflash_config(preset, role)
    folder = locate(preset, role)
    if folder is not None:
        return load_dflash(folder, dtype=dtype, device=device)
    return DFlashModel(cfg).init_weights(seed=seed).to(device=device, dtype=dtype)
