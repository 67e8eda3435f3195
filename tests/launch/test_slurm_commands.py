"""The Slurm command builder from fake SLURM_* environments, and the Hydra launcher config it pairs with.

Run: python -m pytest tests/launch/test_slurm_commands.py      (no Slurm needed; tests/launch/test_slurm.py uses one)
"""

import sys

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from streakline.config import CONF_DIR, register_configs
from streakline.launch import slurm
from streakline.launch.slurm import SlurmJob, first_host, node_command, rendezvous_port, torchrun_argv

# What srun gives the task on the second node of `sbatch --nodes=2 --gpus-per-node=8` (job 4242).
NODE1 = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_NNODES": "2",
    "SLURM_NODEID": "1",
    "SLURM_PROCID": "1",
    "SLURM_GPUS_ON_NODE": "8",
}


def test_job_from_env():
    job = SlurmJob.from_env(NODE1)
    assert job == SlurmJob(job_id="4242", nodelist="gpu[07-08]", nnodes=2, node_rank=1, gpus_per_node=8)
    assert SlurmJob.from_env({"PATH": "/usr/bin"}) is None
    assert not slurm.in_slurm_job({}) and slurm.in_slurm_job(NODE1)
    # the batch script itself (no job step yet): node 0; GPUs only as --gpus-per-node echoed them, with a type
    script = SlurmJob.from_env({"SLURM_JOBID": "7", "SLURM_NODELIST": "n1,n2", "SLURM_NNODES": "2",
                                "SLURM_GPUS_PER_NODE": "a100:4"})  # fmt: skip
    assert (script.job_id, script.node_rank, script.nnodes, script.gpus_per_node) == ("7", 0, 2, 4)


@pytest.mark.parametrize(
    ("nodelist", "host"),
    [
        ("vm", "vm"),
        ("gpu[07-08]", "gpu07"),
        ("gpu[003-004,007],cpu1", "gpu003"),
        ("gpu[7,3-4]", "gpu7"),  # Slurm keeps the order it was given; the first listed is first
        ("rack[1-2]-n[09-10]", "rack1-n09"),
        ("a1,b[2-3]", "a1"),
        ("node-[5]", "node-5"),
    ],
)
def test_first_host(nodelist, host):
    assert first_host(nodelist) == host


def test_first_host_of_nothing_is_an_error():
    with pytest.raises(ValueError, match="empty"):
        first_host("")


def test_rendezvous_port_is_shared_by_the_job_and_differs_between_jobs():
    assert rendezvous_port("4242") == rendezvous_port(4242) == 29500 + 4242
    assert rendezvous_port("123_4") == 29500 + 1234  # an array task
    assert rendezvous_port("4242") != rendezvous_port("4243")
    assert all(29500 <= rendezvous_port(j) < 39500 for j in ("0", "9999", "10000", "99999999"))


def test_torchrun_argv_for_the_second_node():
    job = SlurmJob.from_env(NODE1)
    script = ["launch.py", "stage=distill", "trainer=zero3"]
    argv = torchrun_argv(job, nproc_per_node=8, master="gpu07", port=33742, script_args=script, python="/v/python")
    assert argv == [
        "/v/python", "-m", "torch.distributed.run", "--nnodes=2", "--node_rank=1", "--nproc_per_node=8",
        "--master_addr=gpu07", "--master_port=33742", "--max_restarts=0", "launch.py", "stage=distill",
        "trainer=zero3",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="nproc_per_node"):
        torchrun_argv(SlurmJob.from_env(NODE1), nproc_per_node=0, master="gpu07", port=1, script_args=["x.py"])


def test_node_command_starts_torchrun_on_a_multi_node_job():
    overrides = ["launcher=slurm", "stage=distill", "launcher.nodes=2", "launcher.gpus_per_node=8"]
    argv = node_command(8, overrides, "/runs/hydra/multirun/d/t/0", env=NODE1)
    assert argv[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--nnodes=2" in argv and "--node_rank=1" in argv and "--nproc_per_node=8" in argv
    assert "--master_addr=gpu07" in argv  # scontrol show hostnames when it is installed, else first_host: same
    assert f"--master_port={29500 + 4242}" in argv
    script = argv[argv.index("--max_restarts=0") + 1 :]
    assert script[0] == slurm.launch_script() and script[0].endswith("launch.py")
    assert script[1:5] == overrides
    # the ranks share one Hydra folder per node under the job's own, and write no .hydra/ of their own
    assert script[5:] == ["hydra.run.dir=/runs/hydra/multirun/d/t/0/torchrun-node1", "hydra.output_subdir=null"]
    assert "--master_port=29999" in node_command(8, overrides, "/o", env={**NODE1, "MASTER_PORT": "29999"})


def test_node_command_runs_in_process_when_one_process_is_enough():
    one = {**NODE1, "SLURM_JOB_NUM_NODES": "1", "SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_GPUS_ON_NODE": "1"}
    assert node_command(1, [], "/o", env=one) is None  # one node, one GPU
    assert node_command(0, [], "/o", env={k: v for k, v in one.items() if k != "SLURM_GPUS_ON_NODE"}) is None
    assert node_command(8, [], "/o", env={}) is None  # not in Slurm
    assert node_command(8, [], "/o", env={**NODE1, "LOCAL_RANK": "3", "WORLD_SIZE": "16"}) is None  # a rank already
    # one node, no GPU count from Slurm: the config's gpus_per_node decides
    no_gres = {k: v for k, v in one.items() if k != "SLURM_GPUS_ON_NODE"}
    assert "--nproc_per_node=4" in node_command(4, [], "/o", env=no_gres)


def test_module_cli_prints_the_command_for_this_job(monkeypatch, capsys):
    for key, value in NODE1.items():
        monkeypatch.setenv(key, value)
    for key in ("MASTER_PORT", *slurm.TORCHRUN_MARKERS):
        monkeypatch.delenv(key, raising=False)
    assert slurm.main(["--print", "--", "launch.py", "stage=distill"]) == 0
    out = capsys.readouterr().out.split()
    assert out[-2:] == ["launch.py", "stage=distill"] and "--nproc_per_node=8" in out and "--node_rank=1" in out
    monkeypatch.delenv("SLURM_JOB_ID")
    with pytest.raises(SystemExit) as stop:
        slurm.main(["--print", "--", "launch.py"])
    assert stop.value.code == 2 and "not inside a Slurm job" in capsys.readouterr().err


def _hydra_cfg(*overrides):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="streakline"):
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=True)


def test_launcher_slurm_selects_submitit_and_maps_our_keys():
    cfg = _hydra_cfg("launcher=slurm", "launcher.partition=gpu", "launcher.account=proj42", "launcher.nodes=2",
                     "launcher.gpus_per_node=8", "launcher.time_min=720")  # fmt: skip
    hl = cfg.hydra.launcher
    assert hl._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert cfg.hydra.runtime.choices["hydra/launcher"] == "slurm"
    got = {k: OmegaConf.select(cfg, f"hydra.launcher.{k}") for k in
           ("partition", "account", "nodes", "gpus_per_node", "timeout_min", "tasks_per_node")}  # fmt: skip
    assert got == {"partition": "gpu", "account": "proj42", "nodes": 2, "gpus_per_node": 8, "timeout_min": 720,
                   "tasks_per_node": 1}  # fmt: skip
    # null partition/account stay null, so sbatch uses the cluster's defaults
    default = _hydra_cfg("launcher=slurm").hydra.launcher
    assert default.partition is None and default.account is None and default.nodes == 1


def test_local_stays_the_default_launcher():
    cfg = _hydra_cfg()
    assert cfg.launcher.name == "local"
    assert cfg.hydra.runtime.choices["hydra/launcher"] == "basic"
