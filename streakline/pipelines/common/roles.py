"""Model roles as the stages load them: the device, a role's tokenizer, the block-diffusion target.

tokenizer = role_tokenizer(cfg, "verifier")       # None when the role has no tokenizer folder
eos = role_eos(cfg, "verifier", tokenizer)        # the checkpoint's own end-of-text id(s)
target = block_target(cfg, "spot", device())       # refuses a target without block-causal attention
"""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import DictConfig

from streakline.config import ConfigError
from streakline.models import build, locate
from streakline.models.checkpoint import read_config
from streakline.models.dflash_checkpoint import check_tokenizer
from streakline.models.tokenizer import has_tokenizer, load_tokenizer, tokenizer_hash


def device() -> str:
    """Where the stages put their models: the GPU when there is one."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def role_tokenizer(cfg: DictConfig, role: str):
    """The role's tokenizer (its ``tokenizer`` folder, else its checkpoint folder: ``path``, or the local Hugging
    Face cache's copy of ``hub_id``), or None if it has none (a from-scratch preset). A hub preset that is not cached
    is a CheckpointError with the download command, the same message every stage gives for its weights."""
    node = cfg.model[role]
    weights = locate(node, role)  # the checkpoint folder (a hub preset's in the local cache); None: from scratch
    folder = node.tokenizer or (str(weights) if weights is not None else None)
    if node.tokenizer is not None and not Path(node.tokenizer).exists():
        raise ConfigError(f"model.{role}.tokenizer={node.tokenizer} does not exist; point it at a tokenizer folder")
    if folder is not None and not has_tokenizer(folder):
        if node.tokenizer is not None:  # named on purpose: it must hold one
            raise ConfigError(
                f"model.{role} reads its tokenizer from {folder}, which holds no tokenizer.json / "
                f"tokenizer_config.json; set model.{role}.tokenizer=<folder with the tokenizer>"
            )
        folder = None  # a checkpoint saved without one (transformers' save_pretrained): fine until text is needed
    if folder is None:
        if cfg.prompt is not None:
            raise ConfigError(
                f"model.{role} has no tokenizer folder to encode prompt= with; set model.{role}.tokenizer=<folder> "
                "or pass raw ids with prompt_ids=[...]"
            )
        return None
    # the checkpoint's config first: a damaged config.json is then named as such, not as a tokenizer problem
    rows = None if weights is None else read_config(weights, node.get("family")).vocab_size
    tokenizer = load_tokenizer(folder)
    if rows is not None:
        _check_fits(role, folder, tokenizer, weights, rows)
    return tokenizer


def _check_fits(role: str, folder: str, tokenizer, weights, rows: int) -> None:
    """Refuse a tokenizer with more tokens than the role's embedding has rows: its ids past the end would index
    nothing (a silent wrong decode on CPU, a device assert on GPU). A model may have more rows than tokens (padded
    vocabularies, e.g. Qwen2.5's 152064 rows for 151665 tokens)."""
    if len(tokenizer) > rows:
        raise ConfigError(
            f"the tokenizer at {folder} has {len(tokenizer)} tokens but model.{role} ({weights}) has {rows} "
            f"embedding rows: they belong to different models; point model.{role}.tokenizer at the tokenizer "
            f"{weights} was trained with"
        )


def role_eos(cfg: DictConfig, role: str, tokenizer, single: bool = False) -> int | list[int] | None:
    """The role's end-of-text id(s), from its own checkpoint: ``generation_config.json`` (which may list several,
    as Qwen2.5-Instruct's does), else ``config.json``, else its tokenizer's; None: never stops early. ``single``: the
    first id only, for the block-diffusion decoders, which take one."""
    import json

    folder = locate(cfg.model[role], role)
    eos = None
    for name in ("generation_config.json", "config.json") if folder is not None else ():
        try:
            eos = json.loads((folder / name).read_text(encoding="utf-8")).get("eos_token_id")
        except (OSError, ValueError):
            eos = None  # absent, or damaged (loading the checkpoint names that)
        if eos is not None:
            break
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if single and isinstance(eos, list):
        return eos[0] if eos else None
    return eos


def required_tokenizer(cfg: DictConfig, role: str, stage: str):
    """The role's tokenizer, for a stage that cannot run without one (it encodes prompts for that role)."""
    tok = role_tokenizer(cfg, role)
    if tok is None:
        raise ConfigError(f"stage={stage} needs the {role}'s tokenizer; set model.{role}.tokenizer=<folder>")
    return tok


def block_target(cfg: DictConfig, stage: str, device: str):
    """The target model for a stage that decodes it block by block (spot, spiffy); refuses one without block-causal
    attention."""
    target = build(cfg.model.target, "target", device=device, inference=True)
    if target.config.attention != "block_causal":
        raise ConfigError(
            f"stage={stage} needs a block-diffusion target (block_causal attention); model.target attends "
            f"{target.config.attention!r}"
        )
    return target


def check_drafter_tokenizer(folder, verifier_tokenizer) -> None:
    """Refuse, in one line naming both tokenizer hashes and the fix, a drafter folder that records the tokenizer it
    was trained in (a DFlash export: ``dflash_checkpoint.TOKENIZER_FIELD``) when the verifier's is another; a folder
    that records none, a from-scratch drafter (``folder`` None) or a verifier without a tokenizer pass."""
    if folder is not None and verifier_tokenizer is not None:
        check_tokenizer(folder, verifier_tokenizer)


def bridge_tokenizers(cfg: DictConfig, drafter, verifier_tokenizer):
    """The drafter as is when it shares the verifier's tokenizer, else wrapped to draft through token strings."""
    from streakline.decoding.cross_tokenizer import CrossTokenizerDrafter, VocabBridge

    from .kinds import DRAFTER_KINDS

    kind = DRAFTER_KINDS.get(drafter.kind)  # None: a model-free drafter (ngram) drafts the verifier's own tokens
    if kind is None:
        return drafter
    if kind.tokenizer_role == "verifier":  # a DFlash drafter: the verifier's ids by construction, never bridged
        check_drafter_tokenizer(locate(cfg.model.drafter, "drafter"), verifier_tokenizer)
        return drafter
    drafter_tokenizer = role_tokenizer(cfg, "drafter") if verifier_tokenizer is not None else None
    if drafter_tokenizer is None or tokenizer_hash(drafter_tokenizer) == tokenizer_hash(verifier_tokenizer):
        return drafter
    bridge = VocabBridge(drafter_tokenizer, verifier_tokenizer, drafter_vocab=drafter.model.config.vocab_size)
    print(f"decode: drafter and verifier tokenizers differ; {bridge.coverage:.0%} of drafter tokens map by string")
    return CrossTokenizerDrafter(drafter, bridge, verifier_tokenizer, drafter_tokenizer)
