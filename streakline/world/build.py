"""The tiny world: a tokenizer, a verifier, a diffusion drafter and a block-diffusion target the project trains
itself from files every machine has (``model=tiny``, ``model=micro``).

    from streakline.world import attach_world
    attach_world(cfg)             # points model.verifier / drafter / target at the built checkpoints

The world lives in ``<run_root>/world/bootstrap/<hash>/`` (shared by every experiment), keyed by the model preset
(architectures and the ``model.world`` recipe) and the standard-library fingerprint. A complete folder whose files
still match the checksums in its manifest is reused; a damaged or partial one is rebuilt. ``stage=bootstrap`` builds
it on purpose; every other stage calls ``attach_world(cfg)``, which builds it first if needed.

Recipe (sizes, steps and learning rates come from ``conf/model/<world>.yaml``):
  1. a byte-level BPE tokenizer on the code + math training texts;
  2. the verifier, causal LM on a code/math mix;
  3. the drafter, masked diffusion on packed draft windows (``prefix_causal``);
  4. the target, block diffusion (``block_causal``), from the verifier's weights when ``init_from: verifier``;
  5. the sanity report (``report.json``, ``world/report.py``): held-out loss/accuracy, the drafter's simulated
     streak against the verifier's greedy continuations, the target's forwards per token under static and
     threshold decoding.

Device: the stages pass ``pipelines.common.roles.device()`` (the GPU when there is one; the default here is the
CPU). Every model is initialised on the CPU under its seed and then moved, and every batch, window offset and noise
draw comes from a CPU generator and is then moved, so a run sees the same data and starts from the same weights on
every machine; on the CPU nothing moves, and a build is bit for bit what it was before there was a GPU path.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from streakline import __version__
from streakline.alignment.pretrain import block_diffusion_loss, causal_lm_loss, mdm_window_loss, pretrain
from streakline.artifacts import (
    LOCK_NAME,
    RunLockedError,
    StageRun,
    config_hash,
    find_complete,
    read_manifest,
    wait_for_complete,
    write_json_atomic,
)
from streakline.config import check_world
from streakline.data import code_texts, corpus_fingerprint, math_texts, train_tokenizer
from streakline.data.streams import TokenStream, mixed_batch
from streakline.models import build, is_dflash, save_pretrained
from streakline.models.tokenizer import has_tokenizer, load_tokenizer, mask_token_id

from .report import sanity_report

WORLD_EXPERIMENT = "world"
STAGE = "bootstrap"  # the world is this stage's artifact
ROLES = ("verifier", "drafter", "target")
# Bump when the recipe's code changes what a config produces, so old caches are not mistaken for new ones.
RECIPE_VERSION = 2
# How long a rank waits for another rank of its job to build the world before it gives up (a hung builder): the tiny
# world takes about 15 minutes on 2 CPU cores.
WORLD_WAIT_S = 3600.0


def world_key(cfg: DictConfig, device: str | torch.device = "cpu") -> dict[str, Any]:
    """What the world depends on: the model preset without paths, the stdlib corpus, the recipe version and, for a
    world trained on a GPU, which GPU (its kernels round otherwise than the CPU's, so its weights are another
    result; a CPU world's key holds no device, as before there was a GPU path)."""
    model = OmegaConf.to_container(cfg.model, resolve=True)
    for role in ROLES:
        model[role]["path"] = model[role]["tokenizer"] = None
        model[role].pop("devices", None)  # where a model runs, not what it is
        for key, default in LATER_CHECKPOINT_DEFAULTS.items():  # at their defaults, fields added later move no world
            if model[role].get(key, default) == default:
                model[role].pop(key, None)
        recipe = (model.get("world") or {}).get(role) or {}
        if recipe.get("init_from", "absent") is None:  # a field added later: unset, it must not move old worlds
            del recipe["init_from"]
    key = {"model": model, "corpus": corpus_fingerprint(), "recipe": RECIPE_VERSION}
    device = torch.device(device)
    if device.type != "cpu":
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        key["trained_on"] = f"{device.type}:{name}"
    return key


# Checkpoint preset fields added after worlds were built, with the value every earlier preset meant.
LATER_CHECKPOINT_DEFAULTS = {"kind": "transformer", "target_layer_ids": None, "source": None}


def world_config(cfg: DictConfig) -> DictConfig:
    """``cfg`` as the world sees it: a role pointed at its own checkpoint (``path``) does not use the world's model
    of that role, so the world keeps that role's preset values (``conf/checkpoint/<name>.yaml``) whatever the command
    line changed of it. Changing such a role's family, mask token or block size then finds the same world instead of
    building another (15 minutes for ``model=tiny``). A role whose preset file is not found stays as it is.

    A DFlash drafter (``model.drafter=micro-dflash``, or a path to a DFlash export) is not a model the world builds:
    the world keeps the drafter its model preset names (``conf/model/<name>.yaml``), so it is the same world."""
    from streakline.config import CONF_DIR

    reset = {}
    for role in ROLES:
        if is_dflash(cfg.model[role], role):
            reset[role] = _preset_node(CONF_DIR, _model_preset_role(CONF_DIR, cfg.model.name, role))
            continue
        preset = CONF_DIR / "checkpoint" / f"{cfg.model[role].name}.yaml"
        if cfg.model[role].path is not None and preset.is_file():
            node = _preset_node(CONF_DIR, cfg.model[role].name)
            node.path, node.tokenizer = cfg.model[role].path, cfg.model[role].tokenizer
            reset[role] = node
    if not reset:
        return cfg
    out = copy.deepcopy(cfg)
    for role, node in reset.items():
        out.model[role] = node
    return out


def _preset_node(conf_dir: Path, name: str) -> DictConfig:
    from streakline.config.schema import CheckpointConfig

    preset = OmegaConf.load(conf_dir / "checkpoint" / f"{name}.yaml")
    return OmegaConf.merge(OmegaConf.structured(CheckpointConfig), preset)


def _model_preset_role(conf_dir: Path, model: str, role: str) -> str:
    """The checkpoint preset ``conf/model/<model>.yaml`` puts in ``role`` (its ``/checkpoint@<role>`` default)."""
    from streakline.config import ConfigError

    path = conf_dir / "model" / f"{model}.yaml"
    defaults = OmegaConf.load(path).get("defaults", []) if path.is_file() else []
    for entry in defaults:
        for key, value in entry.items() if isinstance(entry, DictConfig) else ():
            if key.endswith(f"@{role}") and (conf_dir / "checkpoint" / f"{value}.yaml").is_file():
                return str(value)
    raise ConfigError(
        f"model.{role} is a DFlash drafter, which the {model} world does not build, and conf/model/{model}.yaml names "
        f"no {role} preset of its own for the world to build instead"
    )


def ensure_world(cfg: DictConfig, progress: bool = True, device: str | torch.device = "cpu") -> Path:
    """The folder of the world ``cfg.model`` describes: reused when intact, (re)built otherwise (trained on
    ``device``; a GPU-trained world is keyed apart from the CPU's: ``world_key``)."""
    key = world_key(cfg, device)
    digest = config_hash(key)
    found = find_complete(cfg.run_root, WORLD_EXPERIMENT, STAGE, digest)
    if found is not None:
        problem = _damage(found)
        if problem is None:
            return found
        print(f"bootstrap: the cached world at {found} is damaged ({problem}); rebuilding it")
    try:
        return _build(cfg, key, progress, torch.device(device))
    except RunLockedError as err:
        if not err.same_job:
            raise
        builder = err.holder.get("pid")
    # Another rank of this torchrun job builds it (every rank attaches the world): wait for its manifest, and for
    # files that match it (a damaged world the builder is about to replace is not taken).
    print(f"bootstrap: another rank of this job (PID {builder}) is building the world; waiting for it")
    make = f"python launch.py stage=bootstrap model={cfg.model.name} <the job's other model.* settings>"
    return wait_for_complete(
        cfg.run_root, WORLD_EXPERIMENT, STAGE, digest, WORLD_WAIT_S, poll=1.0, damage=_damage, make=make
    )


def attach_world(
    cfg: DictConfig, progress: bool = True, roles: tuple[str, ...] = ROLES, device: str | torch.device = "cpu"
) -> DictConfig:
    """Point each role of a built world at its checkpoint (and tokenizer) folder, building the world if needed.

    Roles given a ``path`` on the command line (``model=tiny model.drafter.path=runs/.../drafter``) keep it: the
    world's hash ignores paths, so the same world is found. Such a role reads its tokenizer from its folder, or from
    the world's tokenizer folder when its folder holds none and its vocabulary is the world's (a checkpoint made
    from the world, e.g. by transformers' save_pretrained, which saves no tokenizer): a foreign checkpoint never
    borrows the world's tokenizer. A role's ``tokenizer`` given on the command line is kept either way.

    A DFlash drafter role (``model.drafter=micro-dflash``) is no model of the world's: it keeps its preset (built from
    scratch) or its path, and gets the world's tokenizer, which is its verifier's.

    ``roles``: the roles the stage loads. When each of them has a ``path``, the world is not built for them (it is
    still used, if already built, for the tokenizer). Presets without a world pass through untouched.
    ``device``: where a world that must be built trains (the stages pass ``roles.device()``).

    Roles whose preset has a ``source`` (``model=smol``) are imported first (``world/imports.py``), world or not.
    """
    from .imports import attach_imports

    attach_imports(cfg, roles, progress)  # roles imported from a pip package's file (model=smol), and cuts of them
    if cfg.model.world is None:
        return cfg
    world = world_config(cfg)
    check_world(world)
    if all(cfg.model[role].path is not None for role in roles):
        folder = find_complete(cfg.run_root, WORLD_EXPERIMENT, STAGE, config_hash(world_key(world, device)))
    else:
        folder = ensure_world(world, progress, device)
    for role in ROLES:
        node = cfg.model[role]
        if is_dflash(node, role):
            # not a model of the world's, but it drafts with the verifier's tokenizer (the world's), whose mask token
            # fills its blocks
            if folder is not None:
                node.tokenizer = node.tokenizer or str(folder / "tokenizer")
            continue
        if node.path is None:
            if folder is None:
                continue  # not a role this stage loads, and no world to point it at
            node.path = str(folder / role)
            # a tokenizer named on the command line is kept: role_tokenizer then checks that it fits the model
            node.tokenizer = node.tokenizer or str(folder / "tokenizer")
        elif node.tokenizer is None and folder is not None and not has_tokenizer(node.path) and _world_vocab(cfg, node):
            node.tokenizer = str(folder / "tokenizer")
    return cfg


def _world_vocab(cfg: DictConfig, node) -> bool:
    """Whether the checkpoint at ``node.path`` has the world's vocabulary size (so the world's tokenizer is its)."""
    from streakline.models.checkpoint import CheckpointError, read_config

    try:
        return read_config(node.path, node.family).vocab_size == cfg.model.world.vocab_size
    except CheckpointError:
        return False  # unreadable: the stage that loads it says why


def _files(folder: Path) -> dict[str, str]:
    out = {}
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if path.is_file() and not rel.startswith("manifest") and rel not in ("metrics.jsonl", LOCK_NAME):
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def _damage(folder: Path) -> str | None:
    expected = read_manifest(folder).metrics.get("files", {})
    if not expected:
        return "its manifest lists no file checksums"
    actual = _files(folder)
    for rel, digest in expected.items():
        if rel not in actual:
            return f"{rel} is missing"
        if actual[rel] != digest:
            return f"{rel} does not match its checksum"
    return None


def _build(cfg: DictConfig, key: dict[str, Any], progress: bool, device: torch.device) -> Path:
    with _deterministic(device):
        return _build_world(cfg, key, progress, device)


@contextlib.contextmanager
def _deterministic(device: torch.device):
    """Deterministic kernels for the build, restored after: on a GPU the embedding and index backward passes
    accumulate with atomics in whatever order threads finish, so two builds there would differ in their last bits
    (the CPU's kernels are deterministic already, and a CPU build is what it always was)."""
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's reductions in a fixed order
        torch.use_deterministic_algorithms(True, warn_only=True)  # an op without such a kernel warns, not fails
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def _build_world(cfg: DictConfig, key: dict[str, Any], progress: bool, device: torch.device) -> Path:
    world = cfg.model.world
    torch.manual_seed(world.seed)
    timings: dict[str, float] = {}
    with StageRun(cfg.run_root, WORLD_EXPERIMENT, STAGE, key) as run:  # the lock first: no other build in there
        out = run.dir
        done = find_complete(cfg.run_root, WORLD_EXPERIMENT, STAGE, run.cfg_hash)
        if done is not None and _damage(done) is None:  # another process finished it while this one looked
            run.abandon()
            return done
        for stale in out.iterdir():  # a partial or damaged build: nothing in it can be trusted
            if stale.name != LOCK_NAME:
                shutil.rmtree(stale) if stale.is_dir() and not stale.is_symlink() else stale.unlink()
        metrics_path = out / "metrics.jsonl"
        print(f"bootstrap: building the {cfg.model.name} world in {out} (on {device.type})")

        t = time.perf_counter()
        code_train = [d["text"] for d in _limited(code_texts("train"), world.max_code_files)]
        math_train = [d["text"] for d in math_texts("train", world.n_math, seed=world.seed)]
        train_tokenizer(code_train + math_train, out / "tokenizer", vocab_size=world.vocab_size)
        tokenizer = load_tokenizer(out / "tokenizer")
        mask_id = mask_token_id(tokenizer, cfg.model.drafter.mask_token, role="drafter")
        code_held = [d["text"] for d in _limited(code_texts("heldout"), world.max_code_files)]
        math_held = [d["text"] for d in math_texts("heldout", max(64, world.report_prompts), seed=world.seed)]
        # Word problems are short: windows start at a problem so its question is in view; source files are long.
        streams = {
            split: [
                TokenStream.from_texts(code, tokenizer, "code"),
                TokenStream.from_texts(math, tokenizer, "math", aligned=True),
            ]
            for split, code, math in (("train", code_train, math_train), ("heldout", code_held, math_held))
        }
        timings["tokenizer_and_data"] = time.perf_counter() - t
        models, evals = {}, {}
        for i, role in enumerate(ROLES):
            t = time.perf_counter()
            pcfg = world[role]
            # initialised on the CPU under the seed (the same start on every machine), then moved
            model = build(cfg.model[role], role, dtype="float32", seed=world.seed + i)
            if pcfg.init_from is not None:  # e.g. the target from the verifier: AR weights, block-diffusion training
                model.load_state_dict(models[pcfg.init_from].state_dict())
            model.to(device)
            model.config.mask_token_id = mask_id
            model.config.eos_token_id = tokenizer.eos_token_id
            model.config.pad_token_id = tokenizer.pad_token_id
            gen = torch.Generator().manual_seed(world.seed * 1000 + i)  # on the CPU: the same data everywhere
            step_loss = _objective(role, world, mask_id, gen)
            evals[role] = pretrain(
                model,
                name=role,
                pcfg=pcfg,
                next_batch=lambda p=pcfg, g=gen: mixed_batch(
                    streams["train"], [1 - p.math_share, p.math_share], p.batch_size, p.seq_len, g
                ).to(device),
                step_loss=step_loss,
                evaluate=_evaluator(role, world, streams["heldout"], mask_id, pcfg, device),
                metrics_path=metrics_path,
                progress=progress,
            )
            save_pretrained(model, out / role, tokenizer=tokenizer)
            models[role] = model
            timings[role] = time.perf_counter() - t
        t = time.perf_counter()
        report = sanity_report(models, tokenizer, world, evals)
        timings["report"] = time.perf_counter() - t
        report["seconds"] = timings
        report["device"] = device.type
        report["streakline"] = __version__
        write_json_atomic(out / "report.json", report)
        for name in ("tokenizer", *ROLES, "report.json", "metrics.jsonl"):
            run.add_output(name)
        run.metrics["report"] = report
        run.metrics["files"] = _files(out)
    return run.dir


def _limited(items, limit: int | None) -> list:
    items = list(items)
    return items if limit is None else items[:limit]


def _objective(role: str, world, mask_id: int, gen: torch.Generator):
    if role == "verifier":
        return causal_lm_loss
    if role == "drafter":
        return lambda m, b: mdm_window_loss(
            m,
            b,
            gen,
            width=world.window,
            windows=world.windows_per_seq,
            mask_id=mask_id,
            full_share=world.drafter_full_share,
            ar_weight=world.drafter_ar_weight,
        )
    return lambda m, b: block_diffusion_loss(m, b, gen, mask_id=mask_id)


def _evaluator(role: str, world, heldout: list[TokenStream], mask_id: int, pcfg, device: torch.device):
    """Held-out metrics per domain, on the same windows (and noise) at every evaluation; batches drawn on the CPU,
    evaluated on ``device``."""

    def evaluate(model) -> dict[str, float]:
        metrics = {}
        for k, stream in enumerate(heldout):
            gen = torch.Generator().manual_seed(10_000 + k)
            losses, accs = [], []
            for _ in range(pcfg.eval_batches):
                batch = stream.sample(pcfg.batch_size, pcfg.seq_len, gen).to(device)
                if role == "verifier":
                    loss, acc = causal_lm_loss(model, batch)
                    losses.append(loss)
                    accs.append(acc)
                elif role == "drafter":
                    loss, _ = mdm_window_loss(
                        model, batch, gen, width=world.window, windows=world.windows_per_seq, mask_id=mask_id
                    )
                    _, acc = mdm_window_loss(
                        model,
                        batch,
                        gen,
                        width=world.report_gamma,
                        windows=world.windows_per_seq,
                        mask_id=mask_id,
                        full_mask=True,
                    )
                    losses.append(loss)
                    accs.append(acc)
                else:
                    loss, acc = block_diffusion_loss(model, batch, gen, mask_id=mask_id)
                    losses.append(loss)
                    accs.append(acc)
            metrics[f"{stream.name}_loss"] = float(torch.stack(losses).mean())
            metrics[f"{stream.name}_accuracy"] = float(torch.stack(accs).mean())
        return metrics

    return evaluate
