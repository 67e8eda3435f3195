"""The command line as a user meets it: launch.py in a subprocess, its exit status and what it prints.

Run: python -m pytest tests/config/test_cli.py
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from streakline.config import CONF_DIR

LAUNCH = Path(CONF_DIR).parent / "launch.py"


def launch(*args: str, cwd: Path, program: list[str] | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    command = (program or [sys.executable, str(LAUNCH)]) + list(args)
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_cfg_job_prints_the_resolved_preset(tmp_path):
    result = launch("--cfg", "job", "model=qwen2.5-72b", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "hub_id: Qwen/Qwen2.5-72B-Instruct" in result.stdout
    assert "hub_id: apple/DiffuCoder-7B-Instruct" in result.stdout
    # --cfg stops before the job: no run folder appears.
    assert not (tmp_path / "runs").exists()


def test_role_swap_on_the_command_line(tmp_path):
    result = launch("--cfg", "job", "--package", "model", "model.verifier=qwen2.5-72b", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "name: qwen2.5-72b" in result.stdout
    assert "name: tiny-drafter" in result.stdout


def test_presets_from_an_extra_config_dir_fill_roles(tmp_path):
    (tmp_path / "mine" / "checkpoint").mkdir(parents=True)
    (tmp_path / "mine" / "checkpoint" / "my-verifier.yaml").write_text(
        "name: my-verifier\npath: ckpt/v\nfamily: auto\nattention: causal\nshift: false\n"
        "mask_token: null\ngamma: 4\ndtype: bfloat16\n"
    )
    result = launch("-cd", "mine", "--cfg", "job", "-p", "model.verifier", "model.verifier=my-verifier", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "name: my-verifier" in result.stdout and "family: auto" in result.stdout


def test_unknown_key_exits_2_with_the_valid_keys(tmp_path):
    result = launch("trainer.lrr=1e-4", cwd=tmp_path)
    assert result.returncode == 2
    assert "unknown config key 'trainer.lrr'" in result.stderr
    assert "valid keys under 'trainer': name, zero_stage, precision, lr, min_lr_ratio" in result.stderr


@pytest.mark.parametrize(
    ("override", "listed"), [("stage=nope", "doctor"), ("model=nope", "qwen2.5-72b"), ("+method=nope", "distillspec")]
)
def test_unknown_group_option_exits_2_with_the_available_options(tmp_path, override, listed):
    result = launch(override, cwd=tmp_path)
    assert result.returncode == 2
    group = override.split("=")[0].lstrip("+")
    assert f"'nope' is not an option of {group}; {group}=NAME takes one of" in result.stderr
    assert listed in result.stderr and "Traceback" not in result.stderr


def test_a_close_group_option_is_suggested_and_a_sweep_is_checked_name_by_name(tmp_path):
    assert "(did you mean 'dream'?)" in launch("model=dreem", cwd=tmp_path).stderr
    swept = launch("-m", "model=tiny,dreem", cwd=tmp_path)
    assert swept.returncode == 2 and "'dreem' is not an option of model" in swept.stderr


def test_unknown_checkpoint_preset_lists_the_presets(tmp_path):
    result = launch("model.drafter=nope", cwd=tmp_path)
    assert result.returncode == 2
    assert "'nope' is not a checkpoint preset" in result.stderr
    assert "diffucoder-7b" in result.stderr


def test_bad_choice_value_exits_2_with_the_choices(tmp_path):
    result = launch("model.verifier.attention=sideways", cwd=tmp_path)
    assert result.returncode == 2
    assert "model.verifier.attention='sideways'" in result.stderr
    assert "causal, full, prefix_causal, block_causal" in result.stderr


def test_slurm_without_multirun_is_refused_not_run_here(tmp_path):
    """Hydra hands jobs to hydra-submitit-launcher only with -m; without it the stage would run on this machine,
    silently. (launcher=ray is not a Hydra launcher: it fans work out from this process, with or without -m.)"""
    result = launch("launcher=slurm", "stage=doctor", cwd=tmp_path)
    assert result.returncode == 2 and "add -m, e.g. python launch.py -m launcher=slurm" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "runs" / "default").exists()  # no stage ran


def test_help_lists_the_groups(tmp_path):
    result = launch("--help", cwd=tmp_path)
    assert result.returncode == 0
    assert "== Configuration groups ==" in result.stdout
    assert "model: diffucoder, diffullama" in result.stdout
    assert "model.verifier=qwen2.5-72b" in result.stdout


def test_doctor_on_the_tiny_world(tmp_path):
    result = launch("stage=doctor", "model=tiny", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    for role, preset in (("verifier", "tiny-verifier"), ("drafter", "tiny-drafter"), ("target", "tiny-target")):
        assert f"{role}" in result.stdout and preset in result.stdout
    assert result.stdout.count("tiny: built by stage=bootstrap") == 3
    # Hydra's own files land under run_root in the directory the command ran from.
    assert list((tmp_path / "runs" / "hydra").glob("*/*/.hydra/config.yaml"))


def test_console_script_matches_launch_py(tmp_path):
    script = shutil.which("streakline", path=str(Path(sys.executable).parent))
    if script is None:
        pytest.skip("streakline is not installed in this environment (pip install -e .)")
    args = ("--cfg", "job", "model=diffullama", "model.target=llada-8b")
    via_script = launch(*args, cwd=tmp_path, program=[script])
    via_launch = launch(*args, cwd=tmp_path)
    assert via_script.returncode == via_launch.returncode == 0, via_script.stderr
    assert via_script.stdout == via_launch.stdout
    assert "GSAI-ML/LLaDA-8B-Instruct" in via_script.stdout


def test_a_full_run_root_is_one_line_before_hydra_writes_there(tmp_path, small_disk):
    """Hydra writes its log and config under run_root before any stage code runs: on a full disk that was a Hydra
    traceback; now the same one line as a full disk anywhere, status 2."""
    disk = small_disk(256)
    fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)
    try:  # fill it to the last block
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    proc = launch("stage=decode", "model=micro", f"run_root={disk}", "prompt_ids=[1,2]", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    # nothing was written yet: the line says what the disk has and what a run needs, not that a write failed
    assert re.search(r"the disk holding .* has [\d.]+ (B|KiB) free, less than the 1\.0 MiB a run needs", proc.stderr)
    assert "failed" not in proc.stderr and "set run_root=" in proc.stderr
    assert "Traceback" not in proc.stderr and "Logging error" not in proc.stderr
