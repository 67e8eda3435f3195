"""The distillation trainer: drafter windows in, registered loss, DeepSpeed steps, checkpoints, exact resume.

    module = DraftTrainModule(drafter, settings, mask_id=..., temperature=1.0, verifier=None)
    engine = strategy.setup(module)
    trainer = Trainer(strategy, engine, windows, trainer_cfg, run_dir, tracker, evaluate=fn, export=fn)
    trainer.fit(start_step=trainer.resume())

Data: rank r at optimizer step s, micro-step a reads micro-batch ``(s * grad_accum + a) * world + r`` of the window
stream (``TrajectoryWindows.batches``), so a resumed run, whatever killed it, sees exactly the batches an
uninterrupted run would have seen. Checkpoints every ``save_every`` steps: DeepSpeed state under ``deepspeed/``
(weights, optimizer, LR schedule, data position and RNG states as client state) and a Hugging Face folder under
``checkpoints/step-XXXXXX/`` that the decoder loads directly (LoRA merged). Once a checkpoint is complete (saved,
``latest`` naming it, its export recorded in ``EXPORTED``) the older DeepSpeed tags beyond ``trainer.keep_last`` are
deleted, oldest first, and the exports beyond ``trainer.keep_exports`` (None, the default: every export stays, for
Fig. 7's curve); a folder is renamed to a temp name before it is deleted, and ``resume`` sweeps such leftovers, so a
kill mid-prune loses nothing. ``trainer.resume_from`` starts a run that has no checkpoint of its own from another
run's (extending it: more steps, another lr). SIGTERM / SIGUSR1 (Slurm preemption) finish the current step, save,
and stop with ``Preempted``. ``STREAKLINE_FAULT_SIGTERM_AT_STEP=n`` (tests) sends the process a SIGTERM after step n.

    python -m pytest tests/alignment/test_trainer.py -q
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
from collections.abc import Callable
from itertools import islice
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from streakline.artifacts import atomic_file, remove_tree, sweep_temp_files, write_json_atomic
from streakline.config import ConfigError
from streakline.faults import kill_point
from streakline.models import Transformer

from .data import TrajectoryWindows, WindowBatch, unpack_windows
from .losses import LossInput, LossSettings, compute_loss
from .pretrain import window_noise
from .stopping import Deadline, Plateau, pass_steps, step_examples
from .telemetry import Telemetry, is_wall_clock, run_metadata
from .windows import slot_rows

FAULT_SIGTERM_AT = "STREAKLINE_FAULT_SIGTERM_AT_STEP"
EXPORTED = "exported.json"  # in the DeepSpeed folder: the tag and folder of the last finished export
TAG = re.compile(r"^step-(\d+)$")  # the DeepSpeed tags save() writes, and the names of their exports


def find_checkpoint(path: str | os.PathLike) -> tuple[Path, str]:
    """``(DeepSpeed folder, tag)`` that ``trainer.resume_from`` names: a distill run folder or its ``deepspeed/``
    folder (the tag its ``latest`` file names), or one tag folder such as ``<run>/deepspeed/step-000500``.
    ConfigError naming the path and the fix when there is no saved checkpoint there."""
    where = Path(os.path.abspath(os.path.expanduser(path)))
    for folder in (where / "deepspeed", where):
        latest = folder / "latest"
        if latest.is_file():
            tag = latest.read_text(encoding="utf-8").strip()
            if tag and _saved_tag(folder / tag):
                return folder, tag
            raise ConfigError(
                f"trainer.resume_from={path}: {latest} names {tag!r}, which holds no saved checkpoint; point "
                f"trainer.resume_from at one of the tag folders in {folder}"
            )
    if _saved_tag(where):
        return where.parent, where.name
    raise ConfigError(
        f"trainer.resume_from={path}: no DeepSpeed checkpoint there; give a distill run folder, its deepspeed/ "
        "folder or one of its deepspeed/step-* folders (or trainer.resume_from=null)"
    )


def _saved_tag(folder: Path) -> bool:
    # DeepSpeed writes <tag>/mp_rank_00_model_states.pt (ZeRO-3: zero_pp_rank_0_mp_rank_00_model_states.pt)
    return folder.is_dir() and any(folder.glob("*model_states.pt"))


def tag_step(tag: str) -> int | None:
    """The step of a tag ``save`` wrote (``step-000500`` -> 500); None for any other name."""
    m = TAG.match(tag)
    return int(m[1]) if m else None


def summarize(result: dict[str, Any]) -> str:
    """One line of the scalar evaluation numbers, e.g. ``tiny-math sim_streak 1.41 decoder_streak 1.52 | ...``."""
    groups: dict[str, list[str]] = {}
    for key, value in result.items():
        parts = key.split("/")
        if len(parts) == 3 and isinstance(value, float | int):
            groups.setdefault(parts[1], []).append(f"{parts[2]} {value:.3f}")
    return " | ".join(f"{name} " + " ".join(items) for name, items in groups.items())


class Preempted(SystemExit):
    """Raised after a preemption signal once the checkpoint is safe; exits with status 143 like a SIGTERM."""

    def __init__(self, step: int) -> None:
        super().__init__(143)
        self.step = step


class DraftTrainModule(nn.Module):
    """Drafter + loss as one module, so DeepSpeed wraps (and ZeRO-3 gathers) everything the loss touches."""

    def __init__(
        self,
        drafter: Transformer,
        settings: LossSettings,
        *,
        mask_id: int,
        temperature: float = 1.0,
        verifier: Transformer | None = None,
        onpolicy_mix: float = 0.0,
        mdm_full_share: float = 0.5,
    ) -> None:
        super().__init__()
        if onpolicy_mix > 0 and verifier is None:
            raise ValueError("on-policy windows need the online verifier to score them (method.teacher=online)")
        self.drafter = drafter
        self.settings, self.mask_id, self.temperature = settings, mask_id, temperature
        self.onpolicy_mix, self.mdm_full_share = onpolicy_mix, mdm_full_share
        self.packed = drafter.config.attention == "prefix_causal"
        self._verifier = [verifier] if verifier is not None else []  # a list: not a submodule, never trained

    def external_parameters(self):
        return [(self, self.drafter.output_weight)]

    def forward(self, batch: WindowBatch) -> tuple[torch.Tensor, dict[str, Any]]:
        device = self.drafter.embed.weight.device
        batch = batch.to(device)
        shift = self.drafter.config.shift
        keep = batch.window_valid.flatten()
        noise = self._mdm_noise(batch) if self.settings.name == "mdm" else None
        fill = None if noise is None else torch.where(noise[1], self.mask_id, batch.labels)
        if self.packed:
            packed = batch.pack(self.mask_id, shift, fill=fill)
            h = self.drafter.hidden(packed.input_ids, position_ids=packed.position_ids, attn_mask=packed.attn_mask)
            B, W, G = packed.logit_index.shape
            index = packed.logit_index.reshape(B, W * G)
            picked = torch.gather(h, 1, index[:, :, None].expand(-1, -1, h.shape[-1])).view(B * W, G, -1)[keep]
        else:
            ids, attn, prefix_len, _, _ = unpack_windows(batch, self.mask_id)
            G = batch.labels.shape[-1]
            if fill is not None:  # the window's unmasked slots show their tokens
                ids = ids.scatter(1, prefix_len[:, None] + torch.arange(G, device=device), fill[batch.window_valid])
            h = self.drafter.hidden(ids, attention_mask=attn, prefix_len=prefix_len)
            slots = prefix_len[:, None] + torch.arange(G, device=device) - (1 if shift else 0)
            picked = torch.gather(h, 1, slots[:, :, None].expand(-1, -1, h.shape[-1]))
        labels = batch.labels.flatten(0, 1)[keep]
        valid = batch.valid.flatten(0, 1)[keep]
        reads = {}  # what the loss reads besides the slots: a teacher, or the mdm noise
        if self.onpolicy_mix > 0:
            # DistillSpec's on-policy data: a fraction of the windows get labels drafted by the drafter itself
            # (one denoising step, x ~ Q at the training temperature), and the verifier scores those sequences
            with torch.no_grad():
                chosen = torch.rand(labels.shape[0], device=device) < self.onpolicy_mix
                logits = self.drafter.logits(picked.detach()).float() / max(self.temperature, 1e-6)
                sampled = torch.distributions.Categorical(logits=logits).sample()
                labels = torch.where(chosen[:, None] & valid, sampled, labels)
            reads = {"teacher_logits": self._window_teacher_logits(batch, labels)}
        elif batch.teacher_ids is not None:
            reads = {
                "teacher_ids": batch.teacher_ids.flatten(0, 1)[keep],
                "teacher_logprobs": batch.teacher_logprobs.flatten(0, 1)[keep].float(),
            }
        elif self._verifier:
            reads = {"teacher_logits": self._teacher_logits(batch)[keep]}
        elif noise is not None:
            rate, masked = noise
            reads = {"rate": rate.flatten(0, 1)[keep].flatten(), "masked": masked.flatten(0, 1)[keep]}
        out = compute_loss(
            LossInput(
                hidden=picked,
                weight=self.drafter.output_weight,
                labels=labels,
                valid=valid,
                temperature=self.temperature,
                **reads,
            ),
            self.settings,
        )
        return out.loss, out.metrics

    def _mdm_noise(self, batch: WindowBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """``method=mdm``: each window's mask rate ``[B, W, 1]`` and hidden slots ``[B, W, G]`` (``mdm_full_share``
        of the windows fully hidden, as drafting sees them), drawn from the global torch RNG on the CPU: the
        checkpoints save that generator, so a resumed run draws what an unbroken one would."""
        rate, masked = window_noise(tuple(batch.labels.shape), None, full_share=self.mdm_full_share)
        device = batch.labels.device
        return rate.to(device), masked.to(device)

    @torch.no_grad()
    def _window_teacher_logits(self, batch: WindowBatch, labels: torch.Tensor) -> torch.Tensor:
        """``[N, G, V]`` verifier logits for each real window's slots given ``labels`` ``[N, G]`` as the window's
        tokens: one verifier row ``[seq[:offset], labels]`` per window (slot j is predicted from position
        ``offset + j - 1``)."""
        verifier = self._verifier[0]
        ids, attn, prefix_len, _, _ = unpack_windows(batch, self.mask_id)
        G = labels.shape[1]
        slots = prefix_len[:, None] + torch.arange(G, device=ids.device)
        ids = ids.scatter(1, slots, labels)
        logits = verifier(ids, attention_mask=attn.long())
        pos = slots - 1
        return torch.gather(logits, 1, pos[:, :, None].expand(-1, -1, logits.shape[-1])).float()

    @torch.no_grad()
    def _teacher_logits(self, batch: WindowBatch) -> torch.Tensor:
        """``[B*W, G, V]`` online verifier logits for every slot: the verifier predicts position ``i`` from ``i-1``."""
        logits = self._verifier[0](batch.clean, attention_mask=batch.pad_valid.long())
        return slot_rows(logits, batch.offsets, batch.labels.shape[-1]).float()


class Trainer:
    def __init__(
        self,
        strategy,
        engine,
        windows: TrajectoryWindows,
        cfg,
        run_dir: Path,
        tracker,
        *,
        evaluate: Callable[[int], dict[str, Any]] | None = None,
        export: Callable[[int, dict[str, torch.Tensor]], Path] | None = None,
    ) -> None:
        self.strategy, self.engine, self.windows, self.cfg = strategy, engine, windows, cfg
        self.run_dir, self.tracker = Path(run_dir), tracker
        self.evaluate, self.export = evaluate, export
        self.ds_dir = self.run_dir / "deepspeed"
        self.preempted = False
        self.sigterm_at = int(os.environ.get(FAULT_SIGTERM_AT, "0") or 0)
        self.last_export: Path | None = None
        # trainer.patience: stop on a held-out plateau; the best check's export is the run's drafter (stopping.py)
        patience = cfg.get("patience")
        per_pass = pass_steps(len(windows), step_examples(cfg, strategy.world_size))
        self.plateau = (
            Plateau(patience, cfg.get("stop_metric", "sim_streak"), min_steps=cfg.warmup_steps, min_gap=per_pass)
            if patience
            else None
        )
        self.stopped_at: int | None = None  # the step a plateau or the time budget stopped the run at (None: it ran
        self.stopped_by: str | None = None  # to max_steps), and which: "plateau" or "max_minutes"
        self.telemetry = Telemetry(strategy, engine, cfg)  # alignment/telemetry.py: what fit logs beyond the loss
        self.run_info: dict[str, Any] = {}  # the run's shape (telemetry.run_metadata), set by fit on the main rank

    # ------------------------------------------------------------------ resume
    def resume(self) -> int:
        """Load the latest DeepSpeed checkpoint of this run folder, else the one ``trainer.resume_from`` names, if
        any; return the step to continue from.

        A run killed at any point resumes from what its last checkpoint holds: the export of that checkpoint is
        redone when the kill came between the two (``EXPORTED`` names the last finished export), and the metrics
        log loses the lines of steps after the checkpoint, which the resumed run logs again; one killed before its
        first checkpoint starts again from step 0 with an empty log. The run's own checkpoint wins over
        ``resume_from``, so a rerun of an extended run resumes itself."""
        if self.strategy.is_main:  # deletions (and writes) a kill cut short
            for folder in (self.ds_dir, self.run_dir / "checkpoints"):
                if folder.is_dir():
                    sweep_temp_files(folder)
        latest = self.ds_dir / "latest"
        if not latest.is_file():
            if self.cfg.resume_from:
                return self._start_from(self.cfg.resume_from)  # its _load forgets this log's steps past its own
            if self.strategy.is_main:
                # a start from step 0: an earlier attempt killed before its first checkpoint logged steps this one
                # logs again, so the log starts afresh, as a resume forgets the steps after its checkpoint
                self._forget_logged_after(-1)
            return 0
        tag = latest.read_text().strip()
        step = self._load(self.ds_dir, tag)
        if self.strategy.is_main:
            print(f"distill: resumed from {self.ds_dir / tag} at step {step}")
        exported = self._exported()
        if exported is not None and exported["tag"] == tag and Path(exported["path"]).is_dir():
            self.last_export = Path(exported["path"])
        elif self.export is not None:
            if self.strategy.is_main:
                print(f"distill: the checkpoint at step {step} was never exported; exporting it now")
            self._export(step, tag)
        if self.strategy.is_main:  # the prune a kill (or a smaller trainer.keep_last) left undone
            self._prune(tag)
        self.strategy.barrier()
        return step

    def _load(self, folder: Path, tag: str) -> int:
        """Load DeepSpeed checkpoint ``folder/tag`` and its RNG states; the metrics log forgets later steps."""
        state = self.strategy.load(self.engine, folder, tag)
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["py_rng"])
        step = int(state["step"])
        self.telemetry.label_tokens_seen = state.get("label_tokens")  # None: a checkpoint older than the counter
        if self.plateau is not None:
            self.plateau.load(state.get("plateau"))
        if self.strategy.is_main:
            self._forget_logged_after(step)  # an earlier attempt of this run may have logged steps past it
        return step

    def _start_from(self, resume_from: str) -> int:
        """Start from another run's checkpoint (``trainer.resume_from``): its weights, optimizer, step, data
        position and RNG states, on this run's LR schedule (``_follow_schedule``). Nothing is exported or pruned
        there: that folder belongs to the other run."""
        folder, tag = find_checkpoint(resume_from)
        step = self._load(folder, tag)
        if step >= self.cfg.max_steps:  # DistillStage.check refuses this earlier for the tags save() names
            raise ConfigError(
                f"trainer.resume_from={resume_from} holds step {step} and trainer.max_steps={self.cfg.max_steps} "
                f"leaves nothing to train; set trainer.max_steps above {step}"
            )
        self._follow_schedule()
        if self.strategy.is_main:
            print(f"distill: starting from {folder / tag} (trainer.resume_from) at step {step}")
        return step

    def _follow_schedule(self) -> None:
        """Put the LR schedule loaded from another run on this run's (``lr``, ``warmup_steps``, ``max_steps``,
        ``min_lr_ratio``) at the loaded step. LambdaLR saves its step and base LRs but not its lambda (this run's,
        built from this config), and the optimizer saves the current LR: left alone, a larger max_steps would take
        effect at the next step but a changed lr never would. With nothing changed this writes the loaded values
        back, so an extension of an unchanged run stays bit-exact."""
        scheduler = self.engine.lr_scheduler
        scheduler.base_lrs = [float(self.cfg.lr)] * len(scheduler.base_lrs)
        lrs = [base * f(scheduler.last_epoch) for base, f in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)]
        for group, base, lr in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, lrs, strict=True):
            group["initial_lr"], group["lr"] = base, lr
        scheduler._last_lr = lrs

    # ------------------------------------------------------------------ loop
    def fit(self, start_step: int = 0) -> dict[str, Any]:
        """Train from ``start_step`` to ``trainer.max_steps``; returns the last logged metrics without the wall-clock
        ones (``telemetry.is_wall_clock``: those stay in the log and W&B) plus the run's shape as ``run/<key>``,
        which the stage puts in the manifest."""
        c = self.cfg
        world, rank = self.strategy.world_size, self.strategy.rank
        first = start_step * c.grad_accum * world + rank
        stream = islice(self.windows.batches(c.micro_batch_size, start=first), 0, None, world)
        handlers = self._trap_signals()
        last: dict[str, Any] = {}
        tel = self.telemetry
        if self.strategy.is_main:
            self.run_info = run_metadata(self.strategy, self.engine, self.windows, c, tel.params)
            self.tracker.update_config({"run": self.run_info})
        bar = tqdm(
            total=c.max_steps, initial=start_step, desc="distill", unit="step", disable=not self.strategy.is_main,
            dynamic_ncols=True,
        )  # fmt: skip
        tel.start(start_step)
        deadline = Deadline(c.get("max_minutes"))  # this process's loop: a resumed run gets the budget afresh
        try:
            for step in range(start_step, c.max_steps):
                metrics: dict[str, Any] = {}
                done = step + 1
                log_now = done % max(1, c.log_every) == 0 or done == c.max_steps
                for micro in range(c.grad_accum):
                    with tel.phase("data"):
                        batch = next(stream)
                    with tel.phase("forward"):
                        loss, metrics = self.engine(batch)
                    boundary = micro == c.grad_accum - 1
                    self.strategy.step(self.engine, loss, clock=tel.clock, measure_grad_norm=log_now and boundary)
                    tel.count(batch)
                if done == self.sigterm_at:  # fault injection (tests): a preemption notice at a known step
                    os.kill(os.getpid(), signal.SIGTERM)
                if log_now:
                    telemetry = tel.report(done)  # every rank: it gathers the ranks' counts
                    if self.strategy.is_main:
                        last = {
                            **metrics,
                            "loss": float(loss.detach()),  # rank 0's micro-batch (other ranks see other data)
                            "lr": self.engine.get_lr()[0],
                            **telemetry,
                            "zero_stage": c.zero_stage,
                        }
                        self.tracker.log(last, step=done)
                        kill_point(f"distill:logged:step-{done:06d}")  # the kill harness: logged, maybe not saved
                        bar.set_postfix(progress(last), refresh=False)
                bar.update(1)
                # trainer.max_minutes, asked at logging steps (the main rank's clock decides for all): this step is
                # then the last, checked and saved as the one at max_steps would be
                out_of_time = log_now and deadline.seconds is not None and self._main_says(deadline.passed())
                final = done == c.max_steps or out_of_time
                verdict = None
                if self.evaluate is not None and (done % c.eval_every == 0 or final):
                    with tel.phase("eval"):
                        result = self.evaluate(done)
                    if result:
                        self.tracker.log(result, step=done)
                        last.update(result)
                        bar.write(f"step {done}: " + summarize(result))
                    verdict = self._plateau(done, result)
                if done % c.save_every == 0 or final or self.preempted or verdict in ("best", "stop"):
                    with tel.phase("checkpoint"):
                        self.save(done)  # a new best is saved (and exported) when it happens: it may be the drafter
                if self.preempted:
                    raise Preempted(done)
                if verdict == "stop":
                    self.stopped_at, self.stopped_by = done, "plateau"
                    bar.write(f"step {done}: no better held-out {c.stop_metric} for {c.patience} checks; stopping "
                              f"(best {self.plateau.best:.4g} at step {self.plateau.best_step})")  # fmt: skip
                    break
                if out_of_time and done < c.max_steps:
                    self.stopped_at, self.stopped_by = done, "max_minutes"
                    bar.write(
                        f"step {done}: trainer.max_minutes={c.max_minutes:g} spent; stopping at step {done} of "
                        f"{c.max_steps} ({deadline.elapsed_minutes():.1f} minutes with the last check and save)"
                    )
                    break
        finally:
            tel.stop()
            bar.close()
            for sig, old in handlers.items():
                signal.signal(sig, old)
        if start_step >= c.max_steps and self.strategy.is_main:  # resumed at the end: no step left to log
            last = self.logged_at(c.max_steps)
        if self.plateau is not None and self.plateau.best_step is not None:
            last = {**last, "best_step": self.plateau.best_step, f"best/{c.stop_metric}": self.plateau.best}
        if self.stopped_at is not None:
            last = {**last, "stopped_at": self.stopped_at, "stopped_by": self.stopped_by}
        if not self.strategy.is_main:
            return last
        return {
            **{k: v for k, v in last.items() if not is_wall_clock(k)},
            **{f"run/{k}": v for k, v in self.run_info.items()},
        }

    def _main_says(self, flag: bool) -> bool:
        """The main rank's ``flag`` on every rank (a collective), so a decision from its clock is the same on all."""
        return bool(self.strategy.gather([float(flag)])[0][0])

    def _plateau(self, step: int, result: dict[str, Any] | None) -> str | None:
        """The plateau's verdict on this check (None without ``trainer.patience``), the same on every rank: only the
        main rank evaluates, and a save is collective."""
        if self.plateau is None:
            return None
        verdicts = (None, "wait", "best", "stop")
        mine = self.plateau.update(step, result) if (self.strategy.is_main and result) else None
        return verdicts[int(self.strategy.gather([float(verdicts.index(mine))])[0][0])]

    @property
    def best_export(self) -> Path | None:
        """The export of the best held-out check (``trainer.patience``): exports are named by their tag."""
        if self.plateau is None or self.plateau.best_step is None or self.last_export is None:
            return None
        return self.last_export.parent / f"step-{self.plateau.best_step:06d}"

    def save(self, step: int) -> None:
        tag = f"step-{step:06d}"
        self.telemetry.fold()  # every rank: the label tokens seen so far, all ranks', go into the checkpoint
        state = {"step": step, "torch_rng": torch.get_rng_state(), "py_rng": random.getstate(),
                 "label_tokens": self.telemetry.label_tokens_seen}  # fmt: skip
        if self.plateau is not None:
            state["plateau"] = self.plateau.state()
        self.strategy.save(self.engine, self.ds_dir, tag, state)
        kill_point(f"distill:checkpointed:{tag}")
        self._export(step, tag)
        if self.strategy.is_main:
            self._prune(tag)
        self.strategy.barrier()  # no rank saves the next checkpoint while rank 0 still deletes an old one

    def _prune(self, newest: str) -> None:
        """Delete the DeepSpeed checkpoints beyond ``trainer.keep_last`` and the exports beyond
        ``trainer.keep_exports``, oldest first, now that checkpoint ``newest`` is complete: saved, named by
        ``latest`` and (with an export function) exported and recorded in ``EXPORTED``. The tag ``latest`` names
        and the export ``EXPORTED`` names are never deleted, so a kill at any moment leaves a complete checkpoint
        to resume from. Main rank only."""
        c = self.cfg
        latest = self.ds_dir / "latest"
        exported = self._exported() or {}
        if c.keep_last is not None:
            keep = {newest, latest.read_text().strip() if latest.is_file() else newest, exported.get("tag")}
            removed = _remove_oldest(self.ds_dir, c.keep_last, newest, keep)
            if removed:
                print(f"distill: kept the last {c.keep_last} checkpoints; removed {', '.join(removed)}")
        if c.keep_exports is not None and self.last_export is not None:
            keep = {self.last_export.name, Path(exported.get("path", self.last_export)).name}
            if self.best_export is not None:
                keep.add(self.best_export.name)
            removed = _remove_oldest(self.last_export.parent, c.keep_exports, self.last_export.name, keep)
            if removed:
                names = ", ".join(f"{self.last_export.parent.name}/{r}" for r in removed)
                print(f"distill: kept the last {c.keep_exports} exports; removed {names}")

    def _export(self, step: int, tag: str) -> None:
        """Export checkpoint ``tag`` (collective under ZeRO-3) and record it in ``EXPORTED`` once it is whole."""
        full = self.strategy.full_state_dict(self.engine, self.ds_dir, tag) if self.export is not None else None
        if full is not None:
            self.last_export = self.export(step, full)
            kill_point(f"distill:exported:{tag}")
            write_json_atomic(self.ds_dir / EXPORTED, {"tag": tag, "path": str(self.last_export)})
        self.strategy.barrier()

    def _exported(self) -> dict[str, str] | None:
        path = self.ds_dir / EXPORTED
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None

    def _log_lines(self) -> tuple[Path | None, list[str]]:
        """The metrics log's path and lines (no lines when there is no log yet)."""
        path = getattr(self.tracker, "path", None)
        if path is None or not Path(path).is_file():
            return None, []
        return Path(path), Path(path).read_text(encoding="utf-8").splitlines()

    def _forget_logged_after(self, step: int) -> None:
        """Drop the metrics log's lines for steps after ``step`` (logged before a kill, about to be logged again),
        so a resumed run's log equals an uninterrupted one's."""
        path, lines = self._log_lines()
        kept = [json.dumps(r) for r in _records(lines) if r.get("step", 0) <= step]
        if path is not None and len(kept) != len(lines):
            with atomic_file(path, "w") as f:
                f.writelines(line + "\n" for line in kept)

    def logged_at(self, step: int) -> dict[str, Any]:
        """Every metric the log holds for ``step`` (what ``fit`` returns when a resumed run has no step left)."""
        out: dict[str, Any] = {}
        for record in _records(self._log_lines()[1]):
            if record.get("step") == step:
                out.update({k: v for k, v in record.items() if k != "step"})
        return out

    def _trap_signals(self) -> dict:
        def handler(signum, frame):
            if self.strategy.is_main:
                print(f"distill: got signal {signum}; saving a checkpoint after this step", flush=True)
            self.preempted = True

        old = {}
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            try:
                old[sig] = signal.signal(sig, handler)
            except ValueError:  # not the main thread (e.g. inside a test runner thread): no signal handling
                pass
        return old


def progress(record: dict[str, Any]) -> dict[str, str]:
    """The progress bar's fields from a logged record: loss, lr, seconds per step, label tokens/s (all ranks) and,
    on a GPU, the fullest rank's peak allocated memory."""
    out = {"loss": f"{record['loss']:.4f}", "lr": f"{record['lr']:.2e}"}
    if record.get("step_time") is not None:
        out["step"] = f"{record['step_time']:.3g}s"
    if record.get("label_tokens_per_s") is not None:
        out["tok/s"] = f"{record['label_tokens_per_s']:.0f}"
    if record.get("memory/peak_allocated_gb") is not None:
        out["mem"] = f"{record['memory/peak_allocated_gb']:.1f}G"
    return out


def _remove_oldest(folder: Path, keep: int, newest: str, protected: set[str | None]) -> list[str]:
    """Delete the ``step-*`` folders in ``folder`` beyond the ``keep`` newest, oldest first, none in
    ``protected``; returns their names. Folders of steps after ``newest`` are left alone: a save that was killed
    before ``latest`` moved to it wrote them, and they are neither complete nor this run's (its save at that step
    replaces them)."""
    limit = tag_step(newest)
    found = sorted(
        (step, path)
        for path in folder.iterdir()
        if path.is_dir() and (step := tag_step(path.name)) is not None and (limit is None or step <= limit)
    )
    doomed = [path for _, path in found[: max(0, len(found) - keep)] if path.name not in protected]
    for path in doomed:
        remove_tree(path)
    return [path.name for path in doomed]


def _records(lines: list[str]) -> list[dict[str, Any]]:
    """The JSON records of a metrics log; a torn last line (the process killed mid-write) is left out."""
    out = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out
