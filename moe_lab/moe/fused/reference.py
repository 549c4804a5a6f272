"""The ``reference`` backend: the fused op's semantics in plain PyTorch, on CPU and GPU, over any process group.

Exchanges are all-to-alls with exact splits (each slot travels to its owner only; the split sizes go through the
host), and the experts run as a loop of per-expert matmuls: slow and obviously right, the oracle the ``gpu`` backend
is tested against. Its buffers are this rank's slots (T x K rows) on the sending side and the rows it receives on
the other, as the ``gpu`` backend's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moe_lab.moe.fused.layout import routing_layout
from moe_lab.moe.fused.ops import SAVES, kept_residuals


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


def _route_rows(x, pos, topk_ids, local_experts, rows, group):
    """Dispatch: this rank's tokens [T, H] -> its receive buffer [rows, H] (forward, and backward where forward kept
    no rows)."""
    dest = topk_ids.reshape(-1) // local_experts
    return scatter_to_owners(x.repeat_interleave(topk_ids.shape[1], 0), pos.reshape(-1), dest, rows, group)


def _gate_up(x_routed, offs, gate_up_proj):
    gate_up = x_routed.new_zeros(x_routed.shape[0], gate_up_proj.shape[1])
    for j, (s, e) in enumerate(_segments(offs)):
        gate_up[s:e] = x_routed[s:e] @ gate_up_proj[j].T
    return gate_up


def forward(x, topk_ids, topk_weights, gate_up_proj, down_proj, num_experts, group, align, backend, kept=SAVES["rows"]):
    num_tokens, top_k = topk_ids.shape
    layout = routing_layout(topk_ids, num_experts, align, group)
    pos = layout.pos.reshape(-1)
    dest = topk_ids.reshape(-1) // gate_up_proj.shape[0]
    x_routed = _route_rows(x, layout.pos, topk_ids, gate_up_proj.shape[0], layout.rows, group)
    row_weight = scatter_to_owners(topk_weights.reshape(-1, 1).float(), pos, dest, layout.rows, group).view(-1)
    rank = 0 if group is None else dist.get_rank(group)
    source = rank * num_tokens + torch.arange(num_tokens, device=x.device).repeat_interleave(top_k)
    row_src = scatter_to_owners(source.view(-1, 1) + 1, pos, dest, layout.rows, group).view(-1) - 1  # padding: 0 - 1
    gate_up = _gate_up(x_routed, layout.offs, gate_up_proj)
    out = x.new_zeros(layout.rows, x.shape[1])
    for j, (s, e) in enumerate(_segments(layout.offs)):
        gate, up = gate_up[s:e].float().chunk(2, dim=-1)
        act = F.silu(gate) * up * row_weight[s:e, None]
        out[s:e] = act.to(x.dtype) @ down_proj[j].T
    y = gather_from_owners(out, pos, dest, group).view(num_tokens, top_k, -1).float().sum(1).to(x.dtype)
    x_routed, gate_up = kept_residuals(kept, x_routed, gate_up)
    return y, x_routed, gate_up, row_weight, row_src, layout.pos, layout.offs


def backward(
    dy, x_routed, gate_up, row_weight, row_src, pos, offs, topk_ids, gate_up_proj, down_proj, group, backend, x=None
):
    del row_src  # the gpu backend's shortcut; this oracle routes dy from the slots, as forward routed x
    if x_routed.shape[0] == 0:  # forward kept its inputs only: dispatch again
        x_routed = _route_rows(x, pos, topk_ids, gate_up_proj.shape[0], row_weight.shape[0], group)
    if gate_up.shape[0] == 0:
        gate_up = _gate_up(x_routed, offs, gate_up_proj)
    num_tokens, top_k = pos.shape
    flat_pos = pos.reshape(-1)
    dest = topk_ids.reshape(-1) // gate_up_proj.shape[0]
    dy_routed = scatter_to_owners(dy.repeat_interleave(top_k, 0), flat_pos, dest, x_routed.shape[0], group)
    dx_routed = torch.zeros_like(x_routed)
    d_row_weight = torch.zeros_like(row_weight)
    d_gate_up_proj, d_down_proj = torch.zeros_like(gate_up_proj), torch.zeros_like(down_proj)
    for j, (s, e) in enumerate(_segments(offs)):
        d_act_weighted = (dy_routed[s:e] @ down_proj[j]).float()
        gate, up = gate_up[s:e].float().chunk(2, dim=-1)
        sig = torch.sigmoid(gate)
        act = gate * sig * up
        w = row_weight[s:e, None]
        d_row_weight[s:e] = (d_act_weighted * act).sum(-1)
        d_act = d_act_weighted * w
        d_gate = d_act * up * sig * (1 + gate * (1 - sig))
        d_gate_up = torch.cat([d_gate, d_act * gate * sig], dim=-1).to(x_routed.dtype)
        d_down_proj[j] = dy_routed[s:e].T @ (act * w).to(x_routed.dtype)
        dx_routed[s:e] = d_gate_up @ gate_up_proj[j]
        d_gate_up_proj[j] = d_gate_up.T @ x_routed[s:e]
    dx = gather_from_owners(dx_routed, flat_pos, dest, group).view(num_tokens, top_k, -1).float().sum(1)
    d_weights = gather_from_owners(d_row_weight.unsqueeze(1), flat_pos, dest, group).view(num_tokens, top_k)
    return dx.to(dy.dtype), d_weights, d_gate_up_proj, d_down_proj
