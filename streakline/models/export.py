"""The drop-in export: a model written as a copy of the checkpoint folder it was loaded from, with only the weights
replaced, so ``transformers`` loads it exactly as it loads the original (``docs/models.md``, Checkpoints).

    export_like(model, "runs/x/distill/<hash>/checkpoints/step-000500", source, tokenizer=tok, provenance={...})

``checkpoint.py`` reads and writes the weight layouts; this module decides what else of the source folder an
export keeps (its config.json, dtype, shard files, tokenizer and remote-code files) and records where it came from
(``streakline.json``). Tests: ``tests/models/test_checkpoint_export.py``.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import torch

from .checkpoint import (
    CheckpointError,
    StagedFolder,
    _save_sharded,
    copy_files,
    load_state,
    read_config,
    save_weights,
    weight_names,
)
from .config import SHAPE_FIELDS
from .transformer import Transformer

# Files that hold a checkpoint's weights, in any framework, or their index: never copied into an export, where they
# would be stale weights beside the new ones (or an index naming shards that are not there). Hidden files
# (.gitattributes, a download's .cache/) describe the source's copy, not the export.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".index.json")
PROVENANCE_NAME = "streakline.json"
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def export_like(
    model: Transformer,
    folder: str | os.PathLike,
    source: str | os.PathLike,
    *,
    tokenizer=None,
    provenance: dict | None = None,
) -> Path:
    """Write ``model`` as a copy of the checkpoint folder ``source`` with only the weights replaced, atomically.

    Every file and subfolder of ``source`` but its weights is copied; ``config.json`` is the source's, key for key,
    with ``vocab_size`` set to the model's; the weights take the source's dtype (its ``config.json`` dtype, else its
    tensors', else the model's), tensor names and shard layout (one file, or the same tensors in the same shard
    files). ``tokenizer`` is saved only when ``source`` has none, or when it encodes differently from the source's
    (a token was added). ``provenance`` goes to ``streakline.json`` beside the weights. ``transformers`` then loads
    the export exactly as it loads ``source`` (``trust_remote_code`` and all)."""
    source, folder = Path(source).absolute(), Path(folder).absolute()
    if folder.resolve() == source.resolve() or source.resolve() in folder.resolve().parents:
        raise CheckpointError(
            f"cannot export into {folder}: it is (inside) the source checkpoint {source}; export to another folder"
        )
    cfg = model.config
    src = read_config(source, cfg.family)
    # a model that differs from the source in a shape (vocab_size aside) is not that checkpoint retrained, and the
    # source's config.json would describe it wrongly
    wrong = [f for f in SHAPE_FIELDS if getattr(src, f) != getattr(cfg, f)]
    if wrong:
        raise CheckpointError(
            f"{source} is not the checkpoint this model was loaded from: its {wrong[0]} is {getattr(src, wrong[0])}, "
            f"the model's is {getattr(cfg, wrong[0])}; pass the folder the model came from, or use save_pretrained"
        )
    raw = json.loads((source / "config.json").read_text())  # read_config above has checked it is valid JSON
    if raw.get("vocab_size") != cfg.vocab_size:
        raw["vocab_size"] = cfg.vocab_size  # a mask token was added (tokenizer.add_mask_token grows the embedding)
    keys, plan, tensor_dtype = _source_layout(source)
    dtype = _config_dtype(raw) or tensor_dtype or model.embed.weight.dtype
    params = dict(model.state_dict())
    state = {
        theirs: params[ours].detach().to(device="cpu", dtype=dtype).contiguous()
        for ours, theirs in weight_names(cfg).items()
    }
    if cfg.tie_embeddings and "lm_head.weight" in keys:
        # a tied checkpoint that still carries lm_head.weight keeps it, so the key set is the source's (a copy:
        # safetensors refuses two names for one storage)
        state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    if set(state) != set(keys):
        odd = sorted(set(state) ^ set(keys))
        raise CheckpointError(
            f"{source} holds other tensors than this {cfg.family} model writes ({len(odd)} differ, first: {odd[:3]}); "
            "pass the folder the model came from, or use save_pretrained"
        )
    state = {k: state[k] for k in keys}  # the source's order

    with StagedFolder(folder) as out:  # whole or absent; a full disk names its file, the earlier export kept
        _copy_non_weights(source, out)
        out.file("config.json").write_text(json.dumps(raw, indent=2) + "\n")
        if plan is None:
            save_weights(state, out.file("model.safetensors"), metadata={"format": "pt"})
        else:
            _save_sharded(state, out, plan)
        if tokenizer is not None and not _has_same_tokenizer(source, tokenizer):
            tokenizer.save_pretrained(out.files("the tokenizer's files"))
        record = {
            "source": str(source),
            **(provenance or {}),
            "dtype": str(dtype).removeprefix("torch."),
            # how the weights were trained to be used: a plain source's config.json does not say (nothing reads
            # this back; load_pretrained reads config.json, and a preset supplies the behaviour)
            "model": {k: getattr(cfg, k) for k in ("family", "attention", "shift", "block_size", "mask_token_id")},
        }
        out.file(PROVENANCE_NAME).write_text(json.dumps(record, indent=2, default=str) + "\n")
    return folder


def _is_weight_file(name: str) -> bool:
    return name.startswith(".") or name.endswith(_WEIGHT_SUFFIXES)


def _copy_non_weights(source: Path, out: StagedFolder) -> None:
    """Copy every file and subfolder of ``source`` but weight and hidden files into the staged export ``out``, one
    file at a time (a full disk names the file). Links (a Hugging Face cache snapshot's links into its blobs) are
    copied as the files they point at: the export must stand alone. A folder of weights only (e.g.
    ``original/*.pth``) is left out whole."""
    copy_files(source, out, skip=_is_weight_file)


def _source_layout(source: Path) -> tuple[list[str], dict[str, str] | None, torch.dtype | None]:
    """(tensor names, shard plan or None for one file, the tensors' dtype or None) of a checkpoint folder, from the
    safetensors headers and index without reading the weights. Rotary ``inv_freq`` buffers of old torch files are
    left out: ``transformers`` recomputes them, and this core has none to write."""
    single, index = source / "model.safetensors", source / "model.safetensors.index.json"
    if single.is_file():
        header = _safetensors_header(single)
        keys, plan, dtype = list(header), None, _tensors_dtype(header.values())
    elif index.is_file():
        plan = json.loads(index.read_text())["weight_map"]
        first = source / min(plan.values())
        keys, dtype = list(plan), _tensors_dtype(_safetensors_header(first).values()) if first.is_file() else None
    else:  # pytorch_model.bin (written back as safetensors: no pickles), or the missing-weights error
        state = load_state(source)
        keys, plan, dtype = list(state), None, next((t.dtype for t in state.values() if t.is_floating_point()), None)
    return [k for k in keys if not k.endswith("rotary_emb.inv_freq")], plan, dtype


def _safetensors_header(path: Path) -> dict[str, dict]:
    """name -> {dtype, shape, data_offsets} of a safetensors file: its JSON header only (8-byte length first)."""
    try:
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read the header of {path} ({e}); the file is damaged: copy it again") from e
    header.pop("__metadata__", None)
    return header


def _tensors_dtype(entries) -> torch.dtype | None:
    """The most common floating dtype among safetensors header entries."""
    counts = Counter(_SAFETENSORS_DTYPES.get(e.get("dtype")) for e in entries)
    counts.pop(None, None)
    return counts.most_common(1)[0][0] if counts else None


def _config_dtype(raw: dict) -> torch.dtype | None:
    for key in ("torch_dtype", "dtype"):  # transformers before 4.56 writes torch_dtype, later ones dtype
        value = getattr(torch, str(raw.get(key)), None)
        if isinstance(value, torch.dtype) and value.is_floating_point:
            return value
    return None


def _has_same_tokenizer(source: Path, tokenizer) -> bool:
    """True when ``source`` holds a tokenizer that encodes like ``tokenizer``: its copied files then stand (they
    keep what re-saving could lose, e.g. a chat template or a remote-code tokenizer's files). A source tokenizer
    that cannot be loaded without remote code is kept too: it is the one the source's users expect."""
    from .tokenizer import has_tokenizer, load_tokenizer, tokenizer_hash

    if not has_tokenizer(source):
        return False
    try:
        return tokenizer_hash(load_tokenizer(source)) == tokenizer_hash(tokenizer)
    except CheckpointError:
        return True
