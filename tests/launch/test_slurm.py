"""stage=distill on a real Slurm: `python launch.py -m launcher=slurm ...` submits it through hydra-submitit-launcher,
the job trains the micro drafter, and its checkpoint and W&B offline run are checked; srun + torchrun ranks meet.

Run: python -m pytest -m slurm tests/launch/test_slurm.py
Needs a Slurm with an idle node: .ci/run starts one on localhost (.ci/start_slurm.sh, root). Without one the tests
skip and say why (the reason .ci/start_slurm.sh gave, if .ci/run exported it as STREAKLINE_SLURM_SKIP).
"""

import os
import re
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from streakline.artifacts import read_manifest
from streakline.config import CONF_DIR, compose_config
from streakline.launch.slurm import first_host
from streakline.models import load_pretrained
from streakline.pipelines import run_stage

pytestmark = pytest.mark.slurm

LAUNCH = Path(CONF_DIR).parent / "launch.py"
# Slurm job states after which nothing more will happen to a job
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
JOB_TIMEOUT_S = 300  # the submitted distill takes ~20-30 s on 2 idle cores; a stuck queue must fail, not hang
WORLD = ["model=micro", "experiment.name=slurm"]
DATA = ["data.max_prompts=8", "data.samples_per_prompt=1", "data.max_new_tokens=16", "data.num_shards=1",
        "data.batch_size=8"]  # fmt: skip
TRAIN = ["method=ce_streak", "trainer.max_steps=4", "trainer.micro_batch_size=2", "trainer.warmup_steps=1",
         "trainer.save_every=4", "trainer.eval_every=4", "trainer.log_every=1", "trainer.eval_prompts=2",
         "trainer.windows_per_seq=4"]  # fmt: skip


def _slurm_unavailable() -> str | None:
    reason = os.environ.get("STREAKLINE_SLURM_SKIP")
    if reason:
        return reason
    if not (shutil.which("sinfo") and shutil.which("sbatch") and shutil.which("srun")):
        return "no Slurm client here (sinfo/sbatch/srun not on PATH); start a local one with: sudo .ci/start_slurm.sh"
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        return f"sinfo failed: {out.stderr.strip()}"
    states = out.stdout.split()
    if not {"idle", "mixed"} & set(states):  # mixed: partly busy, still takes a one-CPU job
        return f"no idle Slurm node (sinfo node states: {states or 'none'})"
    return None


@pytest.fixture(scope="session")  # session, so that it runs (and skips) before the session's micro_world build
def slurm():
    reason = _slurm_unavailable()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def default_partition(slurm):
    out = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, timeout=30, check=True)
    marked = [p for p in out.stdout.split() if p.endswith("*")]
    return (marked or out.stdout.split())[0].rstrip("*")


def _job_logs(sweep: Path) -> str:
    """Every task's stderr and stdout tail under the sweep's submitit folder, to show when something failed."""
    parts = []
    for log in sorted(sweep.glob(".submitit/*/*_log.*")):
        text = log.read_text(errors="replace")
        parts.append(f"--- {log}\n{text[-4000:]}")
    return "\n".join(parts) or f"(no submitit logs under {sweep})"


def _job_ids(sweep: Path) -> list[str]:
    return sorted(p.name for p in sweep.glob(".submitit/*") if p.is_dir() and p.name[:1].isdigit())


def _job_state(job_id: str) -> str:
    # slurmctld remembers a finished job for MinJobAge seconds; sacct needs accounting, which the CI Slurm lacks
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, timeout=30)
    found = re.search(r"JobState=(\S+)", out.stdout)
    return found.group(1) if found else "UNKNOWN"


def _submit(command: list[str], sweep: Path, cwd: Path) -> subprocess.CompletedProcess:
    """Run the submitting driver (`launch.py -m ...`) to completion, or fail the test with the job's logs.

    Without Slurm accounting, submitit learns a job's end only from its result file, which a job killed by Slurm or
    ended by SystemExit never writes; the driver would then wait forever. So the job's state is watched here too,
    and a job that ended while the driver still waits fails the test at once.
    """
    env = dict(os.environ, WANDB_MODE="offline")  # the job inherits the submitting environment (sbatch default)
    # files, not pipes: nobody reads a pipe while the driver runs, and a full one would block it
    out_path, err_path = cwd / "driver.out", cwd / "driver.err"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        driver = subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=err, text=True)
    start, ended_at, why = time.monotonic(), None, None
    try:
        while driver.poll() is None:
            time.sleep(2)
            states = {j: _job_state(j) for j in _job_ids(sweep)}
            if states and all(s in ENDED for s in states.values()):
                ended_at = ended_at or time.monotonic()
                if time.monotonic() - ended_at > 30:  # submitit polls the result file every second; 30 s is ample
                    why = f"the Slurm job ended ({states}) but the driver is still waiting for its result"
            if time.monotonic() - start > JOB_TIMEOUT_S:
                why = f"the Slurm job did not finish within {JOB_TIMEOUT_S} s ({states})"
            if why:
                driver.kill()
                break
        driver.wait(timeout=60)
    finally:
        if driver.poll() is None:
            driver.kill()
        ids = _job_ids(sweep)
        if ids:  # scancel of a finished job is a harmless no-op
            subprocess.run(["scancel", *ids], capture_output=True, timeout=30)
    out, err = out_path.read_text(), err_path.read_text()
    if why:
        pytest.fail(f"{why}\n{_job_logs(sweep)}\ndriver stderr:\n{err[-3000:]}")
    return subprocess.CompletedProcess(command, driver.returncode, out, err)


def _wandb_records(path: Path):
    """The protobuf records of a W&B transaction log (``run-<id>.wandb``): LevelDB-style 32 KiB blocks of chunks,
    each ``<crc:u32><length:u16><type:u8>`` (1 full, 2 first, 3 middle, 4 last), after a 7-byte file header."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, pending = path.read_bytes(), 32768, 7, b""
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def test_scontrol_and_first_host_agree(slurm):
    for nodelist in ("vm", "gpu[07-08]", "gpu[003-004,007],cpu1", "rack[1-2]-n[09-10]", "a1,b[2-3]"):
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split()[0] == first_host(nodelist), nodelist


def test_srun_starts_torchrun_ranks_that_rendezvous(slurm, tmp_path):
    """One task on one node, two ranks from torchrun, through `python -m streakline.launch.slurm` under srun."""
    script = tmp_path / "ranks.py"
    script.write_text(
        "import os, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "t = torch.tensor([dist.get_rank() + 1])\n"
        "dist.all_reduce(t)\n"
        "print(f\"rank={os.environ['RANK']}/{os.environ['WORLD_SIZE']} master={os.environ['MASTER_ADDR']} \"\n"
        "      f\"nodelist={os.environ['SLURM_JOB_NODELIST']} sum={t.item()}\", flush=True)\n"
        "dist.destroy_process_group()\n"
    )
    # --time: Slurm itself ends the step if anything here hangs past the Python timeout
    command = ["srun", "--nodes=1", "--ntasks=1", "--time=3", "--job-name=streakline-test-ranks", sys.executable,
               "-m", "streakline.launch.slurm", "--nproc-per-node", "2", "--", str(script)]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = sorted(re.findall(r"rank=(\d)/(\d) master=(\S+) nodelist=(\S+) sum=(\d+)", proc.stdout))
    assert [(r, w, s) for r, w, _, _, s in lines] == [("0", "2", "3"), ("1", "2", "3")]  # 1 + 2 from both ranks
    assert all(m == first_host(nodes) for _, _, m, nodes, _ in lines)


def test_distill_submitted_through_hydra_submitit(slurm, default_partition, micro_world, tmp_path):
    root = micro_world[0]
    # trajectories in this process; only distill goes to Slurm
    run_stage(compose_config(["stage=trajectories", *WORLD, f"run_root={root}", *DATA]))
    sweep = tmp_path / "sweep"
    command = [sys.executable, str(LAUNCH), "-m", "launcher=slurm", f"launcher.partition={default_partition}",
               "launcher.time_min=10", "stage=distill", *WORLD, f"run_root={root}", *DATA, *TRAIN,
               f"hydra.sweep.dir={sweep}"]  # fmt: skip
    proc = _submit(command, sweep, cwd=tmp_path)
    assert proc.returncode == 0, f"driver stderr:\n{proc.stderr[-3000:]}\n{_job_logs(sweep)}"

    # the sbatch script carries our launcher.* values
    (job_dir,) = [p for p in sweep.glob(".submitit/*") if p.is_dir()]
    job_id = job_dir.name
    sbatch = (job_dir / f"{job_id}_submission.sh").read_text()
    for flag in (f"--partition={default_partition}", "--time=10", "--nodes=1", "--ntasks-per-node=1"):
        assert f"#SBATCH {flag}\n" in sbatch, sbatch
    assert "\nunset WANDB_SERVICE\n" in sbatch  # this process's W&B service is not the job's (launcher setup)

    # it ran inside that Slurm job and wrote the drafter
    out = (job_dir / f"{job_id}_0_log.out").read_text()
    assert f"JobEnvironment(job_id={job_id}," in out, out[-2000:]
    found = re.search(r"distill: drafter in (\S+)", out)
    assert found, _job_logs(sweep)
    drafter = Path(found.group(1))
    run = drafter.parent
    assert run.is_relative_to(root / "slurm" / "distill")
    assert (drafter / "config.json").is_file() and (drafter / "model.safetensors").is_file()
    assert read_manifest(run).status == "complete"
    model = load_pretrained(drafter)
    assert sum(p.numel() for p in model.parameters()) > 0
    # the Hydra job folder of the sweep (job 0) was written by the job too
    assert (sweep / "0" / ".hydra" / "config.yaml").is_file()

    # W&B logged offline inside the job: one run directory with the trainer's keys in its history
    (log,) = run.glob("wandb/offline-run-*/run-*.wandb")
    keys = set()
    for record in _wandb_records(log):
        if record.WhichOneof("record_type") == "history":
            keys |= {item.key or "/".join(item.nested_key) for item in record.history.item}
    assert {"loss", "lr"} <= keys, sorted(keys)
    assert any(k.startswith("eval/") and k.endswith("/sim_streak") for k in keys), sorted(keys)  # eval at step 4
