"""FLOPs per token and MFU.

The shared formula (torchtitan, prime-rl) is FLOPs/token = 6 * N_active + 6 * L * H_q * (d_qk + d_v) * seq, where
N_active excludes the input embedding table (a lookup, no FLOPs) and includes the LM head. Its attention term counts
causal attention as dense; the executed-FLOPs variant counts it as half, which is what a causal kernel performs.
"""

from __future__ import annotations

import torch

from moe_lab.models.qwen3_moe import Qwen3MoeConfig, count_parameters

# Dense bf16 peak FLOP/s per GPU by name fragment (vendor datasheets, no sparsity).
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "B200": 2.25e15, "B300": 2.25e15}


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
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)
