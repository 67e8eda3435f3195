"""The DFlash drafter (docs/dflash.md): a ``DFlashModel``, a few layers over the verifier's layer states that draft
with the verifier's embedding, head and tokenizer; ``decoder=dflash_draft``.

stage=distill trains it on the same windows as a standalone drafter, cut ``block_size - 1`` wide with its own mask
token (``method.gamma`` may only repeat that width), through ``alignment.dflash.DFlashTrainModule``: the verifier is
always built on the training device, since its layer states are the drafter's input and its embedding and head the
drafter's own. Every export is a ``speculators`` DFlash folder (``save_dflash``, what ``vllm serve`` reads) naming
the verifier; one built from scratch also keeps the weights it started from in ``init/``, which stage=evaluate
decodes as ``dflash:base``. LoRA and on-policy labels are refused. With ``method.features=stored`` it trains on the
verifier layer states stage=trajectories stored (``data.feature_layers`` = its ``target_layer_ids``) instead of a
verifier forward per step (``stored_features``); the verifier is still built, for its embedding and head.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from streakline.alignment.dflash import DFlashTrainModule
from streakline.config import ConfigError

from .base import DrafterKind, Trainee


class DFlashKind(DrafterKind):
    def check(self, cfg: DictConfig) -> None:
        dflash = _config(cfg)
        width = dflash.block_size - 1
        if cfg.method.gamma is not None and cfg.method.gamma != width:
            raise ConfigError(
                f"method.gamma={cfg.method.gamma}, but the DFlash drafter drafts blocks of {dflash.block_size} (the "
                f"newest token and {width} masks), so its windows are {width} wide: drop method.gamma or set "
                f"method.gamma={width}"
            )
        if cfg.method.onpolicy_mix > 0:
            raise ConfigError(
                f"method.onpolicy_mix={cfg.method.onpolicy_mix}: on-policy labels are drafted by the diffusion "
                "drafters' training module, which DFlash training does not use; set method.onpolicy_mix=0"
            )
        if cfg.method.features == "stored":
            self._check_stored(cfg, dflash)
        self._check_draft_vocab(cfg, dflash)
        if cfg.trainer.lora.enabled:
            raise ConfigError(
                "trainer.lora.enabled=true: a DFlash drafter is a few layers and trains whole (its export holds only "
                "its own layers); set trainer.lora.enabled=false"
            )

    def _check_draft_vocab(self, cfg: DictConfig, dflash) -> None:
        """``method.draft_vocab``: a size in 1 .. V, a loss that reads only the verifier's tokens (a teacher's
        distribution over the whole vocabulary has no place on N rows), and no other size than a drafter folder's."""
        from streakline.alignment.losses import TEACHER_LOSSES

        n, V = cfg.method.get("draft_vocab"), dflash.layers.vocab_size
        if n is None:
            return
        if not 1 <= n <= V:
            raise ConfigError(f"method.draft_vocab={n} must lie in 1 .. {V} (the verifier's vocabulary), or be null")
        if cfg.method.loss in TEACHER_LOSSES:
            raise ConfigError(
                f"method.draft_vocab={n} with method={cfg.method.name}: its teacher spreads over all {V} tokens, a "
                "draft vocabulary's head covers only N; train it with dflash_ce, dpace, streak or ce_streak"
            )
        if dflash.draft_vocab_size not in (None, n):
            raise ConfigError(
                f"method.draft_vocab={n}, but the drafter it starts from drafts over {dflash.draft_vocab_size} tokens: "
                f"drop method.draft_vocab (its vocabulary is kept) or start from a full-vocabulary drafter"
            )

    def _check_stored(self, cfg: DictConfig, dflash) -> None:
        """``method.features=stored`` needs trajectories made with the drafter's layers, and a loss that needs no
        verifier logits beyond the stored top-k (stored features give none)."""
        from streakline.alignment.losses import TEACHER_LOSSES

        ids = list(dflash.target_layer_ids)
        layers = list(cfg.data.feature_layers)
        if layers != ids:
            have = "store none" if not layers else f"are {layers}"
            raise ConfigError(
                f"method.features=stored reads the verifier states of the drafter's target_layer_ids {ids}, but "
                f"data.feature_layers {have}: set data.feature_layers=[{','.join(map(str, ids))}] in stage="
                "trajectories and in this stage, or use method.features=online"
            )
        if cfg.method.loss in TEACHER_LOSSES and cfg.method.teacher == "online":
            raise ConfigError(
                f"method={cfg.method.name} with method.teacher=online needs the verifier's logits every step, which "
                "stored features do not give: use method.teacher=stored (trajectories with data.topk_logprobs) or "
                "method.features=online"
            )

    def stored_features(self, cfg: DictConfig):
        """The verifier features stored beside this run's trajectories (``data.features.StoredFeatures``),
        refused (ConfigError with the fix) when there are none or they hold other layers than the drafter reads."""
        from streakline.data.features import StoredFeatures
        from streakline.data.trajectories import TrajectoryError

        from ..lookup import trajectories_dir

        ids = tuple(_config(cfg).target_layer_ids)
        fix = f"rerun stage=trajectories with data.feature_layers=[{','.join(map(str, ids))}]"
        try:
            features = StoredFeatures(trajectories_dir(cfg))
        except TrajectoryError as e:
            raise ConfigError(f"method.features=stored: {e}") from e
        if features.layers != ids:
            raise ConfigError(
                f"method.features=stored: the trajectories hold the verifier states of layers {list(features.layers)}"
                f", the drafter reads {list(ids)}; {fix}, or use method.features=online"
            )
        return features

    def gamma(self, cfg: DictConfig) -> int:
        """Its block size - 1 (``check`` refuses another ``method.gamma``)."""
        return _config(cfg).block_size - 1

    def run_key(self, cfg: DictConfig) -> dict[str, Any]:
        """Its weights folder, or for one built from scratch its preset (shapes, layer ids, block, mask token),
        which a path-less standalone drafter's key never needed."""
        node = cfg.model.drafter
        if node.path or node.hub_id:
            return {"kind": "dflash", "weights": node.path or node.hub_id}
        preset = OmegaConf.to_container(node, resolve=True)
        for k in ("path", "tokenizer", "devices"):  # where it runs and reads from, not what it is
            preset.pop(k, None)
        if preset.get("source", "absent") is None:  # a field added later (as lookup.role_key): unset, it moves no run
            del preset["source"]
        return preset

    def trainee(self, cfg: DictConfig, tokenizer, *, device, run: Path, temperature: float) -> Trainee:
        from streakline.alignment.dflash import dflash_from_state
        from streakline.alignment.losses import LossSettings
        from streakline.models import build, locate
        from streakline.models.dflash_checkpoint import save_dflash

        source = locate(cfg.model.drafter, "drafter")  # None: built from scratch
        # what every export names as its target, and the tokenizer its ids are in (a load under another is refused)
        identity = {**_verifier_identity(cfg), "tokenizer": tokenizer}
        # in the dtype DeepSpeed trains the drafter in: the drafter embeds its blocks with the verifier's embedding
        # and reads its head, so under bf16 an fp32 verifier would meet bf16 layers
        dtype = "bfloat16" if cfg.trainer.precision == "bf16" else None
        verifier = build(cfg.model.verifier, "verifier", dtype=dtype, device=device)
        verifier.eval().requires_grad_(False)
        drafter = build(cfg.model.drafter, "drafter", seed=cfg.seed).share(verifier).train()
        n = cfg.method.get("draft_vocab")
        if n is not None and drafter.draft_vocab is None:  # a folder's own vocabulary is kept (check refused others)
            drafter.use_vocab(training_vocab(cfg, n, tokenizer))
        module = self.train_module(drafter, verifier, LossSettings.from_config(cfg.method), temperature=temperature)

        def export(state, target: Path, step: int):  # the speculators format (vllm serve <folder>)
            model = dflash_from_state(state, module.drafter.dflash, module.drafter.draft_vocab)
            return model, save_dflash(model, target, **identity)

        def save_start(folder: Path) -> Path:
            return save_dflash(drafter, folder, **identity)

        start = save_start if source is None else None  # a folder to start from is its own record
        return Trainee(drafter, module, drafter.dflash.mask_token_id, verifier, export, start)

    def decode_overrides(self, cfg: DictConfig) -> str:
        """The DFlash preset: the model preset's drafter is a standalone one."""
        return f"model.drafter={cfg.model.drafter.name} "


def training_vocab(cfg: DictConfig, n: int, tokenizer):
    """The draft vocabulary of ``n`` tokens for this run: the most frequent target ids of the training completions
    (``models/draft_vocab.py``; ties to the lower id), the verifier's eos ids always among them. Prints how much of
    the completions' tokens it covers, the ceiling of what a drafter over it can accept per token."""
    import numpy as np

    from streakline.data.trajectories import load_trajectories
    from streakline.models.draft_vocab import DraftVocab, count_tokens

    from ..lookup import trajectories_dir
    from ..roles import role_eos

    V = _config(cfg).layers.vocab_size
    rows = load_trajectories(trajectories_dir(cfg), verify=False)["completion_ids"]
    counts = count_tokens(rows, V)
    eos = role_eos(cfg, "verifier", tokenizer)
    keep = [e for e in (eos if isinstance(eos, list | tuple) else [eos]) if e is not None]
    vocab = DraftVocab.from_counts(counts, n, keep=keep)
    seen = int(np.count_nonzero(counts))
    print(f"distill: draft vocabulary of {n} of {V} tokens ({seen} distinct in the training completions) covers "
          f"{vocab.coverage(counts):.1%} of their {int(counts.sum()):,} tokens")  # fmt: skip
    return vocab


def _config(cfg: DictConfig):
    """The drafter's ``DFlashConfig``: from its folder, or its preset and the verifier's tokenizer."""
    from streakline.models import dflash_config

    return dflash_config(cfg.model.drafter, "drafter")


def _verifier_identity(cfg: DictConfig) -> dict[str, str | None]:
    """``save_dflash``'s ``verifier_name`` (the verifier's hub id, else its folder) and ``verifier_architecture``
    (its config.json's, else its family's): what ``vllm serve <export>`` loads as the target."""
    from streakline.models import FAMILIES, locate

    node = cfg.model.verifier
    folder = locate(node, "verifier")
    arch = None
    if folder is not None:
        try:
            arch = (json.loads((folder / "config.json").read_text()).get("architectures") or [None])[0]
        except (OSError, ValueError):
            arch = None
    if arch is None and node.family in FAMILIES:
        arch = FAMILIES[node.family].architecture
    return {"verifier_name": node.hub_id or (str(folder) if folder else node.name), "verifier_architecture": arch}


DFLASH = DFlashKind(
    "dflash",
    decoder="dflash_draft",
    checkpoint="dflash",
    tokenizer_role="verifier",  # it drafts with the verifier's embedding and head: its vocabulary by construction
    row="dflash:base",  # a DFlash model preset's drafter, undistilled: the step 0 of its dflash:<loss> lines
    train_module=DFlashTrainModule,
    start_rows=True,
)
