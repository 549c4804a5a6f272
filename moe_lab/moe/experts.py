"""SwiGLU experts: the stacked weights (``GroupedExperts``) and the one computation on them (``grouped_swiglu``).

Experts only compute. Moving tokens to them and back is a dispatcher's job (``moe_lab.moe.dispatcher``): the MoE
block hands its experts' weights to the dispatcher, which never sees this module.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

from moe_lab.moe.fp8.grouped import fp8_grouped_gemm


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the experts compute in: autocast's, when it is on for ``x``'s device, else ``x``'s own."""
    return torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype


def grouped_swiglu(
    rows: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    precision: str = "bf16",
) -> torch.Tensor:
    """Expert-contiguous rows in, expert outputs out: grouped GEMM -> SwiGLU -> grouped GEMM.

    rows [R, H], the first ``tokens_per_expert[0]`` for expert 0 and so on; tokens_per_expert [L]; gate_up_proj
    [L, 2I, H] and down_proj [L, H, I], the L experts the rows are for. Returns [R, H]. ``precision``: the GEMMs'
    operands, ``bf16`` (the compute dtype: ``torch._grouped_mm``) or ``fp8`` (blockwise FP8 on the stacks' per-step
    copies: ``moe_lab.moe.fp8.grouped``).
    """
    # Profiler scopes are entered inside functions, not as decorators: torch.compile (before torch 2.13) traces a
    # record_function only when it is created in the compiled code.
    with record_function("moe_lab::expert_compute"):
        dtype = compute_dtype(rows)
        offsets = torch.cumsum(tokens_per_expert, 0, dtype=torch.int32)
        rows = rows.to(dtype)
        if precision == "fp8":
            gemm = fp8_grouped_gemm(offsets, rows.shape[0])
        else:

            def gemm(a, w):
                return torch._grouped_mm(a, w.to(dtype).transpose(-2, -1), offs=offsets)

        gate, up = gemm(rows, gate_up_proj).chunk(2, dim=-1)  # [R, 2I]
        return gemm(F.silu(gate) * up, down_proj)


class GroupedExperts(nn.Module):
    """SwiGLU experts stored as stacked tensors; once expert parallelism is applied (``moe_lab.parallel``) it holds
    only its rank's experts, global experts ``expert_offset`` to ``expert_offset + num_local_experts - 1``."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.num_experts = num_experts  # global count; the parameters may hold a slice of them
        self.expert_offset: int = 0  # global index of the first expert held here
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    @property
    def num_local_experts(self) -> int:
        return self.gate_up_proj.shape[0]

    def forward(self, rows: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        return grouped_swiglu(rows, tokens_per_expert, self.gate_up_proj, self.down_proj)
