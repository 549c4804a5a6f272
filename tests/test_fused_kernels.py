"""The fused gpu backend's Triton kernels, run on CPU by Triton's interpreter (TRITON_INTERPRET=1, in a child
process so no other test sees interpreted kernels): at EP=1 the whole gpu backend, grouped GEMMs included, equals the
reference backend forward and backward, with skewed routing and an expert that gets no token."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

E, H, I, K, T = 8, 24, 40, 3, 33  # I > the kernels' column block would be too slow interpreted; 40 is not a power of 2


def compare_backends() -> list[float]:
    import moe_lab.moe.fused  # noqa: F401

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=gen)
    gate_up_proj, down_proj = torch.randn(E, 2 * I, H, generator=gen) * 0.3, torch.randn(E, H, I, generator=gen) * 0.3
    law = (torch.arange(E - 1, dtype=torch.float64) + 1) ** -1.5  # skewed over experts 0..6; expert 7 idle
    ids = torch.multinomial(law.expand(T, -1), K, generator=gen)
    weights, grad_out = torch.rand(T, K, generator=gen), torch.randn(T, H, generator=gen)
    results = {}
    for backend in ("reference", "gpu"):
        inputs = [t.clone().requires_grad_() for t in (x, weights, gate_up_proj, down_proj)]
        y = torch.ops.moe_lab.fused_moe(inputs[0], ids, *inputs[1:], E, "", backend)[0]
        results[backend] = [y, *torch.autograd.grad(y, inputs, grad_out)]
    assert results["gpu"][3][7].abs().max() == 0 and results["gpu"][4][7].abs().max() == 0
    return [(g - r).abs().max().item() / r.abs().max().item() for g, r in zip(results["gpu"], results["reference"])]


def test_gpu_backend_interpreted_matches_reference():
    code = "from tests.test_fused_kernels import compare_backends; print(max(compare_backends()))"
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert float(done.stdout.strip().splitlines()[-1]) < 1e-5


def zero_idle_experts_check() -> bool:
    import triton

    from moe_lab.moe.fused import kernels

    out = torch.ones(4, 3, 50)
    offs = torch.tensor([8, 8, 16, 16], dtype=torch.int32)  # experts 1 and 3 have no rows
    kernels.zero_idle_experts_kernel[(4, 3)](out, offs, SLAB=150, PER_PROGRAM=triton.cdiv(150, 3), BLOCK=32)
    return bool((out[[1, 3]] == 0).all() and (out[[0, 2]] == 1).all())


def test_zero_idle_experts_interpreted():
    code = "from tests.test_fused_kernels import zero_idle_experts_check as f; print(f())"
    done = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "True"
