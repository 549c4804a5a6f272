"""``python -m moe_lab.plan.calibrate`` on the CPU (tiny sizes): it writes a hardware profile that the planner reads
back with ``hardware=<the file>``, holding its measurements and the base profile's peaks; on a GPU (``gpu`` marker,
full sizes) its measurements against the efficiencies fitted from the H200 records."""

from __future__ import annotations

import sys

import pytest
import torch
import yaml

from moe_lab.metrics.flops import HARDWARE_CONF
from moe_lab.plan import calibrate
from moe_lab.plan.config import compose
from moe_lab.plan.hardware import Hardware, profile_path_overrides
from moe_lab.plan.planner import plan


def test_calibrate_writes_a_profile_the_planner_reads(tmp_path, monkeypatch):
    out = tmp_path / "profile.yaml"
    monkeypatch.setattr(sys, "argv", ["calibrate", "--out", str(out), "--size", "tiny", "--base", "b300"])
    calibrate.main()
    values = yaml.safe_load(out.read_text())
    assert values.pop("_target_") == "moe_lab.plan.hardware.Hardware"
    profile = Hardware(**values)
    base = yaml.safe_load((HARDWARE_CONF / "b300.yaml").read_text())
    assert profile.name == "b300_measured" and profile.peak_bf16_tflops == base["peak_bf16_tflops"]
    for key in ("dense_gemm_efficiency", "grouped_gemm_efficiency", "attention_efficiency", "hbm_efficiency"):
        assert 0 < values[key] <= 1 and "Measured:" in out.read_text() and key in out.read_text().splitlines()[1]
    assert values["host_memory_gbps"] > 0 and values["host_memory_gib"] > 0

    overrides = profile_path_overrides(
        ["model=qwen3_30b", "model.num_layers=2", f"hardware={out}", "hardware.gpus_per_node=2", "parallel.ep=2"]
    )
    assert overrides[2:4] == ["hardware=file", f"hardware.path={out}"]
    planned = plan(compose(overrides), search=False)
    assert planned["plan"]["hardware"]["name"] == "b300_measured" and planned["plan"]["mesh"]["world"] == 2
    assert planned["metrics"]["s_per_step"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_calibration_on_the_gpu_agrees_with_the_fitted_profile(tmp_path, monkeypatch):
    """On an H200: the rates calibrate measures at full size are those the default efficiencies were fitted to from
    the grid's traces: GEMM and attention within 20 %; a device copy streams at least as well as the AdamW the HBM
    share was fitted on; the grouped GEMM is torch._grouped_mm's with SwiGLU, which the fitted fused-op share
    exceeds."""
    out = tmp_path / "profile.yaml"
    monkeypatch.setattr(sys, "argv", ["calibrate", "--out", str(out), "--size", "full"])
    calibrate.main()
    measured = yaml.safe_load(out.read_text())
    h200 = yaml.safe_load((HARDWARE_CONF / "h200.yaml").read_text())
    fitted = Hardware(**{k: v for k, v in h200.items() if k != "_target_"})  # its efficiencies: the H200 fit
    for key in ("dense_gemm_efficiency", "attention_efficiency"):
        assert measured[key] == pytest.approx(getattr(fitted, key), rel=0.20), key
    assert measured["hbm_efficiency"] >= 0.9 * fitted.hbm_efficiency
    assert 0.3 < measured["grouped_gemm_efficiency"] <= fitted.grouped_gemm_efficiency * 1.2
