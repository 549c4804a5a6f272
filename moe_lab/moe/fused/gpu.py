"""The ``gpu`` backend: Triton dispatch / SwiGLU / combine kernels around grouped GEMMs, with one host sync per
forward (the receive-buffer sizes, ``moe_lab.moe.fused.layout``) and none in backward but FP8 weight gradients'
segment sizes (``wgrad_precision`` fp8, see ``Fp8``).

Forward, per rank: the routing layout (counts gathered device to device at EP > 1, sizes copied to the host); each slot tells its owner
where it comes from (``push_slots``: a few bytes per slot, written straight into the owner's buffer); the owner pulls
each routed row into its expert-contiguous, GEMM-aligned receive buffer (``gather_rows``); gate/up GEMM; SwiGLU with
the routing weight folded in; down GEMM; each token sums its K rows from wherever they were computed (``combine``).
Backward mirrors it from forward's saved ``row_src`` (no second slot exchange): dy is pulled like x, dx and the
routing-weight gradients are gathered like y.

Every receive-side buffer (the routed rows, gate/up, the activations, the GEMM outputs, what is saved for backward)
holds exactly this rank's received rows plus per-expert alignment. At EP > 1 the buffers that peers read or write
are torch symmetric memory (CUDA backend, NVLink peer access; multicast stays off), reused across calls (see
``_Exchange``); device-side barriers order the phases.
``gpu_deep_gemm`` runs the forward and input-gradient GEMMs with DeepGEMM's m-grouped contiguous bf16 kernels;
bf16 weight gradients always use ``torch._grouped_mm``.

The precision seam (``Bf16``, ``Fp8``) holds what the experts' precision changes: the rows dispatch moves (FP8:
quantized per token before, so they travel and are kept in e4m3 with their scales), the grouped GEMMs (FP8:
DeepGEMM's m-grouped FP8 kernel, ``moe_lab.moe.fp8.grouped``), the SwiGLU kernels (FP8: they quantize what they
make, ``moe_lab.moe.fp8.kernels``) and the weight gradients (``weight_gradients``: at FP8 with ``wgrad_precision``
fp8, DeepGEMM's k-grouped FP8 kernel, its segment sizes copied to the host asynchronously at backward's start and
waited for at its weight gradients; else bf16 grouped GEMMs, on the FP8 rows dequantized). Forward and backward are written once over it. No host sync beyond the
layout's one per forward at either precision.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import triton

from moe_lab.moe.fp8 import grouped
from moe_lab.moe.fp8 import kernels as fp8_kernels
from moe_lab.moe.fp8.quant import FP8, TILE
from moe_lab.moe.fused import kernels
from moe_lab.moe.fused.layout import Layout, gather_counts, receive_rows, workspace_rows
from moe_lab.moe.fused.ops import Backend, kept_residuals, register_backend

ROW_BLOCK = 1024  # columns per program of the row kernels
SLOT_BLOCK = 1024
LAYOUT_BLOCK = 128  # slots (rows) per program of the layout kernels: each holds a [128, experts] or [128, 128] tile
IDLE_PROGRAMS_PER_EXPERT = 16


def kernel_layout(topk_ids, num_experts: int, align: int, group: dist.ProcessGroup | None) -> Layout:
    """``moe_lab.moe.fused.layout.routing_layout`` in two kernels and a cumsum instead of a sort and some thirty
    small ops: the host spends less time before the layer's sync (the GPU waits through it)."""
    rank = 0 if group is None else dist.get_rank(group)
    block_counts, block_cum = slot_counts(topk_ids, num_experts)
    all_counts = gather_counts(block_cum[:, -1].contiguous(), group)
    return layout_from_block_counts(topk_ids, block_counts, block_cum, all_counts, rank, align)


def slot_counts(topk_ids, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> each block of ``LAYOUT_BLOCK`` slots' count per expert [E, B], and its inclusive prefix over blocks (its
    last column: this rank's count per expert)."""
    flat = topk_ids.reshape(-1).contiguous()
    blocks = max(triton.cdiv(flat.numel(), LAYOUT_BLOCK), 1)  # one program at least: program 0 writes seg_end
    block_counts = torch.empty(num_experts, blocks, dtype=torch.int64, device=flat.device)
    kernels.block_expert_counts_kernel[(blocks,)](
        flat, block_counts, flat.numel(), num_experts, triton.next_power_of_2(num_experts), BLOCK=LAYOUT_BLOCK
    )
    return block_counts, block_counts.cumsum(1)


def layout_from_block_counts(topk_ids, block_counts, block_cum, all_counts, rank: int, align: int) -> Layout:
    """``moe_lab.moe.fused.layout.layout_from_counts`` from ``slot_counts``'s blocks: each slot's row in one kernel."""
    ep, num_experts = all_counts.shape
    flat = topk_ids.reshape(-1).contiguous()
    pos = torch.empty_like(flat)
    seg_end = torch.empty(ep, num_experts // ep, dtype=torch.int32, device=flat.device)
    kernels.slot_positions_kernel[(block_counts.shape[1],)](
        flat,
        block_cum,
        block_counts,
        all_counts,
        pos,
        seg_end,
        flat.numel(),
        rank,
        align,
        ep,
        num_experts,
        num_experts // ep,
        triton.next_power_of_2(ep),
        triton.next_power_of_2(num_experts),
        BLOCK=LAYOUT_BLOCK,
        num_warps=16,  # its [128, 128] tiles fit in registers without spilling (ptxas, sm_90)
    )
    return Layout(pos.view(topk_ids.shape), seg_end[rank], *receive_rows(seg_end, rank, align))


# --- grouped GEMMs -------------------------------------------------------------------------------------------------


def row_experts(offs: torch.Tensor, row_src: torch.Tensor) -> torch.Tensor:
    """DeepGEMM's row map [R] int32: each receive-buffer row's local expert, -1 for padding."""
    rows, local = row_src.numel(), offs.numel()
    m_indices = torch.empty(rows, dtype=torch.int32, device=offs.device)
    kernels.row_experts_kernel[(triton.cdiv(rows, LAYOUT_BLOCK),)](
        m_indices, offs, row_src, rows, local, triton.next_power_of_2(local), BLOCK=LAYOUT_BLOCK
    )
    return m_indices


class _Gemms:
    """The bf16 grouped GEMMs over the receive buffer's expert segments: DeepGEMM's (``deep``) or torch's."""

    def __init__(self, deep: bool, offs: torch.Tensor, row_src: torch.Tensor):
        self.offs = offs
        self.deep = deep
        if self.deep:
            self.m_indices = row_experts(offs, row_src)

    def nt(self, a, w):
        """a [C, K] @ w[e].T for w [L, N, K]: the forward projections, weights as stored."""
        if self.deep:
            import deep_gemm

            out = a.new_empty(a.shape[0], w.shape[1])
            deep_gemm.m_grouped_bf16_gemm_nt_contiguous(a, w, out, self.m_indices)
            return out
        return torch._grouped_mm(a, w.transpose(-2, -1), offs=self.offs)

    def nn(self, a, w):
        """a [C, N] @ w[e] for w [L, N, K]: the input gradients."""
        if self.deep:
            import deep_gemm

            out = a.new_empty(a.shape[0], w.shape[2])
            deep_gemm.m_grouped_bf16_gemm_nn_contiguous(a, w, out, self.m_indices)
            return out
        return torch._grouped_mm(a, w, offs=self.offs)

    def wgrad(self, grad, inp):
        """sum over each expert's rows of grad^T inp -> [L, N, K] (k-grouped; an expert without rows zero)."""
        out = torch._grouped_mm(grad.t(), inp, offs=self.offs)
        slab = out[0].numel()
        per_program = triton.cdiv(slab, IDLE_PROGRAMS_PER_EXPERT)
        kernels.zero_idle_experts_kernel[(out.shape[0], IDLE_PROGRAMS_PER_EXPERT)](
            out, self.offs, SLAB=slab, PER_PROGRAM=per_program, BLOCK=ROW_BLOCK
        )
        return out


# --- exchange ------------------------------------------------------------------------------------------------------


def symmetric_empty(shape, dtype, device, group):
    """A torch symmetric-memory buffer -> (this rank's tensor, every rank's buffer address as an int64 tensor on
    ``device``, the group's device-side barrier). Collective: every rank allocates the same shape in the same order.
    tests/test_fused_kernels.py swaps in shared file mappings to run the peer paths on CPU. A group that lends its
    own (``group.symmetric_empty``, the emulated group's loopback: every peer's buffer is this rank's) gives it."""
    lent = getattr(group, "symmetric_empty", None)
    if lent is not None:
        return lent(shape, dtype, device)
    import torch.distributed._symmetric_memory as symm_mem

    local = symm_mem.empty(shape, dtype=dtype, device=device)
    handle = symm_mem.rendezvous(local, group.group_name)
    ptrs = torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=device)
    return local, ptrs, functools.partial(handle.barrier, channel=0)


class _Exchange:
    """Where rows live. EP=1: local tensors. EP>1: symmetric-memory buffers that peers read or write, of two kinds.

    Sized by this rank's tokens (``x``, ``dy`` [T, H]): one per shape. Receive side (``row_src``, ``row_weight``,
    ``d_row_weight`` [P], ``out`` [P, H]: the expert outputs in forward, the input gradients in backward, never live at
    once): P rows shared by every layer, each call using its first ``rows``. P is the largest receive buffer over the
    group rounded up the 1.25x ladder (``workspace_rows``); it only grows, and only in forward right after the
    layout's host sync (``reserve``), so every rank allocates the same sizes in the same order, backward never
    allocates, and freeing the smaller buffers cannot pull memory from under a peer: that sync waited for the count
    all-gather, which no peer finishes before its stream has run every earlier kernel that touched this rank's buffers.
    """

    _buffers: dict = {}  # key -> (local tensor, peer pointers, barrier)
    _workspace_rows: dict = {}  # (device, group name) -> P

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device):
        self.group, self.device = group, device
        self.peer = group is not None
        self.rank = dist.get_rank(group) if self.peer else 0
        if self.peer:
            self.place = (self.device, self.group.group_name)
            self.barrier = self._symmetric(("sync", (1,), torch.int32), (1,), torch.int32)[2]

    def _symmetric(self, key, shape, dtype):
        """The buffer of ``key`` (+ this device and group), allocated with ``shape`` and ``dtype`` on first use."""
        key = (*key, *self.place)
        if key not in self._buffers:
            self._buffers[key] = symmetric_empty(shape, dtype, self.device, self.group)
        return self._buffers[key]

    def buffer(self, name, shape, dtype):
        """A buffer sized by this rank's tokens -> (local tensor, device tensor of every rank's buffer address)."""
        return self._symmetric((name, tuple(shape), dtype), shape, dtype)[:2]

    def reserve(self, max_rows: int, width: int, dtype: torch.dtype):
        """Forward, after the layout's host sync (every rank passes the same values): the receive-side buffers hold
        at least ``max_rows`` rows."""
        if not self.peer:
            return
        held = self._workspace_rows.get(self.place, 0)
        if max_rows > held:
            held = self._workspace_rows[self.place] = workspace_rows(max_rows)
            for key in [k for k in self._buffers if k[0] == "workspace" and k[-2:] == self.place]:
                del self._buffers[key]  # before allocating the larger one: the two never coexist
                _, _, row_shape, row_dtype = key[:-2]
                self._symmetric(key[:-2], (held, *row_shape), row_dtype)
        for name, row_shape, row_dtype in (
            ("row_src", (), torch.int64),
            ("row_weight", (), torch.float32),
            ("d_row_weight", (1,), torch.float32),
            ("out", (width,), dtype),
        ):
            self._symmetric(("workspace", name, row_shape, row_dtype), (held, *row_shape), row_dtype)

    def workspace(self, name, rows, row_shape, dtype):
        """The first ``rows`` of a receive-side buffer -> (local view, peer pointers)."""
        local, ptrs, _ = self._buffers[("workspace", name, tuple(row_shape), dtype, *self.place)]
        if rows > local.shape[0]:
            raise RuntimeError(f"fused MoE: {rows} received rows overflow the {local.shape[0]}-row {name} buffer")
        return local[:rows], ptrs

    def publish(self, name, tensor):
        """Make a local tensor readable by peers: (local, peer pointers); at EP=1 the tensor itself."""
        if not self.peer:
            return tensor, tensor
        local, ptrs = self.buffer(name, tensor.shape, tensor.dtype)
        local.copy_(tensor)
        return local, ptrs

    def route(self, pos, ids, local_experts, weights, rows, num_tokens):
        """Each slot writes (source rank, token) and its weight into its owner's row. -> row_src, row_weight."""
        top_k = pos.shape[1]
        if self.peer:
            row_src, src_ptrs = self.workspace("row_src", rows, (), torch.int64)
            row_weight, weight_ptrs = self.workspace("row_weight", rows, (), torch.float32)
            row_src.fill_(-1)
            row_weight.zero_()
            self.barrier()  # every owner has cleared its rows before anyone writes into them
        else:
            row_src = torch.full((rows,), -1, dtype=torch.int64, device=self.device)
            row_weight = torch.zeros(rows, dtype=torch.float32, device=self.device)
            src_ptrs = weight_ptrs = row_src
        num_slots = pos.numel()
        kernels.push_slots_kernel[(triton.cdiv(num_slots, SLOT_BLOCK),)](
            row_src,
            src_ptrs,
            row_weight,
            weight_ptrs,
            pos,
            ids,
            weights,
            num_slots,
            top_k,
            num_tokens,
            self.rank,
            local_experts,
            PEER=self.peer,
            BLOCK=SLOT_BLOCK,
        )
        if self.peer:
            self.barrier()  # all slots have arrived
            return row_src.clone(), row_weight.clone()
        return row_src, row_weight

    def gather_rows(self, name, src, row_src, offs):
        """Dispatch: the receive buffer [rows, D], pulled row by row from the sources' ``src`` [T, D]."""
        local, ptrs = self.publish(name, src)
        if self.peer:
            self.barrier()
        out = src.new_empty(row_src.shape[0], src.shape[1])
        grid = (row_src.shape[0], triton.cdiv(src.shape[1], ROW_BLOCK))
        kernels.gather_rows_kernel[grid](
            out, local, ptrs, row_src, offs, offs.numel(), src.shape[0], src.shape[1], PEER=self.peer, BLOCK=ROW_BLOCK
        )
        return out

    def combine(self, name, buf, pos, ids, local_experts, out_dtype):
        """Gather-sum by slot group: out[i] = sum_j buf_{owner}[pos[i, j]] for pos [N, J], the owner of expert
        ids[i, j] being ids[i, j] // local_experts; ``buf`` [rows, D] is
        receive-side, published to peers through the workspace buffer ``name``."""
        if self.peer:
            local, ptrs = self.workspace(name, buf.shape[0], buf.shape[1:], buf.dtype)
            local.copy_(buf)
            self.barrier()
        else:
            local = ptrs = buf
        out = torch.empty(pos.shape[0], buf.shape[1], dtype=out_dtype, device=buf.device)
        grid = (pos.shape[0], triton.cdiv(buf.shape[1], ROW_BLOCK))
        kernels.combine_kernel[grid](
            out, local, ptrs, pos, ids, local_experts, buf.shape[1], TOP_K=pos.shape[1], PEER=self.peer, BLOCK=ROW_BLOCK
        )
        if self.peer:
            self.barrier()  # peers are done reading this rank's buffer before anyone reuses it
        return out


# --- the precision seam ----------------------------------------------------------------------------------------


def _swiglu_block(inter: int) -> int:
    return min(ROW_BLOCK, triton.next_power_of_2(inter))


class Bf16:
    """The experts in the compute dtype. An operand of a GEMM is a tuple: (values,) here, (e4m3, scales) at FP8."""

    def __init__(self, gemms: _Gemms, gate_up_proj, down_proj, weights, wgrad_precision="bf16"):
        self.gemms, self.gate_up_proj, self.down_proj = gemms, gate_up_proj, down_proj

    def dispatch(self, ex: _Exchange, x, row_src, offs):
        """The received rows as they travel and are kept: (values, scales), the scales 0 wide."""
        rows = ex.gather_rows("x", x.contiguous(), row_src, offs)
        return rows, rows.new_empty(rows.shape[0], 0, dtype=torch.float32)

    def gate_up(self, rows):
        return self.gemms.nt(rows[0], self.gate_up_proj)

    def swiglu(self, gate_up, row_weight, row_src, offs):
        """act = silu(gate) * up * routing weight, as the down GEMM's operand."""
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        act = gate_up.new_empty(rows, inter)
        block = _swiglu_block(inter)
        kernels.swiglu_forward_kernel[(rows, triton.cdiv(inter, block))](
            act, gate_up, row_weight, row_src, offs, offs.numel(), inter, BLOCK=block
        )
        return (act,)

    def down(self, act):
        return self.gemms.nt(act[0], self.down_proj)

    def down_input_grad(self, dy_routed):
        """The routed output gradient -> dL/d(weighted act)."""
        return self.gemms.nn(dy_routed, self.down_proj)

    def swiglu_backward(self, gate_up, d_act_weighted, row_weight, row_src, offs):
        """-> the gate/up gradient, it as the input-gradient GEMM's operand, the weighted activation (the down
        projection's weight gradient reads it) and dL/d(routing weight)."""
        d_gate_up = torch.empty_like(gate_up)
        act_weighted = torch.empty_like(d_act_weighted)
        d_row_weight = torch.empty_like(row_weight)
        # the kernels' arguments after their gate/up gradient outputs, at either precision
        rest = (act_weighted, d_row_weight, gate_up, d_act_weighted, row_weight, row_src, offs, offs.numel())
        return d_gate_up, self._swiglu_backward(d_gate_up, rest), act_weighted, d_row_weight

    def _swiglu_backward(self, d_gate_up, rest):
        """Run the SwiGLU backward kernel -> the gate/up gradient as the input-gradient GEMM's operand."""
        inter = d_gate_up.shape[1] // 2
        kernels.swiglu_backward_kernel[(d_gate_up.shape[0],)](d_gate_up, *rest, INTER=inter, BLOCK=_swiglu_block(inter))
        return (d_gate_up,)

    def gate_up_input_grad(self, d_gate_up):
        return self.gemms.nn(d_gate_up[0], self.gate_up_proj)

    def wgrad_rows(self, rows, dtype):
        """The received rows as the gate/up weight gradient reads them, in ``dtype``."""
        return rows[0]

    def weight_gradients(self, dy_routed, act_weighted, d_gate_up, rows):
        """-> (d_gate_up_proj, d_down_proj): bf16 grouped GEMMs at either precision, where FP8 weight gradients
        would come in."""
        return (
            self.gemms.wgrad(d_gate_up, self.wgrad_rows(rows, d_gate_up.dtype)),
            self.gemms.wgrad(dy_routed, act_weighted),
        )


class Fp8(Bf16):
    """The experts in blockwise FP8 (DeepGEMM's m-grouped FP8 GEMMs; the gpu_deep_gemm backend only). ``weights``:
    the stacks' FP8 copies (forward) and their transposes' (input gradients); ``wgrad_precision`` fp8 (backward's):
    the weight gradients in FP8 too."""

    def __init__(self, gemms: _Gemms, gate_up_proj, down_proj, weights, wgrad_precision="bf16"):
        super().__init__(gemms, gate_up_proj, down_proj, weights)
        self.gate_up_w, self.gate_up_wt = tuple(weights[0:2]), tuple(weights[2:4])
        self.down_w, self.down_wt = tuple(weights[4:6]), tuple(weights[6:8])
        self.fp8_wgrad = wgrad_precision == "fp8"
        # DeepGEMM's k-grouped kernel takes the segment sizes on the host: copied now, read at the weight gradients
        if self.fp8_wgrad:
            self.segment_ends = grouped.HostCopy(gemms.offs)

    def _nt(self, operand, w):
        return grouped.deep_gemm_nt(self.gemms.m_indices, *operand, w)

    def dispatch(self, ex: _Exchange, x, row_src, offs):
        q, scale = grouped.quantize_rows(x.contiguous())  # per token, before dispatch: rows travel in FP8
        q = ex.gather_rows("x_fp8", q.view(torch.uint8), row_src, offs).view(FP8)
        return q, ex.gather_rows("x_scale", scale, row_src, offs)

    def gate_up(self, rows):
        return self._nt(rows, self.gate_up_w)

    def swiglu(self, gate_up, row_weight, row_src, offs):
        rows, tiles = gate_up.shape[0], gate_up.shape[1] // 2 // TILE
        act_q = torch.empty(rows, tiles * TILE, dtype=FP8, device=gate_up.device)
        act_scale = torch.empty(rows, tiles, dtype=torch.float32, device=gate_up.device)
        fp8_kernels.swiglu_forward_fp8_kernel[grouped.row_grid(rows)](
            act_q, act_scale, gate_up, row_weight, row_src, offs, offs.numel(), tiles, grouped.ROWS
        )
        return act_q, act_scale

    def down(self, act):
        return self._nt(act, self.down_w)

    def down_input_grad(self, dy_routed):
        return self._nt(grouped.quantize_rows(dy_routed), self.down_wt)

    def _swiglu_backward(self, d_gate_up, rest):
        # the kernel quantizes the gate/up gradient per 1x128 tile as it makes it
        rows, tiles = d_gate_up.shape[0], d_gate_up.shape[1] // 2 // TILE
        d_gate_up_q = torch.empty(d_gate_up.shape, dtype=FP8, device=d_gate_up.device)
        d_gate_up_scale = torch.empty(rows, 2 * tiles, dtype=torch.float32, device=d_gate_up.device)
        fp8_kernels.swiglu_backward_fp8_kernel[grouped.row_grid(rows)](
            d_gate_up, d_gate_up_q, d_gate_up_scale, *rest, tiles, grouped.ROWS
        )
        return d_gate_up_q, d_gate_up_scale

    def gate_up_input_grad(self, d_gate_up):
        return self._nt(d_gate_up, self.gate_up_wt)

    def wgrad_rows(self, rows, dtype):
        return grouped.dequantize_rows(*rows, dtype)

    def weight_gradients(self, dy_routed, act_weighted, d_gate_up, rows):
        """-> fp32 (d_gate_up_proj, d_down_proj) through DeepGEMM's k-grouped FP8 kernel at wgrad_precision fp8:
        the bf16 gradients, the weighted activation and the kept FP8 rows requantized in 1x128 tiles along the rows;
        else bf16's."""
        if not self.fp8_wgrad:
            return super().weight_gradients(dy_routed, act_weighted, d_gate_up, rows)
        ends = self.segment_ends.tolist()
        ks = [end - start for start, end in zip([0, *ends[:-1]], ends)]
        offs = self.gemms.offs
        return (
            grouped.deep_gemm_weight_gradient(d_gate_up, rows, offs, ks),
            grouped.deep_gemm_weight_gradient(dy_routed, (act_weighted,), offs, ks),
        )


PRECISIONS = {"bf16": Bf16, "fp8": Fp8}


# --- the op --------------------------------------------------------------------------------------------------------


def forward(x, topk_ids, topk_weights, gate_up_proj, down_proj, weights, num_experts, group, kept, precision, deep):
    num_tokens = topk_ids.shape[0]
    layout = kernel_layout(topk_ids, num_experts, ALIGN[deep], group)  # the host sync: buffer sizes
    ids, local_experts = topk_ids.contiguous(), gate_up_proj.shape[0]
    ex = _Exchange(group, x.device)
    ex.reserve(layout.max_rows, x.shape[1], x.dtype)
    row_src, row_weight = ex.route(layout.pos, ids, local_experts, topk_weights.contiguous(), layout.rows, num_tokens)
    p = PRECISIONS[precision](_Gemms(deep, layout.offs, row_src), gate_up_proj, down_proj, weights)
    rows = p.dispatch(ex, x, row_src, layout.offs)
    gate_up = p.gate_up(rows)
    out = p.down(p.swiglu(gate_up, row_weight, row_src, layout.offs))
    y = ex.combine("out", out, layout.pos, ids, local_experts, x.dtype)
    return (y, *kept_residuals(kept, rows, gate_up), row_weight, row_src, layout.pos, layout.offs)


def backward(
    dy, residuals, topk_ids, gate_up_proj, down_proj, weights, group, precision, x=None, wgrad_precision="bf16", *, deep
):
    rows, row_scales, gate_up, row_weight, row_src, pos, offs = residuals
    num_tokens, top_k = pos.shape
    ids, local_experts = topk_ids.contiguous(), gate_up_proj.shape[0]
    ex = _Exchange(group, dy.device)
    p = PRECISIONS[precision](_Gemms(deep, offs, row_src), gate_up_proj, down_proj, weights, wgrad_precision)
    rows = (rows, row_scales)
    if rows[0].shape[0] == 0:  # forward kept its inputs only: pull the rows again, from the peers' x at EP > 1
        rows = p.dispatch(ex, x, row_src, offs)
    if gate_up.shape[0] == 0:
        gate_up = p.gate_up(rows)
    dy_routed = ex.gather_rows("dy", dy, row_src, offs)  # bf16: the down projection's weight gradient reads it
    d_gate_up, d_gate_up_operand, act_weighted, d_row_weight = p.swiglu_backward(
        gate_up, p.down_input_grad(dy_routed), row_weight, row_src, offs
    )
    d_gate_up_proj, d_down_proj = p.weight_gradients(dy_routed, act_weighted, d_gate_up, rows)
    dx_routed = p.gate_up_input_grad(d_gate_up_operand)
    dx = ex.combine("out", dx_routed, pos, ids, local_experts, dy.dtype)
    d_weights = ex.combine(
        "d_row_weight", d_row_weight.view(-1, 1), pos.view(-1, 1), ids.view(-1, 1), local_experts, torch.float32
    )
    return dx, d_weights.view(num_tokens, top_k), d_gate_up_proj, d_down_proj


ALIGN = {False: 8, True: 128}  # torch._grouped_mm's 16-byte rows; DeepGEMM's M block
for name, deep in (("gpu", False), ("gpu_deep_gemm", True)):
    register_backend(
        name,
        Backend(functools.partial(forward, deep=deep), functools.partial(backward, deep=deep), ALIGN[deep]),
    )
