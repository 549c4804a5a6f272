"""Triton kernels of the fused gpu backend. Row-wise and memory-bound; the GEMMs between them are grouped GEMMs.

Rows of a receive buffer at or past ``offs[L - 1]`` (the end of the last expert segment) are never read by anyone,
so programs for them load and store nothing. A row whose ``row_src`` is -1 is alignment padding: it is written as zeros.
With ``PEER`` the source rows live on other GPUs: ``peer_ptrs`` holds each rank's buffer address (torch symmetric
memory) and the kernel reads or writes over NVLink.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _peer_base(local_ptr, peer_ptrs, rank, PEER: tl.constexpr):
    if PEER:
        base = tl.load(peer_ptrs + rank).to(tl.pointer_type(local_ptr.dtype.element_ty))
    else:
        base = local_ptr
    return base


@triton.jit
def push_slots_kernel(
    row_src_ptr,
    row_src_peers,
    row_weight_ptr,
    row_weight_peers,
    pos_ptr,
    ids_ptr,
    weight_ptr,
    num_slots,
    top_k,
    rows_per_rank,
    my_rank,
    local_experts,
    PEER: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Tell each slot's owner where the row comes from: row_src[pos] = rank * T + token (and its routing weight)."""
    slots = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = slots < num_slots
    pos = tl.load(pos_ptr + slots, mask=mask, other=0)
    code = my_rank * rows_per_rank + slots // top_k
    if PEER:
        dest = tl.load(ids_ptr + slots, mask=mask, other=0) // local_experts  # the expert's owner
        # Each slot may go to another GPU: one pointer per lane.
        src_base = tl.load(row_src_peers + dest, mask=mask, other=0).to(tl.pointer_type(row_src_ptr.dtype.element_ty))
        tl.store(src_base + pos, code.to(row_src_ptr.dtype.element_ty), mask=mask)
        w_base = tl.load(row_weight_peers + dest, mask=mask, other=0).to(
            tl.pointer_type(row_weight_ptr.dtype.element_ty)
        )
        tl.store(w_base + pos, tl.load(weight_ptr + slots, mask=mask).to(tl.float32), mask=mask)
    else:
        tl.store(row_src_ptr + pos, code.to(row_src_ptr.dtype.element_ty), mask=mask)
        tl.store(row_weight_ptr + pos, tl.load(weight_ptr + slots, mask=mask).to(tl.float32), mask=mask)


@triton.jit
def gather_rows_kernel(
    out_ptr,
    src_ptr,
    src_peers,
    row_src_ptr,
    offs_ptr,
    num_local_experts,
    rows_per_rank,
    width,
    PEER: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Dispatch: out[r] = src_rank's x[token] for each row of the receive buffer (zeros for padding)."""
    row = tl.program_id(0)
    live = row < tl.load(offs_ptr + num_local_experts - 1)
    code = tl.load(row_src_ptr + row, mask=live, other=-1)
    rank = tl.maximum(code, 0) // rows_per_rank
    token = tl.maximum(code, 0) % rows_per_rank
    base = _peer_base(src_ptr, src_peers, rank, PEER)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    vals = tl.load(base + token.to(tl.int64) * width + cols, mask=mask & (code >= 0), other=0.0)
    tl.store(out_ptr + row.to(tl.int64) * width + cols, vals, mask=mask & live)


@triton.jit
def combine_kernel(
    out_ptr,
    buf_ptr,
    buf_peers,
    pos_ptr,
    ids_ptr,
    local_experts,
    width,
    TOP_K: tl.constexpr,
    PEER: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Combine as a gather-sum by token: out[t] = sum_k buf_{owner}[pos[t, k]], accumulated in fp32, the owner of
    expert ids[t, k] being ids[t, k] // local_experts."""
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        slot = token.to(tl.int64) * TOP_K + k
        pos = tl.load(pos_ptr + slot)
        if PEER:
            base = _peer_base(buf_ptr, buf_peers, tl.load(ids_ptr + slot) // local_experts, PEER)
        else:
            base = buf_ptr
        acc += tl.load(base + pos * width + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token.to(tl.int64) * width + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_forward_kernel(
    act_ptr, gate_up_ptr, row_weight_ptr, row_src_ptr, offs_ptr, num_local_experts, inter, BLOCK: tl.constexpr
):
    """act = silu(gate) * up * routing weight (zeros for padding rows), so the down GEMM's rows come out weighted."""
    row = tl.program_id(0)
    live = row < tl.load(offs_ptr + num_local_experts - 1)
    valid = tl.load(row_src_ptr + row, mask=live, other=-1) >= 0
    weight = tl.load(row_weight_ptr + row, mask=live, other=0.0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (cols < inter) & live
    base = gate_up_ptr + row.to(tl.int64) * 2 * inter
    gate = tl.load(base + cols, mask=mask & valid, other=0.0).to(tl.float32)
    up = tl.load(base + inter + cols, mask=mask & valid, other=0.0).to(tl.float32)
    act = gate * tl.sigmoid(gate) * up * weight
    tl.store(act_ptr + row.to(tl.int64) * inter + cols, act.to(act_ptr.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_backward_kernel(
    d_gate_up_ptr,
    act_weighted_ptr,
    d_row_weight_ptr,
    gate_up_ptr,
    d_act_weighted_ptr,
    row_weight_ptr,
    row_src_ptr,
    offs_ptr,
    num_local_experts,
    INTER: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """From dL/d(weighted act) = dy_row @ W_down: the gate/up gradient, the weighted activation (recomputed, for the
    down projection's weight gradient) and dL/d(routing weight) = <dL/d(weighted act), act>."""
    row = tl.program_id(0)
    live = row < tl.load(offs_ptr + num_local_experts - 1)
    valid = tl.load(row_src_ptr + row, mask=live, other=-1) >= 0
    weight = tl.load(row_weight_ptr + row, mask=live, other=0.0)
    gu_base = gate_up_ptr + row.to(tl.int64) * 2 * INTER
    dgu_base = d_gate_up_ptr + row.to(tl.int64) * 2 * INTER
    row_base = row.to(tl.int64) * INTER
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in tl.static_range(0, INTER, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = (cols < INTER) & live
        gate = tl.load(gu_base + cols, mask=mask & valid, other=0.0).to(tl.float32)
        up = tl.load(gu_base + INTER + cols, mask=mask & valid, other=0.0).to(tl.float32)
        d_act_weighted = tl.load(d_act_weighted_ptr + row_base + cols, mask=mask & valid, other=0.0).to(tl.float32)
        sig = tl.sigmoid(gate)
        silu = gate * sig
        acc += d_act_weighted * silu * up
        d_act = d_act_weighted * weight
        d_gate = d_act * up * sig * (1.0 + gate * (1.0 - sig))
        tl.store(dgu_base + cols, d_gate.to(d_gate_up_ptr.dtype.element_ty), mask=mask)
        tl.store(dgu_base + INTER + cols, (d_act * silu).to(d_gate_up_ptr.dtype.element_ty), mask=mask)
        tl.store(
            act_weighted_ptr + row_base + cols, (silu * up * weight).to(act_weighted_ptr.dtype.element_ty), mask=mask
        )
    tl.store(d_row_weight_ptr + row, tl.sum(acc, axis=0), mask=live)


@triton.jit
def zero_idle_experts_kernel(out_ptr, offs_ptr, SLAB: tl.constexpr, PER_PROGRAM: tl.constexpr, BLOCK: tl.constexpr):
    """Zero the weight gradient of each expert whose segment is empty (the k-grouped GEMM leaves it unwritten);
    programs of experts that got rows do nothing."""
    expert = tl.program_id(0)
    end = tl.load(offs_ptr + expert)
    start = tl.load(offs_ptr + expert - 1, mask=expert > 0, other=0)
    if end == start:
        base = out_ptr + expert.to(tl.int64) * SLAB + tl.program_id(1) * PER_PROGRAM
        for i in tl.range(0, PER_PROGRAM, BLOCK):
            cols = i + tl.arange(0, BLOCK)
            mask = (cols < PER_PROGRAM) & (tl.program_id(1) * PER_PROGRAM + cols < SLAB)
            tl.store(base + cols, tl.zeros([BLOCK], dtype=out_ptr.dtype.element_ty), mask=mask)


# --- routing layout (``moe_lab.moe.fused.layout`` computes the same with torch ops: the reference) ------------------


@triton.jit
def block_expert_counts_kernel(
    ids_ptr, counts_ptr, num_slots, NUM_EXPERTS: tl.constexpr, E_POW2: tl.constexpr, BLOCK: tl.constexpr
):
    """counts[e, b] = slots of block b (BLOCK consecutive (token, k) slots) routed to expert e: expert-major, so
    the prefix over blocks is a scan along the inner dimension (a fast one; over the outer it took 0.2 ms)."""
    slots = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(ids_ptr + slots, mask=slots < num_slots, other=-1)
    experts = tl.arange(0, E_POW2)
    hits = tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    column = experts.to(tl.int64) * tl.num_programs(0) + tl.program_id(0)
    tl.store(counts_ptr + column, hits.to(tl.int64), mask=experts < NUM_EXPERTS)


@triton.jit
def slot_positions_kernel(
    ids_ptr,
    block_cum_ptr,
    block_counts_ptr,
    all_counts_ptr,
    pos_ptr,
    seg_end_ptr,
    num_slots,
    my_rank,
    align,
    EP: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    LOCAL: tl.constexpr,
    EP_POW2: tl.constexpr,
    E_POW2: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Each slot's row on its expert's owner, without a sort: the owner's segment start of the expert (segments
    padded to ``align``, from every rank's counts ``all_counts`` [EP, E]), plus the rows earlier source ranks put
    there, plus the slots of this rank routed to the expert before it (earlier blocks: ``block_cum`` -
    ``block_counts``, the inclusive per-block prefix less the block's own, both [E, blocks]; then earlier slots of its
    own block). Program 0 also stores every owner's segment ends ``seg_end`` [EP * LOCAL] (int32). Rows fit int32:
    the pairwise tiles are int32."""
    experts = tl.arange(0, E_POW2)
    ranks = tl.arange(0, EP_POW2)
    in_range = (ranks[:, None] < EP) & (experts[None, :] < NUM_EXPERTS)
    counts = tl.load(all_counts_ptr + ranks[:, None] * NUM_EXPERTS + experts[None, :], mask=in_range, other=0).to(
        tl.int32
    )
    padded = (tl.sum(counts, axis=0) + align - 1) // align * align
    # segment end of expert e on its owner: the padded rows of all experts up to e, less those of earlier owners
    owner = experts // LOCAL
    owner_rows = tl.sum(tl.where(owner[None, :] == ranks[:, None], padded[None, :], 0), axis=1)
    seg_end = tl.cumsum(padded, axis=0) - tl.sum(
        tl.where(ranks[None, :] < owner[:, None], owner_rows[None, :], 0), axis=1
    )
    earlier_sources = tl.sum(tl.where(ranks[:, None] < my_rank, counts, 0), axis=0)
    base = seg_end - padded + earlier_sources
    if tl.program_id(0) == 0:
        tl.store(seg_end_ptr + experts, seg_end.to(tl.int32), mask=experts < NUM_EXPERTS)

    block = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    slots = block * BLOCK + lanes
    mask = slots < num_slots
    ids = tl.load(ids_ptr + slots, mask=mask, other=-1)
    row = tl.maximum(ids, 0) * tl.num_programs(0) + block
    earlier_blocks = tl.load(block_cum_ptr + row, mask=mask, other=0) - tl.load(
        block_counts_ptr + row, mask=mask, other=0
    )
    earlier_in_block = tl.sum(((ids[None, :] == ids[:, None]) & (lanes[None, :] < lanes[:, None])).to(tl.int32), axis=1)
    slot_base = tl.sum(tl.where(ids[:, None] == experts[None, :], base[None, :], 0), axis=1)
    tl.store(pos_ptr + slots, (slot_base + earlier_in_block).to(tl.int64) + earlier_blocks, mask=mask)


@triton.jit
def row_experts_kernel(
    m_indices_ptr, offs_ptr, row_src_ptr, rows, LOCAL: tl.constexpr, L_POW2: tl.constexpr, BLOCK: tl.constexpr
):
    """DeepGEMM's row map: the local expert of each receive-buffer row (the segments ending at or before it), -1
    for a padding row (``row_src`` -1), which the GEMM skips."""
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = r < rows
    experts = tl.arange(0, L_POW2)
    ends = tl.load(offs_ptr + experts, mask=experts < LOCAL, other=2**31 - 1)
    expert = tl.sum((ends[None, :] <= r[:, None]).to(tl.int32), axis=1)
    valid = tl.load(row_src_ptr + r, mask=mask, other=-1) >= 0
    tl.store(m_indices_ptr + r, tl.where(valid, expert, -1), mask=mask)
