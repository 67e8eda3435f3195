"""Precision detection and resolution (``models/precision.py``) and what ``stage=doctor`` reports of it.

OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/models/test_precision.py
"""

from __future__ import annotations

import pytest
import torch

from streakline.config import ConfigError, compose_config
from streakline.models import precision
from streakline.models.precision import Hardware, detect, model_dtype, resolve

SAPPHIRE_RAPIDS = frozenset({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "amx_int8"})
ZEN4 = frozenset({"avx512f", "avx512_bf16"})
GRAVITON3 = frozenset({"fp", "asimd", "bf16", "sve"})
SKYLAKE = frozenset({"avx2", "avx512f", "avx512bw", "avx512vl"})


@pytest.mark.parametrize(
    ("flags", "native", "named"),
    [(SAPPHIRE_RAPIDS, True, "amx_bf16"), (ZEN4, True, "avx512_bf16"), (GRAVITON3, True, "bf16"),
     (SKYLAKE, False, "emulated"), (frozenset(), False, "emulated")],
)  # fmt: skip
def test_native_bf16_is_read_from_the_cpu_flags(flags, native, named):
    hw = detect("cpu", flags=flags)
    assert hw.native_bf16 is native and named in hw.evidence


def test_auto_is_bf16_exactly_where_it_is_native():
    native, emulated = Hardware("cpu", True, "amx_bf16"), Hardware("cpu", False, "none")
    assert resolve("auto", hardware=native) == "bf16" and resolve("auto", hardware=emulated) == "fp32"
    assert resolve("fp32", hardware=native) == "fp32"  # one override away
    with pytest.warns(UserWarning, match="emulated"):
        assert resolve("bf16", hardware=emulated) == "bf16"  # forced: honoured, with a warning
    with pytest.raises(precision.PrecisionError, match="precision=auto"):
        resolve("half", hardware=native)


def test_this_machine_resolves_as_its_flags_say():
    hw = detect("cpu")
    assert hw.native_bf16 == bool(set(precision.CPU_BF16_FLAGS) & precision.cpu_flags()) or not precision.cpu_flags()
    want = torch.bfloat16 if hw.native_bf16 else torch.float32
    assert model_dtype("auto", "float32", "cpu") == want
    assert model_dtype("fp32", "bfloat16", "cpu") == torch.float32
    # a half-precision preset (a 70B one) is never raised to fp32 by auto, which would not fit
    assert model_dtype("auto", "bfloat16", "cpu") == torch.bfloat16


def test_an_unknown_precision_is_refused_by_the_config():
    with pytest.raises(ConfigError, match="precision"):
        compose_config(["model=micro", "precision=fp8"])


def test_doctor_reports_the_detection_and_each_stage_precision(capsys):
    from streakline.pipelines import run_stage

    report = run_stage(compose_config(["stage=doctor", "model=micro", "precision=fp32"])).metrics["precision"]
    printed = capsys.readouterr().out
    hw = detect("cpu")
    assert (report["native_bf16"], report["evidence"]) == (hw.native_bf16, hw.evidence)
    assert report["resolved"] == "fp32" and report["stages"]["trajectories"] == {
        "roles": ["verifier"],
        "precision": "fp32",
    }
    assert "precision=fp32 -> fp32" in printed and "trajectories" in printed and hw.evidence in printed


def test_distill_autocasts_an_fp32_trainer_exactly_where_bf16_is_native():
    from streakline.models.precision import training_autocast

    native, emulated = Hardware("cpu", True, "amx_bf16"), Hardware("cpu", False, "none")
    assert training_autocast("auto", "fp32", hardware=native) == torch.bfloat16
    assert training_autocast("auto", "fp32", hardware=emulated) is None  # emulated bf16: fp32 kept
    assert training_autocast("fp32", "fp32", hardware=native) is None  # precision=fp32: fp32 everywhere
    assert training_autocast("auto", "fp32", "off", hardware=native) is None  # trainer.autocast=off: distill only
    with pytest.warns(UserWarning, match="emulated"):
        assert training_autocast("auto", "fp32", "bf16", hardware=emulated) == torch.bfloat16  # forced
    # DeepSpeed's own bf16 (half-precision weights, fp32 master copy) needs no autocast on top
    assert training_autocast("auto", "bf16", hardware=native) is None
    report = precision.report("auto", "cpu", trainer_precision="bf16")
    assert report["stages"]["distill"] == {"roles": ["drafter (DeepSpeed, trainer.precision)"], "precision": "bf16"}
