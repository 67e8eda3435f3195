"""Slurm: whether this process runs inside a Slurm job, and the srun + torchrun command that starts its ranks.

Single-process stages go through Hydra's submitit launcher and need nothing from here (docs/launching.md):

    python launch.py -m launcher=slurm stage=distill model=diffucoder launcher.partition=gpu launcher.gpus_per_node=1

Multi-node (or multi-GPU) DeepSpeed runs one Slurm task per node; each task starts torchrun, which spawns that
node's ranks and meets the other nodes at the first host of the job (static rendezvous: node rank = SLURM_NODEID,
master = first host of ``scontrol show hostnames $SLURM_JOB_NODELIST``, port derived from the job id so every node
computes the same one without talking). In an sbatch script with ``--ntasks-per-node=1``:

    srun python -m streakline.launch.slurm --nproc-per-node 8 -- launch.py stage=distill trainer=zero3 ...
    python -m streakline.launch.slurm --print --nproc-per-node 8 -- launch.py ...   # show the command only

Inside a Hydra/submitit job, ``node_command`` gives the torchrun that the node's task must run in place of the
stage (None when one process is enough). ``torchrun_argv`` and ``first_host`` are pure (they take the SLURM_*
values as arguments; tested from a fake environment in tests/launch/test_slurm_commands.py);
``SlurmJob.from_env``, ``master_addr`` and ``node_command`` read the real environment. This module imports
nothing of streakline's upper layers (docs/design.md, Layout).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

# torchrun's default port is 29500; a job-specific offset keeps two jobs sharing a node from colliding.
PORT_BASE = 29500
PORT_SPAN = 10000
# Set by torchrun in every rank it spawns: a process that sees it is a rank already, not a node's launcher.
TORCHRUN_MARKERS = ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", "WORLD_SIZE")


@dataclass(frozen=True)
class SlurmJob:
    """What a process learns about its Slurm job from the SLURM_* environment."""

    job_id: str
    nodelist: str  # compressed hostlist, e.g. "gpu[03-04,07]"
    nnodes: int
    node_rank: int  # SLURM_NODEID: 0 on the first host of the nodelist
    gpus_per_node: int  # 0 when the job asked for none (or Slurm does not say)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> SlurmJob | None:
        """The job this process belongs to, or None outside Slurm. ``env`` defaults to ``os.environ``."""
        env = os.environ if env is None else env
        job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
        if not job_id:
            return None
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
        nnodes = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or "1"
        # outside a job step (the sbatch script itself, salloc's shell) there is no SLURM_NODEID: that is node 0
        return cls(
            job_id=job_id,
            nodelist=nodelist,
            nnodes=int(nnodes),
            node_rank=int(env.get("SLURM_NODEID", "0")),
            gpus_per_node=_gpu_count(env),
        )


def in_slurm_job(env: Mapping[str, str] | None = None) -> bool:
    """True inside an sbatch/srun/salloc allocation (a submitit job included)."""
    return SlurmJob.from_env(env) is not None


def _gpu_count(env: Mapping[str, str]) -> int:
    # SLURM_GPUS_ON_NODE is set in job steps on nodes with GPU gres; SLURM_GPUS_PER_NODE echoes --gpus-per-node,
    # which may carry a type ("a100:8").
    for key in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"):
        value = env.get(key, "").rsplit(":", 1)[-1]
        if value.isdigit():
            return int(value)
    return 0


def first_host(nodelist: str) -> str:
    """The first host name of a Slurm hostlist expression, as ``scontrol show hostnames`` lists it first.

    ``"gpu[03-04,07],cpu1"`` -> ``"gpu03"``; ``"rack[1-2]-n[09-10]"`` -> ``"rack1-n09"``; ``"vm"`` -> ``"vm"``.
    Only the first host is needed (the rendezvous master), so ranges are not expanded; zero padding is kept.
    """
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):  # the first comma outside brackets ends the first host pattern
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            end = i
            break
    pattern, host = nodelist[:end].strip(), ""
    while "[" in pattern:
        prefix, rest = pattern.split("[", 1)
        ranges, pattern = rest.split("]", 1)
        host += prefix + ranges.split(",", 1)[0].split("-", 1)[0]
    host += pattern
    if not host:
        raise ValueError(f"empty Slurm nodelist {nodelist!r}")
    return host


def master_addr(nodelist: str) -> str:
    """The rendezvous host: the first line of ``scontrol show hostnames <nodelist>``, as Slurm's own docs do it;
    :func:`first_host` when scontrol is not on PATH (the two agree: tests/launch/test_slurm.py)."""
    scontrol = shutil.which("scontrol")
    if scontrol:
        out = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.split()[0]
    return first_host(nodelist)


def rendezvous_port(job_id: str | int) -> int:
    """A port every node of the job derives alike; a job array's ``123_4`` uses its numeric parts."""
    digits = "".join(ch for ch in str(job_id) if ch.isdigit()) or "0"
    return PORT_BASE + int(digits) % PORT_SPAN


def torchrun_argv(
    job: SlurmJob,
    *,
    nproc_per_node: int,
    master: str,
    port: int,
    script_args: Sequence[str],
    python: str = sys.executable,
) -> list[str]:
    """torchrun for this node of ``job``: ``nproc_per_node`` ranks, node rank ``job.node_rank`` of ``job.nnodes``,
    all nodes meeting at ``master:port``. ``script_args`` is the script and its arguments (``launch.py stage=...``).

    Static rendezvous (``--node_rank``) rather than c10d: node rank 0 hosts the rendezvous store, so it must run on
    ``master``, and SLURM_NODEID 0 is the nodelist's first host; ranks are then fixed by the allocation, and global
    rank 0 (the one that writes files) lives on the first node, whose log users read first.
    """
    if nproc_per_node < 1:
        raise ValueError(f"nproc_per_node must be at least 1, got {nproc_per_node}")
    return [
        python,
        "-m",
        "torch.distributed.run",
        f"--nnodes={job.nnodes}",
        f"--node_rank={job.node_rank}",
        f"--nproc_per_node={nproc_per_node}",
        f"--master_addr={master}",
        f"--master_port={port}",
        "--max_restarts=0",  # a crashed rank fails the job; the rerun resumes from the last checkpoint
        *script_args,
    ]


def launch_script() -> str:
    """``launch.py`` of this source tree (streakline runs from its source tree: CONF_DIR lives there)."""
    return str(Path(__file__).resolve().parents[2] / "launch.py")


def node_command(
    gpus_per_node: int,
    overrides: Sequence[str],
    output_dir: str,
    env: Mapping[str, str] | None = None,
) -> list[str] | None:
    """What one node's task of a Hydra/submitit job must run to start its ranks, or None to run in-process.

    None outside Slurm, inside a rank that torchrun already started, and for a one-process job (one node, at most
    one GPU). Otherwise torchrun over ``launch.py`` with the job's Hydra ``overrides`` (so every rank composes the
    config the driver composed) and Hydra's own files for the ranks under ``output_dir`` (no per-rank folders).
    ``gpus_per_node`` is ``launcher.gpus_per_node``; Slurm's own count wins where it reports one, as do its node
    count and node rank, since they are what the job really got.
    """
    env = os.environ if env is None else env
    job = SlurmJob.from_env(env)
    if job is None or any(k in env for k in TORCHRUN_MARKERS):
        return None
    nproc = max(1, job.gpus_per_node or gpus_per_node)
    if job.nnodes * nproc == 1:
        return None
    ranks_dir = f"{output_dir}/torchrun-node{job.node_rank}"
    script = [launch_script(), *overrides, f"hydra.run.dir={ranks_dir}", "hydra.output_subdir=null"]
    port = int(env.get("MASTER_PORT") or rendezvous_port(job.job_id))
    return torchrun_argv(job, nproc_per_node=nproc, master=master_addr(job.nodelist), port=port, script_args=script)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m streakline.launch.slurm [--print] [--nproc-per-node N] [--port P] -- script args...``:
    run (exec) torchrun for this node of the current Slurm job."""
    parser = argparse.ArgumentParser(prog="python -m streakline.launch.slurm", description=main.__doc__)
    parser.add_argument("--nproc-per-node", type=int, default=None, help="ranks on this node (default: its GPUs, or 1)")
    parser.add_argument("--port", type=int, default=None, help="rendezvous port (default: MASTER_PORT or from job id)")
    parser.add_argument("--print", action="store_true", help="print the torchrun command instead of running it")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="-- launch.py stage=... (the per-rank command)")
    args = parser.parse_args(argv)
    script_args = args.script_args[1:] if args.script_args[:1] == ["--"] else args.script_args
    job = SlurmJob.from_env()
    if job is None:
        parser.error("not inside a Slurm job (no SLURM_JOB_ID); run it under srun in an sbatch script")
    if not script_args:
        parser.error("nothing to run: give the per-rank command after --, e.g. -- launch.py stage=distill")
    port = args.port or int(os.environ.get("MASTER_PORT") or rendezvous_port(job.job_id))
    nproc = args.nproc_per_node or max(1, job.gpus_per_node)
    argv_ = torchrun_argv(job, nproc_per_node=nproc, master=master_addr(job.nodelist), port=port,
                          script_args=script_args)  # fmt: skip
    if args.print:
        print(shlex.join(argv_))
        return 0
    sys.stdout.flush()
    os.execv(argv_[0], argv_)  # the node's task becomes torchrun: Slurm's signals reach it directly
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
