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
def _row_tiles(TILES: tl.constexpr, TILES_P2: tl.constexpr):
    """A row of TILES 1x128 tiles as a [TILES_P2, 128] block: (tile index, column offsets, mask)."""
    tiles = tl.arange(0, TILES_P2)
    return tiles, tiles[:, None] * 128 + tl.arange(0, 128)[None, :], (tiles < TILES)[:, None]


@triton.jit
def quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, TILES: tl.constexpr, TILES_P2: tl.constexpr):
    """x [M, TILES * 128] -> e4m3 [M, TILES * 128] and scales [M, TILES]; one program per row."""
    row = tl.program_id(0).to(tl.int64)
    tiles, cols, mask = _row_tiles(TILES, TILES_P2)
    vals = tl.load(x_ptr + row * TILES * 128 + cols, mask=mask, other=0.0).to(tl.float32)
    q, scale = _quantize_tiles(vals)
    tl.store(q_ptr + row * TILES * 128 + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row * TILES + tiles, scale, mask=tiles < TILES)


@triton.jit
def dequantize_rows_kernel(q_ptr, scale_ptr, out_ptr, TILES: tl.constexpr, TILES_P2: tl.constexpr):
    """The inverse: out [M, TILES * 128] = e4m3 * its tile's scale, in out's dtype; one program per row."""
    row = tl.program_id(0).to(tl.int64)
    tiles, cols, mask = _row_tiles(TILES, TILES_P2)
    scale = tl.load(scale_ptr + row * TILES + tiles, mask=tiles < TILES, other=0.0)
    vals = tl.load(q_ptr + row * TILES * 128 + cols, mask=mask, other=0.0).to(tl.float32) * scale[:, None]
    tl.store(out_ptr + row * TILES * 128 + cols, vals.to(out_ptr.dtype.element_ty), mask=mask)


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
    TILES_P2: tl.constexpr,
):
    """act = silu(gate) * up * routing weight [R, TILES * 128], quantized per 1x128 tile for the down GEMM (zeros,
    scale 1, for padding rows); one program per row; rows past the last expert's segment are left alone."""
    row = tl.program_id(0)
    inter: tl.constexpr = TILES * 128
    if row < tl.load(offs_ptr + num_local_experts - 1):
        valid = tl.load(row_src_ptr + row) >= 0
        weight = tl.load(row_weight_ptr + row)
        tiles, cols, mask = _row_tiles(TILES, TILES_P2)
        base = gate_up_ptr + row.to(tl.int64) * 2 * inter
        gate = tl.load(base + cols, mask=mask & valid, other=0.0).to(tl.float32)
        up = tl.load(base + inter + cols, mask=mask & valid, other=0.0).to(tl.float32)
        q, scale = _quantize_tiles(gate * tl.sigmoid(gate) * up * weight)
        tl.store(act_ptr + row.to(tl.int64) * inter + cols, q.to(act_ptr.dtype.element_ty), mask=mask)
        tl.store(act_scale_ptr + row * TILES + tiles, scale, mask=tiles < TILES)


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
    TILES_P2: tl.constexpr,
):
    """``moe_lab.moe.fused.kernels.swiglu_backward_kernel`` that also quantizes the gate/up gradient per 1x128 tile
    (gate tile j's scale in column j, up tile j's in column TILES + j) for the input-gradient GEMM; the bf16
    gradient and weighted activation stay for the weight-gradient GEMMs. One program per row."""
    row = tl.program_id(0)
    inter: tl.constexpr = TILES * 128
    live = row < tl.load(offs_ptr + num_local_experts - 1)
    valid = tl.load(row_src_ptr + row, mask=live, other=-1) >= 0
    weight = tl.load(row_weight_ptr + row, mask=live, other=0.0)
    r64 = row.to(tl.int64)
    tiles, cols, tile_mask = _row_tiles(TILES, TILES_P2)
    mask = tile_mask & live
    gate = tl.load(gate_up_ptr + r64 * 2 * inter + cols, mask=mask & valid, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + r64 * 2 * inter + inter + cols, mask=mask & valid, other=0.0).to(tl.float32)
    d_act_weighted = tl.load(d_act_weighted_ptr + r64 * inter + cols, mask=mask & valid, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    silu = gate * sig
    d_act = d_act_weighted * weight
    d_gate = d_act * up * sig * (1.0 + gate * (1.0 - sig))
    d_up = d_act * silu
    dgu = d_gate_up_ptr + r64 * 2 * inter
    tl.store(dgu + cols, d_gate.to(d_gate_up_ptr.dtype.element_ty), mask=mask)
    tl.store(dgu + inter + cols, d_up.to(d_gate_up_ptr.dtype.element_ty), mask=mask)
    act_weighted = silu * up * weight
    tl.store(act_weighted_ptr + r64 * inter + cols, act_weighted.to(act_weighted_ptr.dtype.element_ty), mask=mask)
    q_gate, s_gate = _quantize_tiles(d_gate)
    q_up, s_up = _quantize_tiles(d_up)
    qgu = d_gate_up_q_ptr + r64 * 2 * inter
    tl.store(qgu + cols, q_gate.to(d_gate_up_q_ptr.dtype.element_ty), mask=mask)
    tl.store(qgu + inter + cols, q_up.to(d_gate_up_q_ptr.dtype.element_ty), mask=mask)
    scales = d_gate_up_scale_ptr + r64 * 2 * TILES + tiles
    tl.store(scales, s_gate, mask=(tiles < TILES) & live)
    tl.store(scales + TILES, s_up, mask=(tiles < TILES) & live)
    tl.store(d_row_weight_ptr + row, tl.sum(tl.sum(d_act_weighted * silu * up, axis=1), axis=0), mask=live)


@triton.jit
def weight_blocks_kernel(w_ptr, q_ptr, scale_ptr, qt_ptr, scale_t_ptr, N: tl.constexpr, K: tl.constexpr):
    """w [L, N, K] -> e4m3 w and its transpose [L, K, N], with the 128x128 block scales [L, N/128, K/128] and their
    transpose [L, K/128, N/128]; one program per (expert, block row, block column), over the block in 32-row slices
    (the amax first, then the quantization: a whole block in registers spills)."""
    e = tl.program_id(0).to(tl.int64)
    bn = tl.program_id(1)
    bk = tl.program_id(2)
    k = bk * 128 + tl.arange(0, 128)
    amax = 0.0
    for i in tl.static_range(0, 128, 32):
        n = bn * 128 + i + tl.arange(0, 32)
        amax = tl.maximum(amax, tl.max(tl.abs(tl.load(w_ptr + e * N * K + n[:, None] * K + k[None, :]).to(tl.float32))))
    scale = amax / 448.0
    scale = tl.where(scale > 0, scale, 1.0)
    for i in tl.static_range(0, 128, 32):
        n = bn * 128 + i + tl.arange(0, 32)
        vals = tl.load(w_ptr + e * N * K + n[:, None] * K + k[None, :]).to(tl.float32)
        q = _round_e4m3(tl.minimum(tl.maximum(tl.div_rn(vals, scale), -448.0), 448.0)).to(q_ptr.dtype.element_ty)
        tl.store(q_ptr + e * N * K + n[:, None] * K + k[None, :], q)
        tl.store(qt_ptr + e * N * K + k[:, None] * N + n[None, :], tl.trans(q))  # transposed in registers: coalesced
    tl.store(scale_ptr + (e * (N // 128) + bn) * (K // 128) + bk, scale)
    tl.store(scale_t_ptr + (e * (K // 128) + bk) * (N // 128) + bn, scale)
