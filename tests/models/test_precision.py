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
SKYLAKE = frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl"})
ZEN3 = frozenset({"avx2", "fma", "sse4_2"})
SANDY_BRIDGE = frozenset({"avx", "sse4_2"})  # no AVX2: not even the decode kernels


@pytest.mark.parametrize(
    ("flags", "native", "named", "kind"),
    [(SAPPHIRE_RAPIDS, True, "amx_bf16", "amx"), (ZEN4, True, "avx512_bf16", "avx512_bf16"),
     (GRAVITON3, True, "bf16", "arm_bf16"), (SKYLAKE, False, "emulated", "avx2"), (ZEN3, False, "avx2, fma", "avx2"),
     (SANDY_BRIDGE, False, "emulated", "none"), (frozenset(), False, "emulated", "none")],
)  # fmt: skip
def test_native_bf16_and_the_cpu_kind_are_read_from_the_cpu_flags(flags, native, named, kind, monkeypatch):
    monkeypatch.setenv(precision.CPU_KIND_ENV, "amx")  # given flags are judged as they are: the override is ignored
    hw = detect("cpu", flags=flags)
    assert hw.native_bf16 is native and named in hw.evidence
    assert (hw.cpu_kind, hw.overridden) == (kind, False)


def test_auto_is_bf16_exactly_where_it_is_native():
    native, emulated = Hardware("cpu", True, "amx_bf16"), Hardware("cpu", False, "none")
    assert resolve("auto", hardware=native) == "bf16" and resolve("auto", hardware=emulated) == "fp32"
    assert resolve("fp32", hardware=native) == "fp32"  # one override away
    with pytest.warns(UserWarning, match="emulated"):
        assert resolve("bf16", hardware=emulated) == "bf16"  # forced: honoured, with a warning
    with pytest.raises(precision.PrecisionError, match="precision=auto"):
        resolve("half", hardware=native)


def test_this_machine_resolves_as_its_flags_say(monkeypatch):
    monkeypatch.delenv(precision.CPU_KIND_ENV, raising=False)
    hw = detect("cpu")
    assert hw.native_bf16 == bool(set(precision.CPU_BF16_FLAGS) & precision.cpu_flags()) or not precision.cpu_flags()
    want = torch.bfloat16 if hw.native_bf16 or hw.cpu_kind == "avx2" else torch.float32  # a frozen model's dtype
    assert model_dtype("auto", "float32", "cpu") == want
    assert (hw.cpu_kind == "avx2") == (not hw.native_bf16 and {"avx2", "fma"} <= precision.cpu_flags())
    assert model_dtype("fp32", "bfloat16", "cpu") == torch.float32
    # a half-precision preset (a 70B one) is never raised to fp32 by auto, which would not fit
    assert model_dtype("auto", "bfloat16", "cpu") == torch.bfloat16


def test_an_unknown_precision_is_refused_by_the_config():
    with pytest.raises(ConfigError, match="precision"):
        compose_config(["model=micro", "precision=fp8"])


def test_doctor_reports_the_detection_and_each_stage_precision(capsys, monkeypatch):
    monkeypatch.delenv(precision.CPU_KIND_ENV, raising=False)
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
    assert report["cpu_kind"] == hw.cpu_kind and not report["overridden"] and "(detected;" in printed


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


# each CPU kind as $STREAKLINE_CPU_KIND sets it: whether bf16 is native there, so what precision=auto picks
KINDS = [("none", False), ("avx2", False), ("avx512_bf16", True), ("amx", True), ("arm_bf16", True)]


@pytest.mark.parametrize(("kind", "native"), KINDS)
def test_the_cpu_kind_override_takes_that_kinds_precision_path_on_any_machine(kind, native, monkeypatch):
    monkeypatch.setenv(precision.CPU_KIND_ENV, f" {kind.upper()} ")  # case and spaces forgiven
    hw = detect("cpu")
    assert (hw.cpu_kind, hw.native_bf16, hw.overridden) == (kind, native, True)
    assert f"{precision.CPU_KIND_ENV}={kind}" in hw.evidence and "this machine" in hw.evidence
    assert resolve("auto", "cpu") == ("bf16" if native else "fp32")
    # a frozen model (sampling, decoding) is bf16 where it is native and where the AVX2 decode kernels widen it
    frozen = native or kind == "avx2"
    assert resolve("auto", "cpu", frozen=True) == ("bf16" if frozen else "fp32")
    assert model_dtype("auto", "float32", "cpu") == (torch.bfloat16 if frozen else torch.float32)
    assert precision.training_autocast("auto", "fp32") == (torch.bfloat16 if native else None)  # training: native only
    assert resolve("fp32", "cpu") == "fp32"  # an explicit setting is still taken as said


def test_forced_bf16_on_a_cpu_kind_without_native_bf16_warns(monkeypatch, recwarn):
    monkeypatch.setenv(precision.CPU_KIND_ENV, "none")
    with pytest.warns(UserWarning, match="emulated, slower than fp32.*precision=auto picks fp32"):
        assert model_dtype("bf16", "float32", "cpu") == torch.bfloat16  # honoured, with the warning
    monkeypatch.setenv(precision.CPU_KIND_ENV, "amx")
    recwarn.clear()
    assert resolve("bf16", "cpu") == "bf16"
    assert not [w for w in recwarn if "emulated" in str(w.message)]  # native there: nothing to warn of


def test_an_unknown_cpu_kind_is_refused_with_the_kinds(monkeypatch):
    monkeypatch.setenv(precision.CPU_KIND_ENV, "sapphire")
    with pytest.raises(
        precision.PrecisionError, match="STREAKLINE_CPU_KIND='sapphire'.*amx, avx512_bf16, arm_bf16, avx2, none"
    ):
        detect("cpu")
    monkeypatch.setenv(precision.CPU_KIND_ENV, "")  # empty: unset
    assert not detect("cpu").overridden


@pytest.mark.parametrize(("kind", "native"), [("none", False), ("amx", True), ("avx2", False)])
def test_doctor_says_the_cpu_kind_was_overridden(kind, native, capsys, monkeypatch):
    from streakline.pipelines import run_stage

    monkeypatch.setenv(precision.CPU_KIND_ENV, kind)
    report = run_stage(compose_config(["stage=doctor", "model=micro"])).metrics["precision"]
    printed = capsys.readouterr().out
    assert (report["cpu_kind"], report["overridden"], report["native_bf16"]) == (kind, True, native)
    # the micro verifier (0.1M parameters) is under the avx2 kind's size rule: its frozen stages stay fp32 there
    assert report["resolved"] == ("bf16" if native else "fp32")
    assert report["stages"]["decode"]["precision"] == report["resolved"]
    assert report["stages"]["distill"]["precision"] == ("bf16" if native else "fp32")  # training: native only
    assert f"cpu kind           {kind} (overridden by $STREAKLINE_CPU_KIND)" in printed
    assert ("fp32 kept: bf16 would be emulated here" in printed) is (kind == "none")
    assert ("fp32 kept: this verifier is under 20M parameters" in printed) is (kind == "avx2")


def test_the_avx2_kinds_frozen_bf16_is_for_models_whose_weights_stream_from_memory(monkeypatch):
    monkeypatch.setenv(precision.CPU_KIND_ENV, "avx2")
    big, small = precision.KERNEL_BF16_MIN_PARAMS, precision.KERNEL_BF16_MIN_PARAMS - 1
    assert resolve("auto", "cpu", frozen=True, params=big) == "bf16"
    assert resolve("auto", "cpu", frozen=True, params=None) == "bf16"  # a checkpoint folder's: not known small
    assert resolve("auto", "cpu", frozen=True, params=small) == "fp32"
    assert model_dtype("auto", "float32", "cpu", params=small) == torch.float32
    report = precision.report("auto", "cpu", params=big)
    assert report["resolved"] == "bf16" and not report["small"]
    monkeypatch.setenv(precision.CPU_KIND_ENV, "amx")  # native: the size does not matter
    assert resolve("auto", "cpu", frozen=True, params=small) == "bf16"
