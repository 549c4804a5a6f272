"""The FP8 op's ``gpu_deep_gemm`` backend: the ``gpu`` backend's layout, exchange and combine
(``moe_lab.moe.fused.gpu``), with DeepGEMM's m-grouped FP8 GEMMs (``m_grouped_fp8_gemm_nt_contiguous``) and the
quantizing kernels of ``moe_lab.moe.fp8.kernels`` between them. No host sync beyond the layout's one per forward."""

from __future__ import annotations

import torch
import triton

from moe_lab.moe.fp8 import kernels
from moe_lab.moe.fp8.quant import FP8, TILE
from moe_lab.moe.fused.gpu import _Exchange, _Gemms, kernel_layout, row_experts

# Rows per program of the row kernels, a [8, 128] tile at a time (at 16 the SwiGLU backward takes 238 registers).
ROWS = 8


def _grid(rows: int) -> tuple[int]:
    return (triton.cdiv(rows, ROWS),)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> e4m3 [M, K], fp32 scales [M, K / 128] (1x128 tiles)."""
    rows, width = x.shape
    q = torch.empty(x.shape, dtype=FP8, device=x.device)
    scale = torch.empty(rows, width // TILE, dtype=torch.float32, device=x.device)
    if rows:
        kernels.quantize_rows_kernel[_grid(rows)](x, q, scale, rows, width // TILE, ROWS)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    rows, width = q.shape
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    if rows:
        kernels.dequantize_rows_kernel[_grid(rows)](q, scale, out, rows, width // TILE, ROWS)
    return out


def gemm_nt(m_indices, a_q, a_scale, w) -> torch.Tensor:
    """rows [R, K] (e4m3, 1x128 scales) @ w[e].T for w = (e4m3 [L, N, K], 128x128 scales) -> bf16 [R, N]. The row
    scales go in MN-major (DeepGEMM's layout on SM90; handing them over K-major costs it a transpose per call)."""
    import deep_gemm

    out = torch.empty(a_q.shape[0], w[0].shape[1], dtype=torch.bfloat16, device=a_q.device)
    # Padding rows are zeros already (and skipped: m_indices -1): no zero-filling pass over them.
    deep_gemm.m_grouped_fp8_gemm_nt_contiguous(
        (a_q, a_scale.t().contiguous().t()), w, out, m_indices, ensure_zero_padding=False
    )
    return out


def forward(x, topk_ids, topk_weights, gate_up_w, down_w, local_experts, num_experts, group, align):
    num_tokens, top_k = topk_ids.shape
    inter = down_w[0].shape[2]
    layout = kernel_layout(topk_ids, num_experts, align, group)  # the host sync: buffer sizes
    ids = topk_ids.contiguous()
    ex = _Exchange(group, x.device)
    ex.reserve(layout.max_rows, x.shape[1], x.dtype)
    row_src, row_weight = ex.route(layout.pos, ids, local_experts, topk_weights.contiguous(), layout.rows, num_tokens)
    m_indices = row_experts(layout.offs, row_src)
    x_q, x_scale = quantize_rows(x.contiguous())  # per token, before dispatch: rows travel and are saved in FP8
    x_q = ex.gather_rows("x_fp8", x_q.view(torch.uint8), row_src, layout.offs).view(FP8)
    x_scale = ex.gather_rows("x_scale", x_scale, row_src, layout.offs)
    gate_up = gemm_nt(m_indices, x_q, x_scale, gate_up_w)
    act_q = torch.empty(layout.rows, inter, dtype=FP8, device=x.device)
    act_scale = torch.empty(layout.rows, inter // TILE, dtype=torch.float32, device=x.device)
    kernels.swiglu_forward_fp8_kernel[_grid(layout.rows)](
        act_q, act_scale, gate_up, row_weight, row_src, layout.offs, layout.offs.numel(), inter // TILE, ROWS
    )
    out = gemm_nt(m_indices, act_q, act_scale, down_w)
    y = ex.combine("out", out, layout.pos, ids, local_experts, x.dtype)
    return y, x_q, x_scale, gate_up, row_weight, row_src, layout.pos, layout.offs


def backward(
    dy, x_q, x_scale, gate_up, row_weight, row_src, pos, offs, topk_ids, gate_up_wt, down_wt, local_experts, group
):
    num_tokens, top_k = pos.shape
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    ids = topk_ids.contiguous()
    ex = _Exchange(group, dy.device)
    m_indices, gemms = row_experts(offs, row_src), _Gemms("gpu", offs, row_src)  # weight gradients: torch._grouped_mm
    dy_routed = ex.gather_rows("dy", dy, row_src, offs)  # bf16: the down projection's weight gradient reads it
    d_act_weighted = gemm_nt(m_indices, *quantize_rows(dy_routed), down_wt)
    d_gate_up = torch.empty_like(gate_up)
    d_gate_up_q = torch.empty(gate_up.shape, dtype=FP8, device=dy.device)
    d_gate_up_scale = torch.empty(rows, 2 * inter // TILE, dtype=torch.float32, device=dy.device)
    act_weighted = torch.empty_like(d_act_weighted)
    d_row_weight = torch.empty_like(row_weight)
    kernels.swiglu_backward_fp8_kernel[_grid(rows)](
        d_gate_up,
        d_gate_up_q,
        d_gate_up_scale,
        act_weighted,
        d_row_weight,
        gate_up,
        d_act_weighted,
        row_weight,
        row_src,
        offs,
        offs.numel(),
        inter // TILE,
        ROWS,
    )
    d_down_proj = gemms.wgrad(dy_routed, act_weighted)
    dx_routed = gemm_nt(m_indices, d_gate_up_q, d_gate_up_scale, gate_up_wt)
    d_gate_up_proj = gemms.wgrad(d_gate_up, dequantize_rows(x_q, x_scale, gate_up.dtype))
    dx = ex.combine("out", dx_routed, pos, ids, local_experts, dy.dtype)
    d_weights = ex.combine(
        "d_row_weight", d_row_weight.view(-1, 1), pos.view(-1, 1), ids.view(-1, 1), local_experts, torch.float32
    )
    return dx, d_weights.view(num_tokens, top_k), d_gate_up_proj, d_down_proj
