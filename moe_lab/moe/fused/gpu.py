"""The ``gpu`` backend: Triton dispatch / SwiGLU / combine kernels around grouped GEMMs, with no host sync.

Forward, per rank: the routing layout (counts gathered device to device at EP > 1); each slot tells its owner
where it comes from (``push_slots``: a few bytes per slot, written straight into the owner's buffer); the owner pulls
each routed row into its expert-contiguous, GEMM-aligned receive buffer (``gather_rows``); gate/up GEMM; SwiGLU with
the routing weight folded in; down GEMM; each token sums its K rows from wherever they were computed (``combine``).
Backward mirrors it: dy is pulled like x, dx and the routing-weight gradients are gathered like y.

At EP > 1 the buffers that peers read or write are torch symmetric memory (CUDA backend, NVLink peer access;
multicast stays off), allocated once per shape; device-side barriers order the phases.
``gpu_deep_gemm`` runs the forward and input-gradient GEMMs with DeepGEMM's m-grouped contiguous bf16 kernels;
weight gradients always use ``torch._grouped_mm`` (DeepGEMM's k-grouped kernel takes its group sizes on the host).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton

from moe_lab.moe.fused import kernels
from moe_lab.moe.fused.layout import routing_layout

ROW_BLOCK = 1024  # columns per program of the row kernels
SLOT_BLOCK = 1024
IDLE_PROGRAMS_PER_EXPERT = 16


# --- grouped GEMMs -------------------------------------------------------------------------------------------------


class _Gemms:
    def __init__(self, backend: str, offs: torch.Tensor, row_src: torch.Tensor):
        self.offs = offs
        self.deep = backend == "gpu_deep_gemm"
        if self.deep:
            import deep_gemm

            self.dg = deep_gemm
            rows = torch.arange(row_src.numel(), device=offs.device, dtype=torch.int32)
            expert = torch.searchsorted(offs, rows, right=True).to(torch.int32)
            self.m_indices = torch.where(row_src >= 0, expert, -1).to(torch.int32)

    def nt(self, a, w):
        """a [C, K] @ w[e].T for w [L, N, K]: the forward projections, weights as stored."""
        if self.deep:
            out = a.new_empty(a.shape[0], w.shape[1])
            self.dg.m_grouped_bf16_gemm_nt_contiguous(a, w, out, self.m_indices)
            return out
        return torch._grouped_mm(a, w.transpose(-2, -1), offs=self.offs)

    def nn(self, a, w):
        """a [C, N] @ w[e] for w [L, N, K]: the input gradients."""
        if self.deep:
            out = a.new_empty(a.shape[0], w.shape[2])
            self.dg.m_grouped_bf16_gemm_nn_contiguous(a, w, out, self.m_indices)
            return out
        return torch._grouped_mm(a, w, offs=self.offs)

    def wgrad(self, grad, inp):
        """sum over each expert's rows of grad^T inp -> [L, N, K] (k-grouped)."""
        out = torch._grouped_mm(grad.t(), inp, offs=self.offs)
        slab = out[0].numel()
        per_program = triton.cdiv(slab, IDLE_PROGRAMS_PER_EXPERT)
        kernels.zero_idle_experts_kernel[(out.shape[0], IDLE_PROGRAMS_PER_EXPERT)](
            out, self.offs, SLAB=slab, PER_PROGRAM=per_program, BLOCK=ROW_BLOCK
        )
        return out


# --- exchange ------------------------------------------------------------------------------------------------------


class _Exchange:
    """Where rows live. EP=1: local tensors. EP>1: symmetric-memory buffers, one per (name, shape, dtype)."""

    _buffers: dict = {}

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device):
        self.group, self.device = group, device
        self.peer = group is not None
        self.rank = dist.get_rank(group) if self.peer else 0
        if self.peer:
            self._sync = self.buffer("sync", (1,), torch.int32)

    def buffer(self, name, shape, dtype):
        """-> (local tensor, device tensor of every rank's buffer address)."""
        import torch.distributed._symmetric_memory as symm_mem

        key = (name, tuple(shape), dtype, self.device, self.group.group_name)
        if key not in self._buffers:
            local = symm_mem.empty(shape, dtype=dtype, device=self.device)
            handle = symm_mem.rendezvous(local, self.group.group_name)
            ptrs = torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=self.device)
            self._buffers[key] = (local, ptrs, handle)
        return self._buffers[key][:2]

    def barrier(self):
        self._buffers[("sync", (1,), torch.int32, self.device, self.group.group_name)][2].barrier(channel=0)

    def publish(self, name, tensor):
        """Make a local tensor readable by peers: (local, peer pointers); at EP=1 the tensor itself."""
        if not self.peer:
            return tensor, tensor
        local, ptrs = self.buffer(name, tensor.shape, tensor.dtype)
        local.copy_(tensor)
        return local, ptrs

    def route(self, pos, dest, weights, capacity, num_tokens):
        """Each slot writes (source rank, token) and its weight into its owner's row. -> row_src, row_weight."""
        top_k = pos.shape[1]
        with_weight = weights is not None
        if self.peer:
            row_src, src_ptrs = self.buffer("row_src", (capacity,), torch.int64)
            row_weight, weight_ptrs = self.buffer("row_weight", (capacity,), torch.float32)
            row_src.fill_(-1)
            row_weight.zero_()
            self.barrier()  # every owner has cleared its rows before anyone writes into them
        else:
            row_src = torch.full((capacity,), -1, dtype=torch.int64, device=self.device)
            row_weight = torch.zeros(capacity, dtype=torch.float32, device=self.device)
            src_ptrs = weight_ptrs = row_src
        num_slots = pos.numel()
        kernels.push_slots_kernel[(triton.cdiv(num_slots, SLOT_BLOCK),)](
            row_src, src_ptrs, row_weight, weight_ptrs, pos, dest, weights if with_weight else pos,
            num_slots, top_k, num_tokens, self.rank, PEER=self.peer, WITH_WEIGHT=with_weight, BLOCK=SLOT_BLOCK,
        )
        if self.peer:
            self.barrier()  # all slots have arrived
            return row_src.clone(), row_weight.clone()
        return row_src, row_weight

    def gather_rows(self, name, src, row_src, offs, capacity):
        """Dispatch: the receive buffer [capacity, D], pulled row by row from the sources' ``src`` [T, D]."""
        local, ptrs = self.publish(name, src)
        if self.peer:
            self.barrier()
        out = src.new_empty(capacity, src.shape[1])
        grid = (capacity, triton.cdiv(src.shape[1], ROW_BLOCK))
        kernels.gather_rows_kernel[grid](
            out, local, ptrs, row_src, offs, offs.numel(), src.shape[0], src.shape[1], PEER=self.peer, BLOCK=ROW_BLOCK
        )
        return out

    def combine(self, name, buf, pos, dest, out_dtype):
        """Gather-sum by slot group: out[i] = sum_j buf_{dest[i, j]}[pos[i, j]] for pos [N, J]."""
        local, ptrs = self.publish(name, buf)
        if self.peer:
            self.barrier()
        out = torch.empty(pos.shape[0], buf.shape[1], dtype=out_dtype, device=buf.device)
        grid = (pos.shape[0], triton.cdiv(buf.shape[1], ROW_BLOCK))
        kernels.combine_kernel[grid](
            out, local, ptrs, pos, dest, buf.shape[1], TOP_K=pos.shape[1], PEER=self.peer, BLOCK=ROW_BLOCK
        )
        if self.peer:
            self.barrier()  # peers are done reading this rank's buffer before anyone reuses it
        return out


# --- the op --------------------------------------------------------------------------------------------------------


def _swiglu_block(inter: int) -> int:
    return min(ROW_BLOCK, triton.next_power_of_2(inter))


def forward(x, topk_ids, topk_weights, gate_up_proj, down_proj, num_experts, group, capacity, align, backend):
    num_tokens, top_k = topk_ids.shape
    inter = down_proj.shape[2]
    layout = routing_layout(topk_ids, num_experts, align, group)
    dest = (topk_ids // gate_up_proj.shape[0]).to(torch.int32)
    ex = _Exchange(group, x.device)
    row_src, row_weight = ex.route(layout.pos, dest, topk_weights.contiguous(), capacity, num_tokens)
    gemms = _Gemms(backend, layout.offs, row_src)
    x_routed = ex.gather_rows("x", x.contiguous(), row_src, layout.offs, capacity)
    gate_up = gemms.nt(x_routed, gate_up_proj)
    act = x.new_empty(capacity, inter)
    block = _swiglu_block(inter)
    kernels.swiglu_forward_kernel[(capacity, triton.cdiv(inter, block))](
        act, gate_up, row_weight, row_src, layout.offs, layout.offs.numel(), inter, BLOCK=block
    )
    out = gemms.nt(act, down_proj)
    y = ex.combine("out", out, layout.pos, dest, x.dtype)
    return y, x_routed, gate_up, row_weight, layout.pos, layout.offs


def backward(dy, x_routed, gate_up, row_weight, pos, offs, topk_ids, gate_up_proj, down_proj, group, backend):
    num_tokens, top_k = pos.shape
    capacity, inter = gate_up.shape[0], down_proj.shape[2]
    dest = (topk_ids // gate_up_proj.shape[0]).to(torch.int32)
    ex = _Exchange(group, dy.device)
    row_src, _ = ex.route(pos, dest, None, capacity, num_tokens)
    gemms = _Gemms(backend, offs, row_src)
    dy_routed = ex.gather_rows("dy", dy, row_src, offs, capacity)
    d_act_weighted = gemms.nn(dy_routed, down_proj)
    d_gate_up = torch.empty_like(gate_up)
    act_weighted = torch.empty_like(d_act_weighted)
    d_row_weight = torch.empty_like(row_weight)
    kernels.swiglu_backward_kernel[(capacity,)](
        d_gate_up, act_weighted, d_row_weight, gate_up, d_act_weighted, row_weight, row_src, offs, offs.numel(),
        INTER=inter, BLOCK=_swiglu_block(inter),
    )
    d_down_proj = gemms.wgrad(dy_routed, act_weighted)
    dx_routed = gemms.nn(d_gate_up, gate_up_proj)
    d_gate_up_proj = gemms.wgrad(d_gate_up, x_routed)
    dx = ex.combine("dx", dx_routed, pos, dest, dy.dtype)
    d_weights = ex.combine("d_row_weight", d_row_weight.view(-1, 1), pos.view(-1, 1), dest.view(-1, 1), torch.float32)
    return dx, d_weights.view(num_tokens, top_k), d_gate_up_proj, d_down_proj
