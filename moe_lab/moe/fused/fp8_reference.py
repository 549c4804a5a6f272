"""The FP8 op's ``reference`` backend: what the ``gpu_deep_gemm`` backend computes, in plain PyTorch. Every operand
the GPU quantizes is quantized here with the same tiles and scales (``moe_lab.moe.fp8.quant``), dequantized, and
multiplied in fp32; each GEMM's output is rounded to the compute dtype as DeepGEMM's is. Dispatch and combine are
the bf16 reference backend's (``moe_lab.moe.fused.reference``)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moe_lab.moe.fp8.quant import FP8, dequantize_blocks, dequantize_rows, quantize_rows
from moe_lab.moe.fused.layout import routing_layout
from moe_lab.moe.fused.reference import _segments, gather_from_owners, scatter_to_owners


def _gemm_nt(a_q, a_scale, w_q, w_scale, j, dtype):
    """rows (quantized per 1x128) @ expert j's block-quantized w [N, K] transposed, in fp32, rounded to dtype."""
    w = dequantize_blocks(w_q[j : j + 1], w_scale[j : j + 1])[0]
    return (dequantize_rows(a_q, a_scale) @ w.T).to(dtype)


def forward(x, topk_ids, topk_weights, gate_up_w, down_w, local_experts, num_experts, group, align):
    num_tokens, top_k = topk_ids.shape
    layout = routing_layout(topk_ids, num_experts, align, group)
    pos, dest = layout.pos.reshape(-1), topk_ids.reshape(-1) // local_experts
    x_q, x_scale = quantize_rows(x)  # per token, before dispatch: the rows travel in FP8
    x_q = scatter_to_owners(x_q.view(torch.uint8).repeat_interleave(top_k, 0), pos, dest, layout.rows, group).view(FP8)
    x_scale = scatter_to_owners(x_scale.repeat_interleave(top_k, 0), pos, dest, layout.rows, group)
    row_weight = scatter_to_owners(topk_weights.reshape(-1, 1).float(), pos, dest, layout.rows, group).view(-1)
    rank = 0 if group is None else dist.get_rank(group)
    source = rank * num_tokens + torch.arange(num_tokens, device=x.device).repeat_interleave(top_k)
    row_src = scatter_to_owners(source.view(-1, 1) + 1, pos, dest, layout.rows, group).view(-1) - 1
    gate_up = x.new_zeros(layout.rows, gate_up_w[0].shape[1])
    out = x.new_zeros(layout.rows, x.shape[1])
    for j, (s, e) in enumerate(_segments(layout.offs)):
        gate_up[s:e] = _gemm_nt(x_q[s:e], x_scale[s:e], *gate_up_w, j, x.dtype)
        gate, up = gate_up[s:e].float().chunk(2, dim=-1)
        act_q, act_scale = quantize_rows(F.silu(gate) * up * row_weight[s:e, None])
        out[s:e] = _gemm_nt(act_q, act_scale, *down_w, j, x.dtype)
    y = gather_from_owners(out, pos, dest, group).view(num_tokens, top_k, -1).float().sum(1).to(x.dtype)
    return y, x_q, x_scale, gate_up, row_weight, row_src, layout.pos, layout.offs


def backward(
    dy, x_q, x_scale, gate_up, row_weight, row_src, pos, offs, topk_ids, gate_up_wt, down_wt, local_experts, group
):
    num_tokens, top_k = pos.shape
    dtype = gate_up.dtype
    flat_pos, dest = pos.reshape(-1), topk_ids.reshape(-1) // local_experts
    dy_routed = scatter_to_owners(dy.repeat_interleave(top_k, 0), flat_pos, dest, x_q.shape[0], group)
    dx_routed = torch.zeros_like(dy_routed)
    d_row_weight = torch.zeros_like(row_weight)
    lead = gate_up_wt[0].shape[0]
    d_gate_up_proj = dy.new_zeros(lead, gate_up_wt[0].shape[2], gate_up_wt[0].shape[1])
    d_down_proj = dy.new_zeros(lead, down_wt[0].shape[2], down_wt[0].shape[1])
    for j, (s, e) in enumerate(_segments(offs)):
        d_act_weighted = _gemm_nt(*quantize_rows(dy_routed[s:e]), *down_wt, j, dtype).float()
        gate, up = gate_up[s:e].float().chunk(2, dim=-1)
        sig = torch.sigmoid(gate)
        act = gate * sig * up
        w = row_weight[s:e, None]
        d_row_weight[s:e] = (d_act_weighted * act).sum(-1)
        d_act = d_act_weighted * w
        d_gate_up = torch.cat([d_act * up * sig * (1 + gate * (1 - sig)), d_act * gate * sig], dim=-1)
        dx_routed[s:e] = _gemm_nt(*quantize_rows(d_gate_up), *gate_up_wt, j, dtype)
        d_down_proj[j] = dy_routed[s:e].T @ (act * w).to(dtype)
        d_gate_up_proj[j] = d_gate_up.to(dtype).T @ dequantize_rows(x_q[s:e], x_scale[s:e]).to(dtype)
    dx = gather_from_owners(dx_routed, flat_pos, dest, group).view(num_tokens, top_k, -1).float().sum(1)
    d_weights = gather_from_owners(d_row_weight.unsqueeze(1), flat_pos, dest, group).view(num_tokens, top_k)
    return dx.to(dy.dtype), d_weights, d_gate_up_proj, d_down_proj
