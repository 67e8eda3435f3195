"""Stage doctor: the environment report and where each role's weights would come from.

Run: python -m pytest tests/pipelines/test_doctor.py
"""

import pytest
from omegaconf import OmegaConf

from streakline.config import compose_config
from streakline.pipelines import doctor, run_stage


@pytest.fixture(scope="module")
def tiny_report():
    return compose_config(["stage=doctor", "model=tiny"])


def test_doctor_reports_environment_and_three_roles(tiny_report, capsys):
    report = run_stage(tiny_report).metrics
    printed = capsys.readouterr().out
    env = report["environment"]
    assert env["python"] and env["hydra"] and env["torch"]
    assert isinstance(env["cuda_available"], bool) and env["cuda_devices"] >= 0
    assert set(report["roles"]) == {"verifier", "drafter", "target"}
    target = report["roles"]["target"]
    assert (target["preset"], target["family"], target["attention"], target["gamma"]) == (
        "tiny-target",
        "qwen2",
        "block_causal",
        16,
    )
    for role in report["roles"].values():
        assert role["weights"] == doctor.TINY_SOURCE and role["available"]
        assert role["parity_max_abs"] < doctor.PARITY_TOLERANCE
    # The tiny world's sizes (verifier 6-10M, drafter 1-2M; the target shares the verifier's architecture, since it
    # starts from the verifier's weights: the 4-6M of the first tiny world gave a target too weak to decode with).
    sizes = {r: info["parameters"] / 1e6 for r, info in report["roles"].items()}
    assert 6 <= sizes["verifier"] <= 10 and 1 <= sizes["drafter"] <= 2 and sizes["target"] == sizes["verifier"], sizes
    assert "roles (model=tiny)" in printed and "tiny-drafter" in printed and "TRITON_INTERPRET" in printed


def test_triton_interpret_is_reported(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert doctor.environment()["triton_interpret"] == "1"


def _checkpoint(**fields):
    node = {"name": "x", "path": None, "hub_id": None, "arch": None}
    return OmegaConf.create({**node, **fields})


def test_local_path_wins_and_is_checked(tmp_path):
    source, available = doctor.weights_source(_checkpoint(path=str(tmp_path), hub_id="org/model"))
    assert source == f"local: {tmp_path} (exists)" and available
    source, available = doctor.weights_source(_checkpoint(path=str(tmp_path / "absent")))
    assert source.endswith("(missing)") and not available


def test_hub_id_is_looked_up_in_the_local_cache_only(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    node = _checkpoint(hub_id="org/model")
    source, available = doctor.weights_source(node)
    assert "not in the local HF cache" in source and not available

    # The layout huggingface_hub writes: refs/main names the snapshot folder that holds the files.
    repo = tmp_path / "models--org--model"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "snapshots" / "abc123" / "config.json").write_text("{}")
    source, available = doctor.weights_source(node)
    assert source == "hub: org/model (in the local HF cache)" and available
