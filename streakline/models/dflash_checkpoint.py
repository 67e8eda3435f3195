"""DFlash drafter checkpoints in the ``speculators`` format (what vLLM serves), and the paper authors' format.

    save_dflash(drafter, "runs/export/dflash", verifier_name="Qwen/Qwen3-8B", verifier_architecture="Qwen3ForCausalLM")
    drafter = load_dflash("runs/export/dflash")      # or a published DFlash drafter folder (either format)
    drafter.share(verifier)

The ``speculators`` layout (release 0.9.0, the one pinned by ``tests/models/test_dflash_speculators.py``):

- ``config.json``: ``architectures: ["DFlashDraftModel"]``, ``speculators_model_type: "dflash"``,
  ``aux_hidden_state_layer_ids`` (verifier layer ids, id ``i`` = the stream entering layer ``i``), ``block_size``,
  ``mask_token_id``, ``draft_vocab_size``, ``target_hidden_size``; ``speculators_config`` (algorithm ``dflash``, a
  greedy proposal of ``block_size - 1`` tokens, the verifier's name and architecture: what ``vllm serve <folder>``
  reads); ``transformer_layer_config``, a Qwen3 config of the draft layers (full attention: bidirectional in a block).
- ``model.safetensors``: ``fc.weight``, ``hidden_norm.weight``, ``layers.{i}.*`` with Qwen3's names
  (``input_layernorm``, ``self_attn.{q,k,v,o}_proj``, ``self_attn.{q,k}_norm``, ``post_attention_layernorm``,
  ``mlp.{gate,up,down}_proj``), ``norm.weight``. No embedding or head: both are the verifier's (releases before 0.8
  stored copies; a loader ignores them).

The authors' layout (``z-lab/*-DFlash*``): the same weight names, ``config.json`` with ``model_type: qwen3``, the
layer shapes at the top level, ``block_size`` and ``dflash_config: {mask_token_id, target_layer_ids}`` whose ids are
one lower (id ``i`` = the output of layer ``i``); ``load_dflash`` reads both.

A drafter over a draft vocabulary (``models/draft_vocab.py``) carries it as ``speculators`` does: ``draft_vocab_size``
N in ``config.json``, and in the weights ``lm_head.weight`` (its N-row head), ``t2d`` (``[V]`` bool) and ``d2t``
(``[N]`` offsets). A full-vocabulary drafter stores none of them and drafts with the verifier's head.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .checkpoint import (
    _LAYER_NAMES,
    _QK_NORM_NAMES,
    CheckpointError,
    StagedFolder,
    _read_safetensors,
    save_weights,
)
from .config import TransformerConfig
from .dflash import DFlashConfig, DFlashModel
from .draft_vocab import DraftVocab, DraftVocabError
from .meta import on_meta
from .tokenizer import tokenizer_hash

SPECULATORS_VERSION = "0.9.0"  # the release whose format this writes (and whose model the interop test loads)
ARCHITECTURE = "DFlashDraftModel"


def weight_names(cfg: DFlashConfig) -> dict[str, str]:
    """This project's parameter names -> the names in a DFlash checkpoint (both formats)."""
    if cfg.layers.qkv_bias or not cfg.layers.qk_norm:
        raise CheckpointError(
            "DFlash checkpoints hold Qwen3 layers (q/k norms, no q/k/v bias); this drafter has "
            f"qkv_bias={cfg.layers.qkv_bias}, qk_norm={cfg.layers.qk_norm}"
        )
    names = {"fc.weight": "fc.weight", "hidden_norm.weight": "hidden_norm.weight", "norm.weight": "norm.weight"}
    per_layer = {**_LAYER_NAMES, **_QK_NORM_NAMES}
    for i in range(cfg.layers.num_layers):
        for ours, theirs in per_layer.items():
            names[f"layers.{i}.{ours}"] = f"layers.{i}.{theirs}"
    if cfg.draft_vocab_size is not None:  # a draft vocabulary's own head (the full one is the verifier's)
        names["lm_head.weight"] = "lm_head.weight"
    return names


def speculators_config(
    cfg: DFlashConfig, dtype: torch.dtype, verifier_name: str | None, verifier_architecture: str | None
) -> dict:
    """The ``config.json`` of a DFlash drafter in the ``speculators`` format."""
    layers = cfg.layers
    n = layers.num_layers
    return {
        "architectures": [ARCHITECTURE],
        "speculators_model_type": "dflash",
        "speculators_version": SPECULATORS_VERSION,
        "aux_hidden_state_layer_ids": list(cfg.target_layer_ids),
        "block_size": cfg.block_size,
        "mask_token_id": cfg.mask_token_id,
        "draft_vocab_size": cfg.draft_vocab_size or layers.vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "sliding_window_non_causal": False,
        "sample_from_anchor": False,
        "tie_word_embeddings": False,
        "dtype": str(dtype).removeprefix("torch."),
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": cfg.block_size - 1,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": verifier_name,
                "architectures": [verifier_architecture] if verifier_architecture else [],
            },
        },
        "transformer_layer_config": {
            "model_type": "qwen3",
            "architectures": ["Qwen3ForCausalLM"],
            "vocab_size": layers.vocab_size,
            "hidden_size": layers.hidden_size,
            "intermediate_size": layers.intermediate_size,
            "num_hidden_layers": n,
            "num_attention_heads": layers.num_heads,
            "num_key_value_heads": layers.num_kv_heads,
            "head_dim": layers.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": layers.rms_norm_eps,
            "attention_bias": False,
            "max_position_embeddings": layers.max_position_embeddings,
            "rope_theta": layers.rope_theta,
            "rope_parameters": {"rope_theta": layers.rope_theta, "rope_type": "default"},
            "layer_types": ["full_attention"] * n,
            "use_sliding_window": False,
            "sliding_window": None,
            "tie_word_embeddings": False,
        },
    }


def save_dflash(
    model: DFlashModel,
    folder: str | os.PathLike,
    *,
    verifier_name: str | None = None,
    verifier_architecture: str | None = None,
    tokenizer=None,
) -> Path:
    """Write ``model`` as a ``speculators`` DFlash checkpoint, atomically (a half-written export never replaces a
    good one). ``verifier_name``: the verifier's hub id or path, which ``vllm serve <folder>`` loads as the target.
    ``tokenizer``: the verifier's, whose ids the drafter (its mask token, its draft vocabulary's maps) was trained
    in; recorded as ``TOKENIZER_FIELD``, so that loading it against another tokenizer is refused
    (``check_tokenizer``)."""
    cfg = model.dflash
    if not (verifier_name or cfg.verifier):
        raise ValueError(
            "save_dflash needs the verifier's hub id or path (verifier_name=...): `vllm serve <folder>` and "
            "speculators load the target model and its embedding and head from it"
        )
    params = model.state_dict()
    state = {theirs: params[ours].detach().contiguous().cpu() for ours, theirs in weight_names(cfg).items()}
    if model.draft_vocab is not None:
        state["t2d"], state["d2t"] = model.draft_vocab.maps()
    dtype = state["fc.weight"].dtype
    name = verifier_name or cfg.verifier
    config = speculators_config(cfg, dtype, name, verifier_architecture)
    if tokenizer is not None:
        config[TOKENIZER_FIELD] = tokenizer_identity(tokenizer)
    with StagedFolder(folder) as out:  # whole or absent; a full disk names its file, the earlier export kept
        out.file("config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_weights(state, out.file("model.safetensors"), metadata={"format": "pt"})
        if _local_path(name):
            out.file(MOVING_NOTE).write_text(_moving_note(name))
    return out.folder


# The tokenizer a drafter was trained in, beside speculators' own fields in config.json (its config class keeps
# unknown top-level keys, so speculators and vLLM still load the export): {"hash": tokenizer_hash, "vocab_size":
# its number of tokens}. A DFlash drafter's ids are its verifier's (its mask token, its draft vocabulary's t2d/d2t),
# so under a verifier whose tokenizer numbers tokens otherwise it drafts the wrong tokens, silently.
TOKENIZER_FIELD = "streakline_tokenizer"


class TokenizerMismatchError(CheckpointError):
    """A DFlash drafter loaded against a verifier whose tokenizer is not the one it was trained in."""


def tokenizer_identity(tokenizer) -> dict[str, int | str]:
    """What an export records of the tokenizer it was trained in: ``{"hash": ..., "vocab_size": ...}``."""
    return {"hash": tokenizer_hash(tokenizer), "vocab_size": len(tokenizer)}


def recorded_tokenizer(folder: str | os.PathLike) -> dict | None:
    """The tokenizer a DFlash export records (``TOKENIZER_FIELD``), None when it records none."""
    try:
        raw = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None  # not readable: loading the folder says why
    recorded = raw.get(TOKENIZER_FIELD) if isinstance(raw, dict) else None
    return recorded if isinstance(recorded, dict) and recorded.get("hash") else None


def check_tokenizer(folder: str | os.PathLike, tokenizer) -> None:
    """Refuse (``TokenizerMismatchError``, one line with both hashes and the fix) the DFlash drafter at ``folder``
    for a verifier whose tokenizer is ``tokenizer`` when the export records another one.

    An export that records none passes silently: exports from before the field, and every published drafter
    (speculators', the authors' ``z-lab/*``), never carry it, so a warning would greet every hub drafter without
    saying anything the user could act on; ``DFlashModel.share`` still refuses a verifier of another vocabulary
    size."""
    recorded = recorded_tokenizer(folder)
    if recorded is None or tokenizer is None:
        return
    mine = tokenizer_identity(tokenizer)
    if recorded["hash"] == mine["hash"]:
        return
    raise TokenizerMismatchError(
        f"the DFlash drafter at {folder} was trained in the tokenizer {recorded['hash']} "
        f"({recorded.get('vocab_size', '?')} tokens), but the verifier's is {mine['hash']} ({mine['vocab_size']} "
        "tokens): its ids (mask token, draft vocabulary) would name other tokens; decode it with the verifier it was "
        "trained against, or distill a drafter for this verifier (stage=distill with this model.verifier)"
    )


MOVING_NOTE = "README.md"  # written beside an export whose verifier is named by a local path


def _local_path(name: str) -> bool:
    """Whether a verifier name is a path on this machine rather than a hub id (``org/model``)."""
    return Path(name).is_absolute() or name.startswith((".", "~")) or Path(name).exists()


def _moving_note(name: str) -> str:
    return (
        "# A DFlash drafter in the speculators format\n\n"
        f"Its verifier is named by a path on the machine that trained it: `{name}`.\n"
        "`vllm serve` and `speculators` load the verifier (and its embedding and head) from "
        "`speculators_config.verifier.name_or_path` in `config.json`. Where that path does not exist (a copy of this "
        "folder on a cluster), set it to the verifier's hub id or its path there, e.g.:\n\n"
        "    python -c \"import json, sys; p = 'config.json'; c = json.load(open(p)); "
        "c['speculators_config']['verifier']['name_or_path'] = sys.argv[1]; "
        "json.dump(c, open(p, 'w'), indent=2)\" HuggingFaceTB/SmolLM2-135M-Instruct\n\n"
        "(the hub id shown is an example: name the model this drafter was trained against).\n"
    )


def is_dflash_folder(folder: str | os.PathLike) -> bool:
    """Whether ``folder``'s ``config.json`` describes a DFlash drafter (either format)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return False
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return raw.get("speculators_model_type") == "dflash" or "dflash_config" in raw


def read_dflash_config(folder: str | os.PathLike) -> DFlashConfig:
    """The ``DFlashConfig`` of a DFlash checkpoint folder, ``speculators`` or authors' format."""
    path = Path(folder) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {path} ({e}): not a DFlash checkpoint folder") from e
    if raw.get("speculators_model_type") == "dflash":
        layer = raw.get("transformer_layer_config") or {}
        ids = raw.get("aux_hidden_state_layer_ids")
        verifier = ((raw.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
        target_hidden = raw.get("target_hidden_size")
        draft_vocab = raw.get("draft_vocab_size")
    elif "dflash_config" in raw:  # the authors' format: the layer config at the top level, ids one lower
        layer = raw
        ids = [int(i) + 1 for i in raw["dflash_config"].get("target_layer_ids", [])]
        if raw.get("num_target_layers") is not None and raw["num_target_layers"] in ids:
            # the authors' id N - 1 reads the verifier's last state after its final norm; id N here is before it
            raise CheckpointError(
                f"{folder} reads the verifier's last layer after the final norm (target layer id "
                f"{raw['num_target_layers'] - 1}), which streakline's layer states do not provide"
            )
        verifier, target_hidden, draft_vocab = None, None, None
        raw = {**raw, "mask_token_id": raw["dflash_config"].get("mask_token_id"),
               "block_size": raw.get("block_size", raw["dflash_config"].get("block_size"))}  # fmt: skip
    else:
        raise CheckpointError(
            f"{path} is not a DFlash drafter's config (no speculators_model_type 'dflash', no dflash_config)"
        )
    missing = [k for k in ("block_size", "mask_token_id") if raw.get(k) is None]
    if missing or not ids:
        raise CheckpointError(f"{path} does not say {missing or ['target layer ids']}; the drafter cannot run without")
    if layer.get("layer_types") and any(t != "full_attention" for t in layer["layer_types"]):
        raise CheckpointError(
            f"{folder} has sliding-window draft layers ({sorted(set(layer['layer_types']))}), which streakline's "
            "DFlash model does not implement; use a drafter trained with full attention"
        )
    if raw.get("sample_from_anchor"):
        raise CheckpointError(
            f"{folder} was trained with sample_from_anchor (slot k drafts position p + k + 1); streakline's DFlash "
            "model drafts slot k for position p + k"
        )
    _check_layers(folder, layer)
    rope = (layer.get("rope_parameters") or {}).get("rope_theta", layer.get("rope_theta", 10000.0))
    shapes = TransformerConfig(
        vocab_size=layer["vocab_size"],
        hidden_size=layer["hidden_size"],
        intermediate_size=layer["intermediate_size"],
        num_layers=layer["num_hidden_layers"],
        num_heads=layer["num_attention_heads"],
        num_kv_heads=layer.get("num_key_value_heads", layer["num_attention_heads"]),
        head_dim=layer.get("head_dim"),
        rope_theta=float(rope),
        rms_norm_eps=layer.get("rms_norm_eps", 1e-6),
        max_position_embeddings=layer.get("max_position_embeddings", 2048),
        qk_norm=True,
        tie_embeddings=False,
        attention="full",
        family="qwen3",
        mask_token_id=raw["mask_token_id"],
    )
    return DFlashConfig(
        layers=shapes,
        target_layer_ids=tuple(ids),
        block_size=int(raw["block_size"]),
        mask_token_id=int(raw["mask_token_id"]),
        target_hidden_size=target_hidden,
        verifier=verifier,
        draft_vocab_size=None if draft_vocab is None else int(draft_vocab),
    )


# What the draft layers may say beyond their shapes; anything else changes the computation in ways DFlashModel does
# not implement, so a checkpoint that says it is refused rather than read as if it had not.
_ACTIVATIONS = ("silu", "swish")


def _check_layers(folder, layer: dict) -> None:
    problems = []
    rope = layer.get("rope_parameters")
    if isinstance(rope, dict) and any(isinstance(v, dict) for v in rope.values()):
        problems.append("per-layer-type rope_parameters")
    elif isinstance(rope, dict) and rope.get("rope_type", "default") != "default":
        problems.append(f"rope_type {rope['rope_type']!r} in rope_parameters")
    if layer.get("rope_scaling"):
        problems.append(f"rope_scaling {layer['rope_scaling']!r}")
    if layer.get("attention_bias"):
        problems.append("attention_bias (biases on q/k/v/o)")
    if layer.get("hidden_act", "silu") not in _ACTIVATIONS:
        problems.append(f"hidden_act {layer['hidden_act']!r}")
    if layer.get("use_sliding_window") and not layer.get("layer_types"):
        problems.append("use_sliding_window")
    if problems:
        raise CheckpointError(
            f"{folder}'s draft layers use {', '.join(problems)}, which streakline's DFlash model does not implement "
            "(it has the default rotary embedding, SwiGLU with silu, no attention biases, full attention)"
        )


# Tensors a DFlash checkpoint may hold beyond the drafter's own: copies of the verifier's embedding, head and norm
# (older speculators releases, training-time buffers); the verifier's own are used instead.
_IGNORED_TENSORS = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight")


def load_dflash(
    folder: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    tokenizer=None,
) -> DFlashModel:
    """A DFlash drafter from its checkpoint folder (``speculators`` or authors' format), on ``device``; call
    ``share(verifier)`` before drafting. Stored embedding/head copies (older ``speculators`` releases) are ignored:
    the verifier's own are used. ``tokenizer``: the verifier's, refused when the export records another one
    (``check_tokenizer``)."""
    folder = Path(folder)
    cfg = read_dflash_config(folder)
    check_tokenizer(folder, tokenizer)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder} holds no .safetensors weights; copy or download the drafter again")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(_read_safetensors(f))
    vocab = _draft_vocab(folder, cfg, state)
    with on_meta():  # shapes only: every parameter is the checkpoint's (strict load below), so no random init
        model = DFlashModel(cfg)
    names = weight_names(cfg)
    missing = [theirs for theirs in names.values() if theirs not in state]
    if missing:
        raise CheckpointError(f"{folder} lacks the weights {missing[:4]}{' ...' if len(missing) > 4 else ''}")
    ignored = set(_IGNORED_TENSORS) - set(names.values()) | {"t2d", "d2t"}  # a draft vocabulary's head is its own
    unused = sorted(set(state) - set(names.values()) - ignored)
    if unused:
        raise CheckpointError(
            f"{folder} holds weights a DFlash drafter here has no place for: {unused[:4]}"
            f"{' ...' if len(unused) > 4 else ''} (not the layout its config describes, or parts this model lacks)"
        )
    ours = {o: state[t] for o, t in names.items()}
    for name, param in model.state_dict().items():
        if ours[name].shape != param.shape:
            raise CheckpointError(
                f"{folder}: {names[name]} has shape {tuple(ours[name].shape)}, its config implies {tuple(param.shape)}"
            )
    model.load_state_dict(ours, assign=True, strict=True)  # the model holds no buffers: rotary tables are computed
    model.draft_vocab = vocab
    if model.lm_head is not None:
        model.lm_head.requires_grad_(False)
    dtype = dtype or ours["fc.weight"].dtype
    return model.to(device=device, dtype=dtype)


def _draft_vocab(folder: Path, cfg: DFlashConfig, state: dict[str, torch.Tensor]) -> DraftVocab | None:
    """The draft vocabulary a checkpoint's ``t2d``/``d2t`` describe, checked against its config; None for a
    full-vocabulary drafter."""
    has_maps = "t2d" in state or "d2t" in state
    if cfg.draft_vocab_size is None:
        if has_maps and int(state.get("t2d", torch.ones(1)).sum()) != cfg.layers.vocab_size:
            raise CheckpointError(f"{folder} holds t2d/d2t maps but its config.json drafts over the whole vocabulary")
        return None
    if "t2d" not in state or "d2t" not in state:
        raise CheckpointError(
            f"{folder} drafts over {cfg.draft_vocab_size} of {cfg.layers.vocab_size} tokens but holds no t2d/d2t maps "
            "to say which; copy or export the drafter again"
        )
    try:
        vocab = DraftVocab.from_maps(state["t2d"], state["d2t"])
    except DraftVocabError as e:
        raise CheckpointError(f"{folder}: its draft vocabulary maps are damaged ({e})") from e
    if vocab.size != cfg.draft_vocab_size or vocab.vocab_size != cfg.layers.vocab_size:
        raise CheckpointError(
            f"{folder}: t2d/d2t map {vocab.size} of {vocab.vocab_size} tokens, config.json says "
            f"{cfg.draft_vocab_size} of {cfg.layers.vocab_size}"
        )
    return vocab
