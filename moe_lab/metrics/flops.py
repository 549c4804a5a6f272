"""FLOPs per token and MFU.

The shared formula (torchtitan, prime-rl) is FLOPs/token = 6 * N_active + 6 * L * H_q * (d_qk + d_v) * seq, where
N_active excludes the input embedding table (a lookup, no FLOPs) and includes the LM head. Its attention term counts
causal attention as dense; the executed-FLOPs variant counts it as half, which is what a causal kernel performs.
"""

from __future__ import annotations

import functools

import torch
import yaml

from moe_lab.models.qwen3_moe import Qwen3MoeConfig, count_parameters
from moe_lab.runtime.paths import CONF_DIR

# The hardware group's option of a GPU, by a fragment of its name: its yaml holds the GPU's dense bf16 peak
# (vendor datasheet, no sparsity), which MFU divides by here and the planner (moe_lab.plan) plans with.
HARDWARE_OF_GPU = {"H200": "h200", "H100": "h100", "B200": "b200", "B300": "b300"}
HARDWARE_CONF = CONF_DIR / "hardware"


def hardware_option(gpu_name: str | None) -> str | None:
    """The hardware group's option of the GPU named ``gpu_name`` (``torch.cuda.get_device_name``); None if unknown."""
    return next((v for k, v in HARDWARE_OF_GPU.items() if gpu_name and k in gpu_name), None)


@functools.cache
def peak_bf16_flops(gpu_name: str | None) -> float | None:
    """Dense bf16 peak FLOP/s of the GPU named ``gpu_name`` (``torch.cuda.get_device_name``); None if unknown."""
    option = hardware_option(gpu_name)
    if option is None:
        return None
    return yaml.safe_load((HARDWARE_CONF / f"{option}.yaml").read_text())["peak_bf16_tflops"] * 1e12


def flops_per_token(cfg: Qwen3MoeConfig, seq_len: int) -> dict[str, float]:
    _, active = count_parameters(cfg)
    matmul = 6 * (active - cfg.vocab_size * cfg.hidden_size)
    attention = 6 * cfg.num_layers * cfg.num_heads * (2 * cfg.head_dim) * seq_len
    return {"shared": float(matmul + attention), "executed": float(matmul + attention / 2)}


def peak_flops(device: torch.device, override: float | None = None) -> float | None:
    """Per-device peak FLOP/s; None on CPU or an unknown GPU (MFU is then reported as null)."""
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    return peak_bf16_flops(torch.cuda.get_device_name(device))
