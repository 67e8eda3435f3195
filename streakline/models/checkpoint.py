"""Hugging Face checkpoint import and export, through explicit weight-name tables.

Reads a folder holding ``config.json`` and ``model.safetensors`` (or a sharded ``model.safetensors.index.json``,
or, as a last resort, ``pytorch_model.bin`` loaded with ``weights_only=True``) written by ``transformers`` or by
the original authors, for the families:

    family  config model_type  weights     attention (default)  shift
    llama   llama              Llama       causal               no     (DiffuLLaMA: its preset says full + shift)
    qwen2   qwen2              Qwen2       causal               no
    qwen3   qwen3              Qwen3       causal               no
    dream   Dream              Qwen2       full                 yes    (Dream-7B, DiffuCoder-7B)
    sdar    sdar               Qwen3       block_causal         no     (SDAR-*-b32)

(``FAMILIES``/``FamilySpec`` in ``config.py``; ``llada`` is a known family whose weight layout cannot be read yet)
and writes the same layout back. ``trust_remote_code`` is never needed: Dream and SDAR are read from their weights
and ``config.json`` only. ``save_pretrained(..., as_family="qwen2")`` writes a Dream model as a plain
``Qwen2ForCausalLM`` folder so ``transformers`` can load its weights (the caller supplies the attention mask).
Behaviour that ``config.json`` does not hold (attention mode, shift, block size, mask id) is kept in a
``"streakline"`` block of ``config.json`` and read back from it.

The drop-in export (what ``stage=distill`` writes: a copy of the source folder with only the weights replaced) is
``export.py``'s ``export_like``, built on this module's shard writer and atomic folder swap.

    model = load_pretrained("/ckpt/qwen2.5-14b", dtype=torch.bfloat16)
    save_pretrained(model, "runs/export/verifier")
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import tempfile
from pathlib import Path

import torch

from streakline.artifacts import disk_full_error, is_disk_full
from streakline.errors import DiskFullError, UserError

from .config import FAMILIES, FamilySpec, TransformerConfig
from .meta import on_meta
from .transformer import Transformer


class CheckpointError(UserError, RuntimeError):
    """A checkpoint folder that cannot be read or written as asked; the message says how to fix it."""


# FAMILIES (family name -> FamilySpec) is defined in config.py and re-exported here; its specs say how to read
# and write each family's folder. A family without a weight table (llada) is known but cannot be read yet.
_MODEL_TYPES = {spec.model_type.lower(): name for name, spec in FAMILIES.items()}
_READABLE_MODEL_TYPES = sorted(t for t, name in _MODEL_TYPES.items() if FAMILIES[name].weights is not None)

# Our parameter name -> Hugging Face name, per layer. Which optional rows apply depends on the weight table.
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.q_proj.weight": "self_attn.q_proj.weight",
    "attn.k_proj.weight": "self_attn.k_proj.weight",
    "attn.v_proj.weight": "self_attn.v_proj.weight",
    "attn.o_proj.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.gate_proj.weight": "mlp.gate_proj.weight",
    "mlp.up_proj.weight": "mlp.up_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
}
_BIAS_NAMES = {
    "attn.q_proj.bias": "self_attn.q_proj.bias",
    "attn.k_proj.bias": "self_attn.k_proj.bias",
    "attn.v_proj.bias": "self_attn.v_proj.bias",
}
_QK_NORM_NAMES = {"attn.q_norm.weight": "self_attn.q_norm.weight", "attn.k_norm.weight": "self_attn.k_norm.weight"}
# What each weight table implies about the optional parts (Llama/Qwen3 put a bias on o_proj too when
# attention_bias is set, which this core does not model, so they must come without).
_TABLE_PARTS = {"llama": (False, False), "qwen2": (True, False), "qwen3": (False, True)}


def weight_names(cfg: TransformerConfig, family: str | None = None) -> dict[str, str]:
    """Explicit map from this project's parameter names to the Hugging Face names for ``family``."""
    spec = _spec(family or cfg.family)
    bias, qk_norm = _TABLE_PARTS[spec.weights]
    if (cfg.qkv_bias, cfg.qk_norm) != (bias, qk_norm):
        raise CheckpointError(
            f"a {family or cfg.family} checkpoint has qkv_bias={bias}, qk_norm={qk_norm}, but this model has "
            f"qkv_bias={cfg.qkv_bias}, qk_norm={cfg.qk_norm}; export it as a family whose layout matches"
        )
    per_layer = dict(_LAYER_NAMES)
    if bias:
        per_layer.update(_BIAS_NAMES)
    if qk_norm:
        per_layer.update(_QK_NORM_NAMES)
    names = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    for i in range(cfg.num_layers):
        for ours, theirs in per_layer.items():
            names[f"layers.{i}.{ours}"] = f"model.layers.{i}.{theirs}"
    if not cfg.tie_embeddings:
        names["lm_head.weight"] = "lm_head.weight"
    return names


def _spec(family: str) -> FamilySpec:
    if family == "llada":
        raise CheckpointError(
            "reading LLaDA weights (model.transformer.blocks.* names) is not implemented yet; "
            "use an SDAR target (model.target=sdar-8b-b32) or convert the checkpoint to the Llama layout"
        )
    if family not in FAMILIES:
        raise CheckpointError(f"unknown model family {family!r}; valid: {', '.join(FAMILIES)}")
    return FAMILIES[family]


def read_config(folder: str | os.PathLike, family: str | None = None) -> TransformerConfig:
    """TransformerConfig from a checkpoint folder's ``config.json``; ``family`` overrides its model_type."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"no config.json in {folder}: point model.<role>.path at a checkpoint folder")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); the checkpoint is damaged, copy it again") from e
    if family is None or family == "auto":
        model_type = str(raw.get("model_type", "")).lower()
        if model_type not in _MODEL_TYPES:
            raise CheckpointError(
                f"{path}: model_type {raw.get('model_type')!r} is not a supported family "
                f"({', '.join(_READABLE_MODEL_TYPES)}); set model.<role>.family if it is one of them under another name"
            )
        family = _MODEL_TYPES[model_type]
    spec = _spec(family)
    ours = raw.get("streakline", {})
    rope = raw.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in (None, "default"):
        raise CheckpointError(f"{path}: rope scaling {rope_type!r} is not supported; only plain RoPE is")
    if raw.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{path}: hidden_act {raw['hidden_act']!r} is not supported (SwiGLU with silu only)")
    if raw.get("use_sliding_window"):
        raise CheckpointError(f"{path}: sliding-window attention is not supported")
    theta = raw.get("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    bias, qk_norm = _TABLE_PARTS[spec.weights]
    if spec.weights != "qwen2" and raw.get("attention_bias"):
        raise CheckpointError(f"{path}: attention_bias=true (bias on o_proj) is not supported for {family}")

    def first(x):
        return x[0] if isinstance(x, list) and x else x

    return TransformerConfig(
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=raw["num_attention_heads"],
        num_kv_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
        head_dim=raw.get("head_dim"),
        rope_theta=float(theta),
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        qkv_bias=bias,
        qk_norm=qk_norm,
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        attention=ours.get("attention", spec.attention),
        block_size=ours.get("block_size", raw.get("block_size")),
        shift=ours.get("shift", spec.shift),
        family=family,
        mask_token_id=ours.get("mask_token_id", raw.get("mask_token_id")),
        bos_token_id=first(raw.get("bos_token_id")),
        eos_token_id=first(raw.get("eos_token_id")),
        pad_token_id=first(raw.get("pad_token_id")),
    )


def check_model_type(folder: str | os.PathLike, role: str, family_given: bool) -> None:
    """Refuse a checkpoint folder whose ``config.json`` names a ``model_type`` no family here reads, unless the
    command line said which family to read it as (``model.<role>.family``, ``family_given``): read silently as the
    preset's family, a foreign layout would load wrong or fail deep in the weights. A folder without a readable
    config.json is left to the loader, which names that problem."""
    path = Path(folder) / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    if not isinstance(raw, dict) or family_given or "speculators_model_type" in raw or "dflash_config" in raw:
        return  # a DFlash drafter is read by its own loader
    model_type = str(raw.get("model_type", "")).lower()
    if model_type not in _MODEL_TYPES:
        known = ", ".join(f"{name} ({spec.model_type})" for name, spec in FAMILIES.items() if spec.weights)
        raise CheckpointError(
            f"{path}: model_type {raw.get('model_type')!r} is not a family streakline reads (families, with their "
            f"model_type: {known}); if its weights are laid out as one of them, say which with "
            f"model.{role}.family=<family>"
        )


def folder_family(folder: str | os.PathLike, fallback: str | None = None) -> str:
    """The family a checkpoint folder's ``config.json`` declares (its ``model_type``); ``fallback`` (e.g. the
    preset's family) only when the model_type is not one this project knows under that name."""
    try:
        return read_config(folder).family
    except CheckpointError:
        if fallback and fallback != "auto":
            return fallback
        raise


def load_state(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint folder (single file, sharded index, or a weights-only torch file)."""
    folder = Path(folder)
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():
        return _read_safetensors(single)
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        state: dict[str, torch.Tensor] = {}
        for shard in shards:
            if not (folder / shard).is_file():
                raise CheckpointError(f"{index} lists {shard}, which is missing: the download is incomplete")
            state.update(_read_safetensors(folder / shard))
        return state
    legacy = folder / "pytorch_model.bin"
    if legacy.is_file():
        return torch.load(legacy, map_location="cpu", weights_only=True)
    raise CheckpointError(
        f"no model.safetensors, model.safetensors.index.json or pytorch_model.bin in {folder}; the weights are missing "
        "(an incomplete download or copy?): fetch them again or point model.<role>.path at the folder that holds them"
    )


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except (SafetensorError, OSError) as e:  # a file cut short by a failed copy or download, or not safetensors
        raise CheckpointError(
            f"cannot read the weights in {path} ({e}); the file is damaged or incomplete: copy or download it again"
        ) from e


def _check_shapes(folder: str | os.PathLike, model: Transformer, ours: dict[str, torch.Tensor], names) -> None:
    """Raise CheckpointError when a tensor's shape differs from the one ``config.json`` implies: weights and
    config from different models (torch's own message is a size-mismatch list deep in a traceback)."""
    expected = dict(model.state_dict(keep_vars=True))
    wrong = [(k, tuple(v.shape), tuple(expected[k].shape)) for k, v in ours.items() if v.shape != expected[k].shape]
    if wrong:
        name, got, want = wrong[0]
        raise CheckpointError(
            f"{folder}: {len(wrong)} tensors do not have the shapes its config.json implies (first: {names[name]} "
            f"is {list(got)}, config.json implies {list(want)}); the config and the weights come from different "
            f"models: take both from the same checkpoint"
        )


def load_pretrained(
    folder: str | os.PathLike,
    *,
    family: str | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    **behaviour,
) -> Transformer:
    """Build a Transformer from a checkpoint folder.

    behaviour: overrides of TransformerConfig fields that describe use rather than weights (attention, shift,
    block_size, mask_token_id, ...), e.g. from a checkpoint preset.
    """
    cfg = read_config(folder, family)
    for key, value in behaviour.items():
        if value is not None:
            setattr(cfg, key, value)
    cfg = TransformerConfig.from_dict(cfg.to_dict())  # re-validate after overrides
    names = weight_names(cfg)
    state = load_state(folder)
    missing = [theirs for theirs in names.values() if theirs not in state]
    if missing:
        raise CheckpointError(
            f"{folder} lacks {len(missing)} expected tensors (first: {missing[:3]}); is family {cfg.family!r} right?"
        )
    # Tied checkpoints may still carry lm_head.weight, and old torch files carry rotary inv_freq buffers.
    extra = {k for k in set(state) - set(names.values()) - {"lm_head.weight"} if not k.endswith("rotary_emb.inv_freq")}
    if extra:
        raise CheckpointError(f"{folder} has tensors this {cfg.family} layout does not use: {sorted(extra)[:5]}")
    with on_meta():
        model = Transformer(cfg)
    ours = {o: state[t].to(dtype) if dtype else state[t] for o, t in names.items()}
    _check_shapes(folder, model, ours, names)
    model.load_state_dict(ours, assign=True, strict=True)
    return model.to(device)


def hf_config(cfg: TransformerConfig, family: str, dtype: torch.dtype) -> dict:
    """The ``config.json`` a ``family`` checkpoint of these shapes carries."""
    spec = _spec(family)
    raw = {
        "architectures": [spec.architecture],
        "model_type": spec.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_cache": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
    }
    if spec.weights == "llama":
        raw["mlp_bias"] = False
    if spec.weights == "qwen2":
        raw["use_sliding_window"] = False
    if cfg.mask_token_id is not None:
        raw["mask_token_id"] = cfg.mask_token_id
    raw["streakline"] = {
        "family": cfg.family,
        "attention": cfg.attention,
        "shift": cfg.shift,
        "block_size": cfg.block_size,
        "mask_token_id": cfg.mask_token_id,
    }
    return raw


def save_weights(state: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """safetensors' ``save_file``, then the mode an ordinary new file gets (0666 less the umask): safetensors
    writes its files 0600, which a serving container running as another user cannot read."""
    from safetensors.torch import save_file

    try:
        save_file(state, path, metadata=metadata)
    except Exception as exc:  # safetensors says a full disk in its own error type ("No space left on device")
        if is_disk_full(exc):
            raise disk_full_error(path, exc) from exc
        raise
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def _temp_folder(folder: Path) -> Path:
    """A fresh folder beside ``folder`` to write an export into before it is swapped into place: a plain ``mkdir``
    (the team can read it; mkdtemp's 0700 would hide every export), named as ``artifacts.sweep_temp_files`` expects,
    so what a killed export leaves is swept when its stage starts again."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    while True:
        tmp = folder.with_name(f".{folder.name}.{secrets.token_hex(4)}.tmp")
        try:
            tmp.mkdir()
            return tmp
        except FileExistsError:  # another writer drew the same 32 bits: draw again
            continue


def save_pretrained(
    model: Transformer,
    folder: str | os.PathLike,
    *,
    as_family: str | None = None,
    max_shard_bytes: int | None = None,
    tokenizer=None,
) -> Path:
    """Write ``model`` as a Hugging Face checkpoint folder, atomically (a half-written export never replaces a
    good one). ``as_family`` writes another family's layout with the same weights (e.g. dream -> qwen2);
    ``max_shard_bytes`` splits the weights into shards with an index; ``tokenizer`` is saved beside them."""
    cfg = model.config
    family = as_family or cfg.family
    names = weight_names(cfg, family)
    params = dict(model.state_dict())
    state = {theirs: params[ours].detach().contiguous().cpu() for ours, theirs in names.items()}
    dtype = next(iter(state.values())).dtype

    with StagedFolder(folder) as out:  # whole or absent; a full disk names its file, the earlier export kept
        out.file("config.json").write_text(json.dumps(hf_config(cfg, family, dtype), indent=2) + "\n")
        if max_shard_bytes is None:
            save_weights(state, out.file("model.safetensors"), metadata={"format": "pt"})
        else:
            _save_sharded(state, out, _greedy_shards(state, max_shard_bytes))
        if tokenizer is not None:
            tokenizer.save_pretrained(out.files("the tokenizer's files"))
    return out.folder


def _greedy_shards(state: dict[str, torch.Tensor], max_bytes: int) -> dict[str, str]:
    """Tensor name -> shard file name: tensors in order, a new shard when the next one would pass ``max_bytes``,
    named as ``transformers`` names them (``model-00001-of-00003.safetensors``)."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, t in state.items():
        n = t.numel() * t.element_size()
        if groups[-1] and size + n > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    return {name: f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i, g in enumerate(groups) for name in g}


def _save_sharded(state: dict[str, torch.Tensor], out: StagedFolder, plan: dict[str, str]) -> None:
    """Write ``state`` into the staged folder ``out`` as the shard files ``plan`` (tensor name -> file name) names,
    plus the index."""
    files: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in state.items():
        files.setdefault(plan[name], {})[name] = t
    for fname, shard in files.items():
        save_weights(shard, out.file(fname), metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": {name: plan[name] for name in state}}
    out.file("model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _swap_into_place(tmp: Path, folder: Path) -> None:
    """Replace ``folder`` by ``tmp``; the old folder is removed only once the new one is in place."""
    if not folder.exists():
        os.replace(tmp, folder)
        return
    old = folder.with_name(f".{folder.name}.old-{os.getpid()}")
    os.replace(folder, old)
    os.replace(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)


class StagedFolder:
    """A checkpoint folder written whole or not at all: the ``with`` block writes into a fresh folder beside
    ``folder`` (``_temp_folder``), which replaces ``folder`` when the block ends and is removed when it raises, so
    ``folder`` is then as it was (the earlier export, or absent). A full disk met in the block is a one-line
    ``DiskFullError`` naming the file that failed (as ``folder``'s file: the temporary name means nothing to a user)
    and what was kept; ``kept`` adds what the caller keeps besides (the export a copy was made from, say).

        with StagedFolder(folder) as out:
            out.file("config.json").write_text(text)           # the path to write, and the name a failure gives
            save_weights(state, out.file("model.safetensors"))
            tokenizer.save_pretrained(out.files("the tokenizer's files"))  # a library's write of several files
    """

    def __init__(self, folder: str | os.PathLike, kept: str | None = None) -> None:
        self.folder, self.kept = Path(folder).absolute(), kept
        self.current = "its first file"  # what is being written, as a failure names it (relative to the folder)

    def __enter__(self) -> StagedFolder:
        self.existed = self.folder.exists()
        self.tmp = _temp_folder(self.folder)
        return self

    def file(self, name: str) -> Path:
        """The path in the staged folder to write the file ``name`` (relative to the folder) at, its parents made."""
        self.current = name
        path = self.tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def files(self, what: str) -> Path:
        """The staged folder itself, for a call that writes several files into it that it does not name one by one
        (a tokenizer's ``save_pretrained``); ``what`` is what a failure then names ("the tokenizer's files")."""
        self.current = what
        return self.tmp

    def __exit__(self, kind, exc, tb) -> bool:
        if exc is None:
            try:
                _swap_into_place(self.tmp, self.folder)
                return False
            except BaseException as failed:
                exc = failed
        shutil.rmtree(self.tmp, ignore_errors=True)
        if isinstance(exc, DiskFullError) or is_disk_full(exc):
            cause = exc.__cause__ if isinstance(exc, DiskFullError) and exc.__cause__ is not None else exc
            raise disk_full_error(self.folder / self.current, cause, kept=self._kept_text()) from cause
        if kind is None:  # the swap itself failed
            raise exc
        return False

    def _kept_text(self) -> str:
        had = (
            f"{self.folder} is the earlier one, untouched"
            if self.existed
            else f"{self.folder} was not written (no half-written copy is left)"
        )
        return had + (f", and {self.kept}" if self.kept else "")


def copy_files(source: Path, out: StagedFolder, skip=lambda name: False) -> int:
    """Copy every file under ``source`` into the staged folder ``out`` one by one (``out.file``: a full disk names
    the file), folders and links followed (a link is copied as the file it points at: the copy stands alone); a
    file or folder whose name ``skip`` says is left out with all it holds. Returns the files copied."""
    copied = 0
    for top, dirs, names in os.walk(source, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not skip(d))
        rel = Path(top).relative_to(source)
        for name in sorted(n for n in names if not skip(n)):
            shutil.copy2(Path(top) / name, out.file(str(rel / name)))
            copied += 1
    return copied


def copy_folder(source: str | os.PathLike, folder: str | os.PathLike, kept: str | None = None) -> Path:
    """Copy the checkpoint folder ``source`` to ``folder``, whole or not at all (``StagedFolder``: a full disk
    names the file whose copy failed; ``kept`` as there). What stage=distill's final ``drafter/`` is: a copy of
    its best or last export."""
    source = Path(source).absolute()
    with StagedFolder(folder, kept=kept) as out:
        copy_files(source, out)
    return out.folder


# The plain AR class whose weights a diffusion family shares: what `transformers` can load without remote code
# (each weight-name table is named after the AR family that defines it: dream -> qwen2, sdar -> qwen3).
BASE_FAMILY = {name: spec.weights for name, spec in FAMILIES.items() if spec.weights is not None}


@torch.no_grad()
def transformers_max_diff(model: Transformer, seq_len: int = 24, batch: int = 2, seed: int = 0) -> float:
    """Export ``model`` as its base AR family, load it with ``transformers.AutoModelForCausalLM`` and return the
    largest absolute logit difference on random ids, under the model's own attention mode (passed to
    ``transformers`` as the equivalent 4D boolean mask). A quick proof that a checkpoint means the same thing here
    and in the reference implementation; ``stage=doctor`` prints it."""
    import transformers

    from .masks import build_mask

    cfg = model.config
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=gen).to(model.embed.weight.device)
    pos = torch.arange(seq_len, device=ids.device).expand(batch, seq_len)
    prefix = seq_len // 2 if cfg.attention == "prefix_causal" else None
    mask, _ = build_mask(cfg.attention, pos, None, None, prefix_len=prefix, block_size=cfg.block_size)
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(model, Path(tmp) / "export", as_family=BASE_FAMILY[cfg.family])
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            Path(tmp) / "export", dtype=model.embed.weight.dtype, attn_implementation="sdpa"
        ).to(ids.device)
    if mask is None and cfg.attention == "full":  # our fast path builds no mask; transformers needs one
        mask = torch.ones(batch, 1, seq_len, seq_len, dtype=torch.bool, device=ids.device)
    theirs = hf(ids, attention_mask=mask).logits if mask is not None else hf(ids).logits
    ours = model(ids, prefix_len=prefix)
    return float((ours.float() - theirs.float()).abs().max())
