"""What a run key adds so that it names content, not names: data files, hub revisions, checkpoint folders, the
drafter's tokenizer, the block-diffusion target (docs/artifacts.md, "When a key moves").

    parts = weights_parts(cfg, "verifier")    # {} | {"revision": <commit>} | {"weights": <folder fingerprint>}
    files = source_files(cfg, sources)         # {"conversations@/d/chats.jsonl": <sha256>, ...}
    target = target_identity(cfg)              # {"target": name, "target_fingerprint": ..., "block_size": 8}

Each part is empty exactly where the old key was already exact, so those keys keep their folders: a checkpoint a
finished stage wrote (the world, an import, a distill export; ``hashing.run_output``) is named by its path, a preset
built from scratch by its preset, a built-in prompt source by its name. What is added elsewhere:

- a hub id: the snapshot commit its ``refs/main`` resolves to in the local Hugging Face cache (offline);
- a folder of the user's: ``hashing.folder_fingerprint`` (config, tokenizer files, weight names, sizes, mtimes and
  safetensors headers; never the weights themselves);
- a data file (``conversations@<file>``, ``gsm8k@<file>``, a preset's ``sharegpt@<file>``): its sha256, cached by
  path, size and mtime in ``<run_root>/.sha256.json``; a folder: every file's; a cached hub dataset: its commit.

Tests: ``python -m pytest tests/pipelines/test_fingerprints.py``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from streakline.artifacts import config_hash
from streakline.errors import UserError
from streakline.hashing import file_sha256, folder_fingerprint, hub_snapshot, run_output, sha256_cache


# --------------------------------------------------------------------------------------------- checkpoints
def weights_parts(cfg: DictConfig, role: str) -> dict[str, str]:
    """What a key holding ``model.<role>``'s path or hub id adds for its content: ``{"revision": commit}`` for a
    hub id, ``{"weights": fingerprint}`` for a folder no finished stage wrote, else nothing. A folder that is not a
    checkpoint is refused (``models.locate``: the message every stage gives)."""
    from streakline.models import locate

    node = cfg.model[role]
    if not (node.path or node.hub_id):
        return {}  # built from its preset, which the key holds
    folder = locate(node, role)
    if node.path:
        return {} if run_output(folder) is not None else {"weights": folder_fingerprint(folder)}
    return {"revision": folder.name}  # snapshot_download's folder: snapshots/<commit>


def role_parts(cfg: DictConfig, role: str) -> dict[str, str]:
    """``weights_parts`` named for a key that holds several roles: ``{"<role>_weights": ...}``."""
    return {f"{role}_{k}": v for k, v in weights_parts(cfg, role).items()}


def roles_parts(cfg: DictConfig, roles: Iterable[str], skip_missing: bool = False) -> dict[str, str]:
    """``role_parts`` of each of ``roles``, merged: what a key holding several roles adds for their content.
    ``skip_missing``: leave out a role ``cfg.model`` lacks and one whose path or hub id holds no weights here
    (``models.locate`` refuses it), for a key whose stage may not load every role (loading one refuses with the
    fix); otherwise such a role raises as ``role_parts`` does."""
    parts: dict[str, str] = {}
    for role in roles:
        if skip_missing and cfg.model.get(role) is None:
            continue
        try:
            parts.update(role_parts(cfg, role))
        except UserError:
            if not skip_missing:
                raise
    return parts


def drafter_parts(cfg: DictConfig, kind) -> dict[str, str]:
    """What distill's key adds for the drafter: its weights' content (``role_parts``) and, when it drafts in its
    own tokenizer and that differs from the verifier's (whose hash the trajectories' folder already holds),
    ``drafter_tokenizer``: the hash of the tokenizer the run would train with (which the run then refuses, before
    any work, instead of a run with the same settings being reused)."""
    from streakline.models.tokenizer import tokenizer_hash

    from .roles import role_tokenizer

    parts = role_parts(cfg, "drafter")
    if kind.tokenizer_role == "drafter":
        drafter = role_tokenizer(cfg, "drafter")
        verifier = role_tokenizer(cfg, "verifier") if drafter is not None else None
        if drafter is not None and (verifier is None or tokenizer_hash(drafter) != tokenizer_hash(verifier)):
            parts["drafter_tokenizer"] = tokenizer_hash(drafter)
    return parts


# --------------------------------------------------------------------------------------------- data
def source_files(cfg: DictConfig, sources) -> dict[str, str]:
    """``{source: digest}`` for every prompt source that names a local file, folder or cached hub dataset (after
    ``@``), and for ``pkg-code`` the listing of the installed packages it is read from; other built-in benchmarks
    and presets without ``@`` add nothing. A file that is not there adds nothing either
    (reading it says so)."""
    out = {}
    for source in sources or ():
        name, sep, where = str(source).partition("@")
        if name == "pkg-code" and not sep:  # built from what is installed: a `pip install` changes its prompts
            from streakline.data.corpora.packages import packages_fingerprint

            out[str(source)] = f"packages:{packages_fingerprint()}"
            continue
        if not sep or not where:
            continue
        digest = _data_digest(where, sha256_cache(cfg.run_root))
        if digest is not None:
            out[str(source)] = digest
    return out


def _data_digest(where: str, cache: Path) -> str | None:
    path = Path(where).expanduser()
    if path.is_file():
        return file_sha256(path, cache)
    if path.is_dir():  # a save_to_disk dataset or a folder of data files: every file, by relative name
        files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
        listing = {p.relative_to(path).as_posix(): file_sha256(p, cache) for p in files}
        return hashlib.sha256(json.dumps(listing, sort_keys=True).encode()).hexdigest()
    if where.count("/") == 1 and not where.startswith((".", "~")):  # owner/name: a hub dataset
        snapshot = hub_snapshot(where, "dataset")
        return f"revision:{snapshot.name}" if snapshot is not None else None
    return None


# --------------------------------------------------------------------------------------------- block targets
def target_identity(cfg: DictConfig) -> dict[str, Any]:
    """What a SPOT order model or a Spiffy graph was made for: ``target`` (the preset's name), ``target_fingerprint``
    (12 hex of the weights: a finished stage's folder by its run and place in it, a hub id by its commit, another
    folder by ``folder_fingerprint``, a from-scratch preset by its preset) and ``block_size`` (the preset's, else the
    folder's config.json). Equal fingerprints come from equal spot/spiffy key parts, so a lookup by key and a check
    of a recorded identity agree."""
    from streakline.models import locate
    from streakline.models.checkpoint import read_config

    from .lookup import role_key

    node = cfg.model.target
    folder = locate(node, "target")
    if folder is None:
        preset = role_key(cfg, "target")
        for k in ("name", "path", "tokenizer"):
            preset.pop(k, None)
        weights: Any = {"preset": preset}
    elif node.path:
        weights = run_output(folder) or {"folder": folder_fingerprint(folder)}
    else:
        weights = {"hub": node.hub_id, "revision": folder.name}
    block = node.block_size
    if block is None and folder is not None:
        block = read_config(folder, node.get("family")).block_size
    return {
        "target": node.name,
        "target_fingerprint": config_hash({"weights": weights}),
        "block_size": None if block is None else int(block),
    }


def target_overrides(cfg: DictConfig) -> str:
    """The ``model.target.*`` overrides of the command line, each followed by a space: what a command that makes an
    artifact for this target repeats."""
    picked = [o for o in cfg.get("overrides") or () if o.lstrip("+~").startswith("model.target.")]
    return "".join(f"{o} " for o in picked)
