"""The plan before a Slurm submission: a job that cannot fit is refused with one line naming the fix, the same
job with the fix (or launcher.plan=false) passes. No Slurm is needed: nothing is submitted here.

Run: python -m pytest tests/planning/test_gate.py -q
"""

import pytest

from streakline.config import ConfigError
from streakline.planning.gate import check_submission

# DiffuCoder-7B distilled on one node of eight A100-80GB under ZeRO-2 with the held-out check: the 14B verifier on
# rank 0 (27.5 GiB) on top of 4 x 8 windows of 2k-token rows without activation checkpointing
JOB = ["-m", "launcher=slurm", "stage=distill", "model=diffucoder", "trainer=zero2", "cluster=a100-80g",
       "launcher.gpus_per_node=8", "trainer.micro_batch_size=4", "data.max_new_tokens=2048"]  # fmt: skip


def test_a_job_that_cannot_fit_is_refused_with_its_fix():
    with pytest.raises(ConfigError) as err:
        check_submission(JOB)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("stage=distill cannot fit 1 node(s) x 8 a100-80g: does not fit:")
    assert "fix: " in message and "launcher.plan=false" in message
    fix = message.split("fix: ")[1].split(" (")[0].split()
    check_submission([*JOB, *fix])  # the named fix, pasted, passes


def test_launcher_plan_false_skips_the_check():
    check_submission([*JOB, "launcher.plan=false"])


def test_without_a_gpu_cluster_or_slurm_nothing_is_planned(capsys):
    check_submission([a for a in JOB if not a.startswith("cluster=")])
    assert "name the job's nodes" in capsys.readouterr().out
    check_submission([a for a in JOB if a != "-m"])  # no multirun: Slurm is not used
    check_submission([*JOB[:-1], "data.max_new_tokens=1024,2048"])  # a sweep: each job its own config
