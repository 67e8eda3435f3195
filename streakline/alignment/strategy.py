"""The one seam for distributed training: a strategy object around DeepSpeed (docs/design.md, convention 8).

Everything the trainer needs from the distributed world goes through ``DeepSpeedStrategy``:

    strategy = DeepSpeedStrategy(trainer_cfg, seed=0)           # joins torchrun's process group, or makes a 1-rank one
    engine = strategy.setup(module)                             # ZeRO 0/2/3, fp32/bf16, clipping, warmup+cosine LR
    strategy.close()                                            # after training: undoes ZeRO-3's process-wide patch
    DeepSpeedStrategy(trainer_cfg, autocast=torch.bfloat16)     # fp32 weights, bf16 GEMMs (DeepSpeed's torch_autocast)
    loss, metrics = engine(batch); strategy.step(engine, loss)  # backward + (accumulated) optimizer step
    strategy.grad_norm(engine)                                  # the last step's global norm, before clipping
    rows = strategy.gather([tokens, memory])                    # every rank's numbers (collective)
    strategy.save(engine, folder, client_state)                 # DeepSpeed state for exact resume
    state = strategy.full_state_dict(engine, folder)            # consolidated weights on rank 0 (ZeRO-3 included)

Process groups: under ``torchrun`` (``WORLD_SIZE`` set) the ranks rendezvous as torchrun says, across nodes too;
otherwise a single-rank group on localhost. The backend is NCCL on GPUs and gloo on CPUs (the tests run ZeRO-2 and
ZeRO-3 on 2 CPU ranks). The learning-rate schedule is a plain ``LambdaLR`` (linear warmup, cosine decay to
``min_lr_ratio``) so that it is saved and restored with the engine.

ZeRO-3 partitions parameters and gathers each one when its module runs. A module that reads another module's
weight directly (the drafter's output matrix in the chunked losses) must say so: ``setup`` registers such
parameters, listed by the module's ``external_parameters()``, with DeepSpeed.
"""

from __future__ import annotations

import math
import os
import shutil
import socket
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from streakline.errors import disk_full_error, is_disk_full, nearly_full

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
AUTOCAST_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}  # DeepSpeed's names in "torch_autocast"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lr_lambda(warmup: int, total: int, min_ratio: float):
    """Multiplier of the peak LR at optimizer step ``s``: linear warmup, then cosine to ``min_ratio`` at ``total``."""

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def skip_shm_all_reduce() -> None:
    """Tell DeepSpeed not to build its CPU shared-memory all-reduce in this process. Its comm backend compiles that
    C++ op when the process group starts (about 30 s on 2 cores, again for every new virtual environment, since the
    build is keyed by the venv's paths, and only where a C++ compiler and ninja are installed). The op serves only
    ``inference_all_reduce``, the collective of DeepSpeed's tensor-parallel inference layers; a training engine's
    collectives (ZeRO's all-reduce, reduce-scatter, all-gather) go to torch.distributed, gloo on CPU, on one rank
    or many. DeepSpeed keeps its compatible-ops table as one module dict so that edits to it hold; the op is then
    None and nothing else changes."""
    import deepspeed.ops

    table = deepspeed.ops.__compatible_ops__
    if "deepspeed_shm_comm" in table:
        table["deepspeed_shm_comm"] = False


class DeepSpeedStrategy:
    def __init__(self, trainer_cfg: Any, seed: int = 0, autocast: torch.dtype | None = None) -> None:
        """``autocast``: the dtype the engine's forwards run under (``models.precision.training_autocast``; bf16 on
        hardware that multiplies it natively), with fp32 weights, gradients and optimizer state; None: none."""
        import deepspeed
        import torch.distributed as dist

        self.cfg = trainer_cfg
        self.cuda = torch.cuda.is_available()
        backend = "nccl" if self.cuda else "gloo"
        if not self.cuda:
            skip_shm_all_reduce()  # before the first process group: DeepSpeed's comm backend builds it there
        if not dist.is_initialized():
            if "WORLD_SIZE" not in os.environ:
                # a plain `python launch.py ...`: a group of one on a free port. Not through os.environ, which child
                # processes (a torchrun the user starts from here, the tests' subprocesses) would inherit.
                dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
                os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed's engine insists on it; WORLD_SIZE stays unset
            else:
                deepspeed.init_distributed(dist_backend=backend, verbose=False)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = torch.device(f"cuda:{self.local_rank}" if self.cuda else "cpu")
        if self.cuda:
            torch.cuda.set_device(self.device)
        self.dtype = PRECISIONS[trainer_cfg.precision]
        if autocast is not None and trainer_cfg.precision != "fp32":
            raise ValueError(f"autocast runs over fp32 weights; trainer.precision={trainer_cfg.precision} is its own")
        self.autocast = autocast
        self._grad_norm: torch.Tensor | None = None  # step(measure_grad_norm=True) where DeepSpeed keeps none
        torch.manual_seed(seed)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def ds_config(self) -> dict[str, Any]:
        """DeepSpeed's config; the optimizer and LR schedule are ours (``setup``), so they are not in it."""
        c = self.cfg
        config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": c.micro_batch_size,
            "gradient_accumulation_steps": c.grad_accum,
            "gradient_clipping": c.grad_clip,
            "zero_optimization": {"stage": c.zero_stage},
            "steps_per_print": 10**9,  # our tracker reports; DeepSpeed's own prints would interleave with tqdm
            "wall_clock_breakdown": False,
        }
        if c.precision == "bf16":
            config["bf16"] = {"enabled": True}
        elif c.precision == "fp16":
            config["fp16"] = {"enabled": True}
        if self.autocast is not None:
            # DeepSpeed's own torch.autocast around every engine forward (backward follows it); under ZeRO it also
            # reduces the linear layers' gradients in this dtype
            config["torch_autocast"] = {"enabled": True, "dtype": AUTOCAST_NAMES[self.autocast]}
        return config

    def setup(self, module: torch.nn.Module):
        import deepspeed

        module = module.to(self.device)
        self._linear = torch.nn.functional.linear  # ZeRO-3 replaces it process-wide: close() puts it back
        params = [p for p in module.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=self.cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lr_lambda(self.cfg.warmup_steps, self.cfg.max_steps, self.cfg.min_lr_ratio)
        )
        engine, _, _, _ = deepspeed.initialize(
            model=module, optimizer=optimizer, lr_scheduler=scheduler, config=self.ds_config(), dist_init_required=False
        )
        if self.cfg.zero_stage == 3 and hasattr(module, "external_parameters"):
            for owner, param in module.external_parameters():
                deepspeed.zero.register_external_parameter(owner, param)
        return engine

    def close(self) -> None:
        """Undo what DeepSpeed changed for the whole process: ZeRO-3 swaps ``torch.nn.functional.linear`` for its
        memory-saving wrapper and leaves it there, so whatever runs next in this process (stage=pipeline's evaluate,
        another test) would run every linear layer through it, with other rounding. Call once training is over."""
        linear = getattr(self, "_linear", None)
        if linear is not None:
            torch.nn.functional.linear = linear

    @property
    def live_weights_are_whole(self) -> bool:
        """False under ZeRO-3, where each rank holds only a shard of every parameter: evaluate exported (gathered)
        checkpoints then, not the live module."""
        return self.cfg.zero_stage != 3

    def step(self, engine, loss: torch.Tensor, *, clock=None, measure_grad_norm: bool = False) -> None:
        """Backward and (at an accumulation boundary) the optimizer step, timed as ``backward`` and ``optimizer``
        on ``clock`` (``telemetry.PhaseClock``) when given. ``measure_grad_norm`` on a boundary micro-step keeps the
        gradient norm for ``grad_norm`` where DeepSpeed computes none."""
        with clock.phase("backward") if clock is not None else nullcontext():
            engine.backward(loss)
        if measure_grad_norm and not hasattr(engine.optimizer, "_global_grad_norm"):
            # fp32 without ZeRO: DeepSpeed clips with the plain optimizer and drops the norm it computed. The
            # gradients are whole and already averaged over the ranks here, so their norm is that norm; computed
            # only when asked (the log steps), and left on the device until read.
            grads = [p.grad.detach() for p in engine.module.parameters() if p.grad is not None]
            norms = [torch.linalg.vector_norm(g, 2.0, dtype=torch.float32) for g in grads]
            self._grad_norm = torch.linalg.vector_norm(torch.stack(norms), 2.0) if norms else None
        with clock.phase("optimizer") if clock is not None else nullcontext():
            engine.step()

    def grad_norm(self, engine) -> float | None:
        """The global 2-norm of the gradients of the last optimizer step, before clipping: DeepSpeed's own (ZeRO
        1-3, bf16 and fp16 optimizers: the norm over all ranks' partitions, not this rank's shard), else the one
        ``step(..., measure_grad_norm=True)`` kept. None when neither exists. Reading it syncs the device."""
        norm = engine.get_global_grad_norm() if hasattr(engine.optimizer, "_global_grad_norm") else self._grad_norm
        return None if norm is None else float(norm)

    def gather(self, values: list[float]) -> list[list[float]]:
        """``values`` of every rank, rank order (a collective: every rank calls it with as many values)."""
        import torch.distributed as dist

        if self.world_size == 1:
            return [list(values)]
        mine = torch.tensor(values, dtype=torch.float64, device=self.device)  # NCCL gathers device tensors only
        rows = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(rows, mine)
        return torch.stack(rows).cpu().tolist()

    def save(self, engine, folder: str | os.PathLike, tag: str, client_state: dict[str, Any]) -> None:
        """DeepSpeed state (weights, optimizer, scheduler) plus ``client_state``; collective: every rank calls it.
        A full disk ends in the project's one-line ``DiskFullError``: torch's writer reports it as ``[enforce fail
        at inline_container.cc] ... file write failed``, which names no cause, so a failed save into a folder with
        (almost) no space left is taken for one. The half-written ``tag`` goes (the checkpoints before it, and the
        ``latest`` tag DeepSpeed writes only after a save, stay), so a rerun resumes from the last whole one."""
        try:
            engine.save_checkpoint(str(folder), tag=tag, client_state=client_state)
        except (RuntimeError, OSError) as exc:
            if not (is_disk_full(exc) or nearly_full(folder)):
                raise
            shutil.rmtree(Path(folder) / tag, ignore_errors=True)
            raise disk_full_error(Path(folder) / tag, exc, folder=True) from exc

    def load(self, engine, folder: str | os.PathLike, tag: str) -> dict[str, Any]:
        _, client_state = engine.load_checkpoint(str(folder), tag=tag)
        if client_state is None:
            raise RuntimeError(f"no DeepSpeed checkpoint {tag!r} in {folder}")
        return client_state

    def full_state_dict(self, engine, folder: str | os.PathLike, tag: str) -> dict[str, torch.Tensor] | None:
        """The module's complete fp32 state dict on rank 0 (None elsewhere); read back from the saved checkpoint
        under ZeRO-3, where no rank holds every weight."""
        if self.cfg.zero_stage == 3:
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            self.barrier()
            if not self.is_main:
                return None
            return get_fp32_state_dict_from_zero_checkpoint(str(folder), tag=tag)
        if not self.is_main:
            return None
        return {k: v.detach().float().cpu() for k, v in engine.module.state_dict().items()}

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()
