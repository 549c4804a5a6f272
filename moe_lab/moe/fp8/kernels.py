"""Triton kernels of the blockwise FP8 path, each tested against ``moe_lab.moe.fp8.quant`` (tests/test_fp8.py, under
Triton's interpreter on CPU).

Quantization sits where the values are made: the SwiGLU kernels quantize their outputs in registers (the activation
for the down GEMM, the gate/up gradient for the input-gradient GEMM), ``quantize_rows_kernel`` quantizes a row
tensor in one pass (x before its dispatch, so the rows travel in FP8; the routed output gradient), and
``weight_blocks_kernel`` quantizes an expert stack and its transpose in one pass. Every tile's scale is
amax / 448 (1 for an all-zero tile). Values are rounded to e4m3's grid in fp32 arithmetic (``_round_e4m3``) so that
the final cast is exact: the same bits on the GPU, in the interpreter and in torch's reference.
"""

from __future__ import annotations

import triton
import triton.language as tl

TILE = 128


@triton.jit
def _round_e4m3(v):
    """Round fp32 v (|v| <= 448) to the nearest e4m3 value, ties to even: normals keep 3 mantissa bits (a carry
    into the exponent is right by construction), subnormals (|v| < 2**-6) are multiples of 2**-9."""
    bits = v.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    sub = ((v * 512.0 + 12582912.0) - 12582912.0) * (1.0 / 512.0)  # 1.5 * 2**23: fp32's round-to-nearest-even
    return tl.where(tl.abs(v) < 0.015625, sub, normal)


@triton.jit
def _quantize_tiles(vals):
    """fp32 values [tiles, 128], one 1x128 tile per row -> (e4m3 values as fp32, scales [tiles])."""
    scale = tl.max(tl.abs(vals), axis=1) / 448.0
    scale = tl.where(scale > 0, scale, 1.0)
    return _round_e4m3(tl.minimum(tl.maximum(tl.div_rn(vals, scale[:, None]), -448.0), 448.0)), scale


@triton.jit
def _row_block(ROWS: tl.constexpr):
    """This program's first row (a 64-bit scalar: the pointers advance once), its ROWS rows relative to it (32-bit:
    64-bit offsets per element cost registers) and one 1x128 tile's columns."""
    return tl.program_id(0).to(tl.int64) * ROWS, tl.arange(0, ROWS), tl.arange(0, 128)


@triton.jit
def quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, num_rows, TILES: tl.constexpr, ROWS: tl.constexpr):
    """x [M, TILES * 128] -> e4m3 [M, TILES * 128] and scales [M, TILES]; one program per ROWS rows, a tile at a
    time (a row's width need not be a power of 2)."""
    first, rows, cols = _row_block(ROWS)
    live = first + rows < num_rows
    x_ptr += first * TILES * 128
    q_ptr += first * TILES * 128
    scale_ptr += first * TILES
    for t in range(TILES):
        at = rows[:, None] * TILES * 128 + t * 128 + cols[None, :]
        q, scale = _quantize_tiles(tl.load(x_ptr + at, mask=live[:, None], other=0.0).to(tl.float32))
        tl.store(q_ptr + at, q.to(q_ptr.dtype.element_ty), mask=live[:, None])
        tl.store(scale_ptr + rows * TILES + t, scale, mask=live)


@triton.jit
def dequantize_rows_kernel(q_ptr, scale_ptr, out_ptr, num_rows, TILES: tl.constexpr, ROWS: tl.constexpr):
    """The inverse: out [M, TILES * 128] = e4m3 * its tile's scale, in out's dtype."""
    first, rows, cols = _row_block(ROWS)
    live = first + rows < num_rows
    q_ptr += first * TILES * 128
    out_ptr += first * TILES * 128
    scale_ptr += first * TILES
    for t in range(TILES):
        at = rows[:, None] * TILES * 128 + t * 128 + cols[None, :]
        scale = tl.load(scale_ptr + rows * TILES + t, mask=live, other=0.0)
        vals = tl.load(q_ptr + at, mask=live[:, None], other=0.0).to(tl.float32) * scale[:, None]
        tl.store(out_ptr + at, vals.to(out_ptr.dtype.element_ty), mask=live[:, None])


@triton.jit
def swiglu_forward_fp8_kernel(
    act_ptr,
    act_scale_ptr,
    gate_up_ptr,
    row_weight_ptr,
    row_src_ptr,
    offs_ptr,
    num_local_experts,
    TILES: tl.constexpr,
    ROWS: tl.constexpr,
):
    """act = silu(gate) * up * routing weight [R, TILES * 128], quantized per 1x128 tile for the down GEMM (zeros,
    scale 1, for padding rows); one program per ROWS rows; rows past the last expert's segment are left alone."""
    inter: tl.constexpr = TILES * 128
    first, rows, cols = _row_block(ROWS)
    live = first + rows < tl.load(offs_ptr + num_local_experts - 1)
    valid = live & (tl.load(row_src_ptr + first + rows, mask=live, other=-1) >= 0)
    weight = tl.load(row_weight_ptr + first + rows, mask=live, other=0.0)
    gate_up_ptr += first * 2 * inter
    act_ptr += first * inter
    act_scale_ptr += first * TILES
    for t in range(TILES):
        at = rows[:, None] * 2 * inter + t * 128 + cols[None, :]
        gate = tl.load(gate_up_ptr + at, mask=valid[:, None], other=0.0).to(tl.float32)
        up = tl.load(gate_up_ptr + at + inter, mask=valid[:, None], other=0.0).to(tl.float32)
        q, scale = _quantize_tiles(gate * tl.sigmoid(gate) * up * weight[:, None])
        act_at = rows[:, None] * inter + t * 128 + cols[None, :]
        tl.store(act_ptr + act_at, q.to(act_ptr.dtype.element_ty), mask=live[:, None])
        tl.store(act_scale_ptr + rows * TILES + t, scale, mask=live)


@triton.jit
def swiglu_backward_fp8_kernel(
    d_gate_up_ptr,
    d_gate_up_q_ptr,
    d_gate_up_scale_ptr,
    act_weighted_ptr,
    d_row_weight_ptr,
    gate_up_ptr,
    d_act_weighted_ptr,
    row_weight_ptr,
    row_src_ptr,
    offs_ptr,
    num_local_experts,
    TILES: tl.constexpr,
    ROWS: tl.constexpr,
):
    """``moe_lab.moe.fused.kernels.swiglu_backward_kernel`` that also quantizes the gate/up gradient per 1x128 tile
    (gate tile j's scale in column j, up tile j's in column TILES + j) for the input-gradient GEMM; the bf16
    gradient and weighted activation stay for the weight-gradient GEMMs. One program per ROWS rows."""
    inter: tl.constexpr = TILES * 128
    first, rows, cols = _row_block(ROWS)
    live = first + rows < tl.load(offs_ptr + num_local_experts - 1)
    valid = live & (tl.load(row_src_ptr + first + rows, mask=live, other=-1) >= 0)
    weight = tl.load(row_weight_ptr + first + rows, mask=live, other=0.0)
    gate_up_ptr += first * 2 * inter
    d_gate_up_ptr += first * 2 * inter
    d_gate_up_q_ptr += first * 2 * inter
    d_gate_up_scale_ptr += first * 2 * TILES
    d_act_weighted_ptr += first * inter
    act_weighted_ptr += first * inter
    d_row_weight = tl.zeros([ROWS], dtype=tl.float32)
    for t in range(TILES):
        at = rows[:, None] * 2 * inter + t * 128 + cols[None, :]  # the gate tile; its up tile is inter further
        act_at = rows[:, None] * inter + t * 128 + cols[None, :]
        gate = tl.load(gate_up_ptr + at, mask=valid[:, None], other=0.0).to(tl.float32)
        up = tl.load(gate_up_ptr + at + inter, mask=valid[:, None], other=0.0).to(tl.float32)
        d_act_weighted = tl.load(d_act_weighted_ptr + act_at, mask=valid[:, None], other=0.0).to(tl.float32)
        sig = tl.sigmoid(gate)
        silu = gate * sig
        d_act = d_act_weighted * weight[:, None]
        d_gate = d_act * up * sig * (1.0 + gate * (1.0 - sig))
        d_up = d_act * silu
        tl.store(d_gate_up_ptr + at, d_gate.to(d_gate_up_ptr.dtype.element_ty), mask=live[:, None])
        tl.store(d_gate_up_ptr + at + inter, d_up.to(d_gate_up_ptr.dtype.element_ty), mask=live[:, None])
        act_weighted = (silu * up * weight[:, None]).to(act_weighted_ptr.dtype.element_ty)
        tl.store(act_weighted_ptr + act_at, act_weighted, mask=live[:, None])
        q_gate, s_gate = _quantize_tiles(d_gate)
        q_up, s_up = _quantize_tiles(d_up)
        tl.store(d_gate_up_q_ptr + at, q_gate.to(d_gate_up_q_ptr.dtype.element_ty), mask=live[:, None])
        tl.store(d_gate_up_q_ptr + at + inter, q_up.to(d_gate_up_q_ptr.dtype.element_ty), mask=live[:, None])
        tl.store(d_gate_up_scale_ptr + rows * 2 * TILES + t, s_gate, mask=live)
        tl.store(d_gate_up_scale_ptr + rows * 2 * TILES + TILES + t, s_up, mask=live)
        d_row_weight += tl.sum(d_act_weighted * silu * up, axis=1)
    tl.store(d_row_weight_ptr + first + rows, d_row_weight, mask=live)


@triton.jit
def weight_blocks_kernel(w_ptr, q_ptr, scale_ptr, qt_ptr, scale_t_ptr, N: tl.constexpr, K: tl.constexpr):
    """w [L, N, K] -> e4m3 w and its transpose [L, K, N], with the 128x128 block scales [L, N/128, K/128] and their
    transpose [L, K/128, N/128]; one program per (expert, block row, block column), over the block in 32-row slices
    (the amax first, then the quantization: a whole block in registers is slower, measured), each slice addressed by
    32-bit offsets from the block's 64-bit base."""
    e = tl.program_id(0).to(tl.int64)
    bn, bk = tl.program_id(1), tl.program_id(2)
    w_ptr += e * N * K + bn * 128 * K + bk * 128
    q_ptr += e * N * K + bn * 128 * K + bk * 128
    qt_ptr += e * N * K + bk * 128 * N + bn * 128
    k = tl.arange(0, 128)
    amax = 0.0
    for i in tl.static_range(0, 128, 32):
        n = i + tl.arange(0, 32)
        amax = tl.maximum(amax, tl.max(tl.abs(tl.load(w_ptr + n[:, None] * K + k[None, :]).to(tl.float32))))
    scale = amax / 448.0
    scale = tl.where(scale > 0, scale, 1.0)
    for i in tl.static_range(0, 128, 32):
        n = i + tl.arange(0, 32)
        vals = tl.load(w_ptr + n[:, None] * K + k[None, :]).to(tl.float32)
        q = _round_e4m3(tl.minimum(tl.maximum(tl.div_rn(vals, scale), -448.0), 448.0)).to(q_ptr.dtype.element_ty)
        tl.store(q_ptr + n[:, None] * K + k[None, :], q)
        tl.store(qt_ptr + k[:, None] * N + n[None, :], tl.trans(q))  # transposed in registers: coalesced
    tl.store(scale_ptr + (e * (N // 128) + bn) * (K // 128) + bk, scale)
    tl.store(scale_t_ptr + (e * (K // 128) + bk) * (N // 128) + bn, scale)


@triton.jit
def quantize_k_tiles_kernel(
    x_ptr,
    x_scale_ptr,
    q_ptr,
    scale_ptr,
    ends_ptr,
    num_experts,
    width,
    ROW_SCALED: tl.constexpr,
    EXPERTS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """A weight gradient's operand: x [R, width], each expert's rows a segment ending at ends[e] (every segment a
    whole number of 128-row tiles; e4m3 with 1x128 scales along the width where ROW_SCALED: the rows as forward keeps
    them) -> DeepGEMM's k-grouped operand: each expert's e4m3 x^T [width, rows_e] back to back (flat), and scales
    [R / 128, width], one per 128x1 tile (128 rows of a column: the GEMM's reduction runs along the rows). One program
    per 128-row tile and BLOCK columns: the column amax over the tile, then the quantized tile."""
    tile = tl.program_id(0).to(tl.int64)
    first = tile * 128
    rows = tl.arange(0, 128)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = cols < width
    experts = tl.arange(0, EXPERTS)
    ends = tl.load(ends_ptr + experts, mask=experts < num_experts, other=0).to(tl.int64)
    start = tl.max(tl.where(ends <= first, ends, 0), axis=0)  # this tile's expert's segment
    end = tl.min(tl.where(ends > first, ends, tl.max(ends, axis=0)), axis=0)
    at = (first + rows)[:, None] * width + cols[None, :]
    vals = tl.load(x_ptr + at, mask=live[None, :], other=0.0).to(tl.float32)
    if ROW_SCALED:
        row_tiles = width // 128
        vals *= tl.load(x_scale_ptr + (first + rows)[:, None] * row_tiles + cols[None, :] // 128, mask=live[None, :])
    scale = tl.max(tl.abs(vals), axis=0) / 448.0
    scale = tl.where(scale > 0, scale, 1.0)
    q = _round_e4m3(tl.minimum(tl.maximum(tl.div_rn(vals, scale[None, :]), -448.0), 448.0))
    # stored transposed in registers: a column's 128 rows are contiguous in the k-grouped operand (coalesced)
    dest = start * width + cols[:, None].to(tl.int64) * (end - start) + (first - start + rows)[None, :]
    tl.store(q_ptr + dest, tl.trans(q.to(q_ptr.dtype.element_ty)), mask=live[:, None])
    tl.store(scale_ptr + tile * width + cols, scale, mask=live)
