"""The ``reference`` backend: the fused op's semantics in plain PyTorch, on CPU and GPU, over any process group.

Exchanges are all-to-alls with exact splits (each slot travels to its owner only; the split sizes go through the
host), and the experts run as a loop of per-expert matmuls: slow and obviously right, the oracle the ``gpu`` backend
is tested against. Its buffers are this rank's slots (T x K rows) on the sending side and the rows it receives on
the other, as the ``gpu`` backend's.

The precision seam (``Bf16``, ``Fp8``) holds what the experts' precision changes: the rows before dispatch, each
expert's GEMMs and its weight gradients (bf16, or FP8 at ``wgrad_precision`` fp8). ``Fp8`` computes what the gpu
backend's FP8 path computes: every operand the GPU quantizes is quantized here with the same tiles and scales
(``moe_lab.moe.fp8.quant``), dequantized and multiplied in fp32, each GEMM's output rounded to the compute dtype as DeepGEMM's is.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moe_lab.moe.fp8 import quant
from moe_lab.moe.fp8.grouped import emulated_nt, emulated_weight_gradient
from moe_lab.moe.fused.layout import routing_layout
from moe_lab.moe.fused.ops import Backend, kept_residuals, register_backend


def _exchange(send, send_counts, group):
    """All-to-all of ``send``'s rows, ``send_counts[r]`` consecutive rows to rank r. -> (received rows in source rank
    order, rows received from each rank)."""
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    recv_counts = recv_counts.tolist()
    recv = send.new_empty(sum(recv_counts), *send.shape[1:])
    dist.all_to_all_single(recv, send.contiguous(), recv_counts, send_counts.tolist(), group=group)
    return recv, recv_counts


def _by_owner(dest, group):
    """This rank's slots ordered by owner, and how many go to each."""
    return torch.argsort(dest, stable=True), torch.bincount(dest, minlength=dist.get_world_size(group))


def scatter_to_owners(rows, pos, dest, num_rows, group):
    """rows [S, D] of this rank's slots -> [num_rows, D] receive buffer of this rank: buf[pos] = row on the owner."""
    buf = rows.new_zeros(num_rows, rows.shape[1])
    if group is None:
        buf[pos] = rows
        return buf
    order, counts = _by_owner(dest, group)
    recv_rows, _ = _exchange(rows[order], counts, group)
    recv_pos, _ = _exchange(pos[order], counts, group)
    buf[recv_pos] = recv_rows
    return buf


def gather_from_owners(buf, pos, dest, group):
    """The reverse: row pos of the owner's buffer for each of this rank's slots -> [S, D]."""
    if group is None:
        return buf[pos]
    order, counts = _by_owner(dest, group)
    asked, asked_counts = _exchange(pos[order], counts, group)
    answers = buf.new_empty(dest.numel(), buf.shape[1])
    dist.all_to_all_single(answers, buf[asked], counts.tolist(), asked_counts, group=group)
    out = torch.empty_like(answers)
    out[order] = answers
    return out


def _segments(offs):
    bounds = [0] + offs.tolist()
    return list(zip(bounds[:-1], bounds[1:]))


# --- the precision seam --------------------------------------------------------------------------------------------


class Bf16:
    """The experts in the compute dtype: rows and stacks as they are."""

    def __init__(self, gate_up_proj, down_proj, weights, wgrad_precision="bf16"):
        self.gate_up_proj, self.down_proj = gate_up_proj, down_proj

    def rows(self, x):
        """This rank's tokens as they travel: (values, scales), the scales 0 wide."""
        return x, x.new_empty(x.shape[0], 0, dtype=torch.float32)

    def gate_up(self, rows, j, dtype):
        """Expert j's received rows -> its gate/up pre-activations."""
        return rows[0] @ self.gate_up_proj[j].T

    def down(self, act, j, dtype):
        """The weighted SwiGLU output (fp32) -> expert j's output rows."""
        return act.to(dtype) @ self.down_proj[j].T

    def down_input_grad(self, dy, j, dtype):
        return dy @ self.down_proj[j]

    def gate_up_input_grad(self, d_gate_up, j, dtype):
        """The gate/up gradient (fp32) -> the received rows' gradient."""
        return d_gate_up.to(dtype) @ self.gate_up_proj[j]

    def wgrad_rows(self, rows, dtype):
        """The received rows as the gate/up weight gradient reads them."""
        return rows[0]

    def weight_gradients(self, dy, act_weighted, d_gate_up, rows, dtype):
        """Expert j's (d_gate_up_proj[j], d_down_proj[j]) from its rows' output gradient, weighted activation and
        gate/up gradient (both fp32) and received rows."""
        return d_gate_up.to(dtype).T @ self.wgrad_rows(rows, dtype), dy.T @ act_weighted.to(dtype)


class Fp8(Bf16):
    """The experts in blockwise FP8, emulated: x quantized per token before dispatch, each GEMM's other operand where
    it is made; ``weights``: the stacks' FP8 copies (forward) and their transposes' (input gradients);
    ``wgrad_precision``: the weight gradients' (bf16, or fp8 as the gpu backend's DeepGEMM k-grouped kernel)."""

    def __init__(self, gate_up_proj, down_proj, weights, wgrad_precision="bf16"):
        self.gate_up_w, self.gate_up_wt = weights[0:2], weights[2:4]
        self.down_w, self.down_wt = weights[4:6], weights[6:8]
        self.fp8_wgrad = wgrad_precision == "fp8"

    def rows(self, x):
        return quant.quantize_rows(x)

    def gate_up(self, rows, j, dtype):
        return emulated_nt(*rows, self.gate_up_w, j, dtype)

    def down(self, act, j, dtype):
        return emulated_nt(*quant.quantize_rows(act), self.down_w, j, dtype)

    def down_input_grad(self, dy, j, dtype):
        return emulated_nt(*quant.quantize_rows(dy), self.down_wt, j, dtype)

    def gate_up_input_grad(self, d_gate_up, j, dtype):
        return emulated_nt(*quant.quantize_rows(d_gate_up), self.gate_up_wt, j, dtype)

    def wgrad_rows(self, rows, dtype):
        return quant.dequantize_rows(*rows).to(dtype)

    def weight_gradients(self, dy, act_weighted, d_gate_up, rows, dtype):
        """FP8 at wgrad_precision fp8: every operand in the compute dtype (the rows dequantized), quantized per 128
        rows of each column, multiplied in fp32; else bf16's."""
        if not self.fp8_wgrad:
            return super().weight_gradients(dy, act_weighted, d_gate_up, rows, dtype)
        return (
            emulated_weight_gradient(d_gate_up.to(dtype), quant.dequantize_rows(*rows)),
            emulated_weight_gradient(dy, act_weighted.to(dtype)),
        )


PRECISIONS = {"bf16": Bf16, "fp8": Fp8}


# --- the op --------------------------------------------------------------------------------------------------------


def _as_bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t  # the exchanges move FP8 as bytes


def _route_rows(rows, pos, topk_ids, local_experts, num_rows, group):
    """Dispatch: this rank's tokens as they travel (values, scales) [T, *] -> its receive buffer [num_rows, *]
    (forward, and backward where forward kept no rows)."""
    dest = topk_ids.reshape(-1) // local_experts

    def route(t):
        if t.shape[1] == 0:
            return t.new_empty(num_rows, 0)
        sent = _as_bits(t).repeat_interleave(topk_ids.shape[1], 0)
        return scatter_to_owners(sent, pos.reshape(-1), dest, num_rows, group).view(t.dtype)

    return tuple(route(t) for t in rows)


def _gate_up(p, rows, offs, width, dtype):
    gate_up = rows[0].new_zeros(rows[0].shape[0], width, dtype=dtype)
    for j, (s, e) in enumerate(_segments(offs)):
        gate_up[s:e] = p.gate_up((rows[0][s:e], rows[1][s:e]), j, dtype)
    return gate_up


def forward(x, topk_ids, topk_weights, gate_up_proj, down_proj, weights, num_experts, group, kept, precision):
    p = PRECISIONS[precision](gate_up_proj, down_proj, weights)
    num_tokens, top_k = topk_ids.shape
    local_experts = gate_up_proj.shape[0]
    layout = routing_layout(topk_ids, num_experts, ALIGN, group)
    pos = layout.pos.reshape(-1)
    dest = topk_ids.reshape(-1) // local_experts
    rows = _route_rows(p.rows(x), layout.pos, topk_ids, local_experts, layout.rows, group)
    row_weight = scatter_to_owners(topk_weights.reshape(-1, 1).float(), pos, dest, layout.rows, group).view(-1)
    rank = 0 if group is None else dist.get_rank(group)
    source = rank * num_tokens + torch.arange(num_tokens, device=x.device).repeat_interleave(top_k)
    row_src = scatter_to_owners(source.view(-1, 1) + 1, pos, dest, layout.rows, group).view(-1) - 1  # padding: 0 - 1
    gate_up = _gate_up(p, rows, layout.offs, gate_up_proj.shape[1], x.dtype)
    out = x.new_zeros(layout.rows, x.shape[1])
    for j, (s, e) in enumerate(_segments(layout.offs)):
        gate, up = gate_up[s:e].float().chunk(2, dim=-1)
        out[s:e] = p.down(F.silu(gate) * up * row_weight[s:e, None], j, x.dtype)
    y = gather_from_owners(out, pos, dest, group).view(num_tokens, top_k, -1).float().sum(1).to(x.dtype)
    return (y, *kept_residuals(kept, rows, gate_up), row_weight, row_src, layout.pos, layout.offs)


def backward(
    dy, residuals, topk_ids, gate_up_proj, down_proj, weights, group, precision, x=None, wgrad_precision="bf16"
):
    # row_src: the gpu backend's shortcut; this oracle routes dy from the slots, as forward routed x
    rows, row_scales, gate_up, row_weight, _, pos, offs = residuals
    p = PRECISIONS[precision](gate_up_proj, down_proj, weights, wgrad_precision)
    dtype, local_experts, num_rows = dy.dtype, gate_up_proj.shape[0], row_weight.shape[0]
    rows = (rows, row_scales)
    if rows[0].shape[0] == 0:  # forward kept its inputs only: dispatch again
        rows = _route_rows(p.rows(x), pos, topk_ids, local_experts, num_rows, group)
    if gate_up.shape[0] == 0:
        gate_up = _gate_up(p, rows, offs, gate_up_proj.shape[1], dtype)
    num_tokens, top_k = pos.shape
    flat_pos = pos.reshape(-1)
    dest = topk_ids.reshape(-1) // local_experts
    dy_routed = scatter_to_owners(dy.repeat_interleave(top_k, 0), flat_pos, dest, num_rows, group)
    dx_routed = torch.zeros_like(dy_routed)
    d_row_weight = torch.zeros_like(row_weight)
    d_gate_up_proj = dy.new_zeros(gate_up_proj.shape)
    d_down_proj = dy.new_zeros(down_proj.shape)
    for j, (s, e) in enumerate(_segments(offs)):
        d_act_weighted = p.down_input_grad(dy_routed[s:e], j, dtype).float()
        gate, up = gate_up[s:e].float().chunk(2, dim=-1)
        sig = torch.sigmoid(gate)
        act = gate * sig * up
        w = row_weight[s:e, None]
        d_row_weight[s:e] = (d_act_weighted * act).sum(-1)
        d_act = d_act_weighted * w
        d_gate_up = torch.cat([d_act * up * sig * (1 + gate * (1 - sig)), d_act * gate * sig], dim=-1)
        dx_routed[s:e] = p.gate_up_input_grad(d_gate_up, j, dtype)
        d_gate_up_proj[j], d_down_proj[j] = p.weight_gradients(
            dy_routed[s:e], act * w, d_gate_up, (rows[0][s:e], rows[1][s:e]), dtype
        )
    dx = gather_from_owners(dx_routed, flat_pos, dest, group).view(num_tokens, top_k, -1).float().sum(1)
    d_weights = gather_from_owners(d_row_weight.unsqueeze(1), flat_pos, dest, group).view(num_tokens, top_k)
    return dx.to(dy.dtype), d_weights, d_gate_up_proj, d_down_proj


ALIGN = 1  # no grouped GEMM: segments start anywhere
register_backend("reference", Backend(forward, backward, ALIGN))
