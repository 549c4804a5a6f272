"""Blockwise-FP8 grouped GEMMs of the routed experts: rows [R, K] (1x128 tiles) against an expert stack [L, N, K]
(128x128 blocks) for each expert's segment of rows, out in bf16.

- ``deep_gemm_nt``: DeepGEMM's m-grouped contiguous FP8 kernel (SM90+) on rows already in its layout (each
  expert's segment starting at a multiple of 128, a row map with -1 for padding): the fused op's gpu backend.
- ``emulated_nt``: the same product in plain PyTorch (dequantized operands, fp32 math, rounded to the output dtype
  as DeepGEMM rounds), any device: the reference both GPU paths are tested against.
- ``fp8_grouped_mm``: a custom op for rows in plain expert-contiguous order (the torch dispatcher's), with its
  backward: on CUDA it places the rows in a 128-aligned layout sized from the row and expert counts alone, which the
  host knows, so no count is read back (``aligned_layout``), on CPU it emulates.
- ``quantize_rows`` / ``dequantize_rows``: the Triton row quantizers (``moe_lab.moe.fp8.kernels``) launched.

Weight gradients: where the fused dispatcher's ``wgrad_precision`` is fp8, the fused op's gpu backend runs them
in FP8 (``deep_gemm_weight_gradient``: DeepGEMM 0.1.5's k-grouped kernel on operands requantized in 1x128 tiles
along the rows, ``quantize_k_tiles``); elsewhere, and always in the torch dispatcher (``weight_gradient``), bf16
grouped GEMMs (``torch._grouped_mm``) on the bf16 rows or the FP8 rows dequantized.
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from moe_lab.moe.fp8 import kernels, quant, weights  # noqa: F401  (registers torch.ops.moe_lab.fp8_expert_weights)
from moe_lab.moe.fp8.quant import FP8, TILE

# Rows per program of the row kernels, a [8, 128] tile at a time (at 16 the SwiGLU backward takes 238 registers).
ROWS = 8


def row_grid(rows: int) -> tuple[int]:
    """The launch grid of a row kernel over ``rows`` rows."""
    return (triton.cdiv(rows, ROWS),)


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """[M, K] on the GPU -> e4m3 [M, K], fp32 scales [M, K / 128] (1x128 tiles), in one kernel."""
    rows, width = x.shape
    q = torch.empty(x.shape, dtype=FP8, device=x.device)
    scale = torch.empty(rows, width // TILE, dtype=torch.float32, device=x.device)
    if rows:
        kernels.quantize_rows_kernel[row_grid(rows)](x, q, scale, rows, width // TILE, ROWS)
    return q, scale


def dequantize_rows(q: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    rows, width = q.shape
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    if rows:
        kernels.dequantize_rows_kernel[row_grid(rows)](q, scale, out, rows, width // TILE, ROWS)
    return out


def deep_gemm_nt(m_indices: Tensor, a_q: Tensor, a_scale: Tensor, w: tuple[Tensor, Tensor]) -> Tensor:
    """rows [R, K] (e4m3, 1x128 scales) @ w[e].T for w = (e4m3 [L, N, K], 128x128 scales), e = m_indices[r] (-1:
    padding) -> bf16 [R, N]. The row scales go in MN-major (DeepGEMM's layout on SM90; handing them over K-major
    costs it a transpose per call)."""
    import deep_gemm

    out = torch.empty(a_q.shape[0], w[0].shape[1], dtype=torch.bfloat16, device=a_q.device)
    # Padding rows are zeros already (and skipped: m_indices -1): no zero-filling pass over them.
    deep_gemm.m_grouped_fp8_gemm_nt_contiguous(
        (a_q, a_scale.t().contiguous().t()), w, out, m_indices, ensure_zero_padding=False
    )
    return out


def emulated_nt(a_q: Tensor, a_scale: Tensor, w: tuple[Tensor, Tensor], j: int, dtype: torch.dtype) -> Tensor:
    """Rows of expert j (quantized per 1x128) @ its block-quantized w[j] [N, K] transposed, in fp32, rounded to
    ``dtype``."""
    w_j = quant.dequantize_blocks(w[0][j : j + 1], w[1][j : j + 1])[0]
    with torch.autocast(a_q.device.type, enabled=False):  # fp32 also where autocast reaches into a custom op's body
        return (quant.dequantize_rows(a_q, a_scale) @ w_j.T).to(dtype)


def quantize_k_tiles(x: Tensor, ends: Tensor, x_scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """x [R, W] (bf16, or e4m3 with its 1x128 ``x_scale`` [R, W / 128]), expert segments ending at ``ends`` (each a
    multiple of 128 rows) -> DeepGEMM's k-grouped operand: (flat e4m3, each expert's x^T back to back; scales
    [W, R / 128] as a transposed view of [R / 128, W], the layout the kernel probe hands DeepGEMM), in one kernel."""
    rows, width = x.shape
    q = torch.empty(rows * width, dtype=FP8, device=x.device)
    scale = torch.empty(rows // TILE, width, dtype=torch.float32, device=x.device)
    if rows:
        block = 64  # a [128, 64] fp32 tile: 64 values a thread at 4 warps
        kernels.quantize_k_tiles_kernel[(rows // TILE, triton.cdiv(width, block))](
            x,
            x if x_scale is None else x_scale,
            q,
            scale,
            ends,
            ends.shape[0],
            width,
            ROW_SCALED=x_scale is not None,
            EXPERTS=triton.next_power_of_2(ends.shape[0]),
            BLOCK=block,
        )
    return q, scale.t()


class HostCopy:
    """A small device tensor copied to pinned host memory behind the work queued so far: ``tolist`` waits for that
    copy only (made at the start of backward, read at its weight gradients: the GPU keeps the work queued between)."""

    def __init__(self, t: Tensor):
        self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self.host.copy_(t, non_blocking=True)
        self.copied = torch.cuda.Event()
        self.copied.record()

    def tolist(self) -> list:
        self.copied.synchronize()
        return self.host.tolist()


def deep_gemm_weight_gradient(grad: Tensor, rows: tuple, ends: Tensor, ks: list[int]) -> Tensor:
    """sum over each expert's rows of grad^T rows -> fp32 [L, N, K] (an expert without rows zero), through DeepGEMM's
    k-grouped FP8 kernel: ``grad`` bf16 [R, N] and ``rows`` (bf16 [R, K],) or (e4m3, 1x128 scales) requantized
    along the rows (``quantize_k_tiles``); ``ends`` [L] each expert's end row, ``ks`` the same sizes on the host
    (the kernel takes them there)."""
    import deep_gemm

    a, b = quantize_k_tiles(grad, ends), quantize_k_tiles(rows[0], ends, *rows[1:])
    out = torch.zeros(ends.shape[0], grad.shape[1], rows[0].shape[1], dtype=torch.float32, device=ends.device)
    sizes = torch.diff(ends, prepend=ends.new_zeros(1)).to(torch.int32)
    deep_gemm.k_grouped_fp8_gemm_nt_contiguous(a, b, out, ks, sizes, c=out)
    return out


def emulated_weight_gradient(grad: Tensor, rows: Tensor) -> Tensor:
    """One expert's FP8 weight gradient in plain PyTorch: both operands quantized per 128 rows of each column
    (``quant.quantize_cols``), dequantized, grad^T rows in fp32."""
    with torch.autocast(grad.device.type, enabled=False):  # as in emulated_nt
        return quant.dequantize_cols(*quant.quantize_cols(grad)).T @ quant.dequantize_cols(*quant.quantize_cols(rows))


def weight_gradient(grad: Tensor, rows: Tensor, offs: Tensor) -> Tensor:
    """sum over each expert's rows of grad^T rows -> [L, N, K] (k-grouped, bf16 or the rows' dtype), an expert
    without rows zero (torch._grouped_mm leaves its slab unwritten)."""
    out = torch._grouped_mm(grad.t(), rows, offs=offs)
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    return torch.where(counts.view(-1, 1, 1) > 0, out, 0)


# --- rows in plain expert-contiguous order (the torch dispatcher's) ------------------------------------------------


def aligned_layout(offs: Tensor, rows: int) -> tuple[Tensor, Tensor]:
    """Expert-contiguous rows (``offs`` [L] int32: each expert's end row) -> (each row's place [R] in a layout whose
    expert segments start at multiples of 128, the layout's row map [M] int32: each row's expert, -1 for padding).
    M is sized from R and L alone (every segment padded by at most 127 rows), so nothing is read back to the host;
    what the segments leave of it is padding (-1) at its end."""
    ends = offs.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    padded = (counts + TILE - 1) // TILE * TILE
    row = torch.arange(rows, device=offs.device)
    expert = torch.searchsorted(ends, row, right=True)
    place = row + ((padded.cumsum(0) - padded) - (ends - counts))[expert]
    bound = (rows + (TILE - 1) * (offs.shape[0] + 1)) // TILE * TILE  # >= one block, >= every padded segment
    m_indices = torch.full((bound,), -1, dtype=torch.int32, device=offs.device)
    return place, m_indices.index_put((place,), expert.to(torch.int32))


def _segments(offs: Tensor) -> list[tuple[int, int]]:
    bounds = [0, *offs.tolist()]
    return list(zip(bounds[:-1], bounds[1:]))


def _aligned_nt(a: Tensor, place: Tensor, m_indices: Tensor, w: tuple[Tensor, Tensor]) -> Tensor:
    """a [R, K] @ w[e].T through DeepGEMM: quantized, placed in the aligned layout, multiplied, taken back."""
    q, scale = quantize_rows(a.contiguous())
    placed_q = torch.zeros(m_indices.shape[0], a.shape[1], dtype=torch.uint8, device=a.device)
    placed_scale = torch.ones(m_indices.shape[0], scale.shape[1], dtype=torch.float32, device=a.device)
    placed_q[place] = q.view(torch.uint8)
    placed_scale[place] = scale
    return deep_gemm_nt(m_indices, placed_q.view(FP8), placed_scale, w)[place]


def _grouped_nt(a: Tensor, offs: Tensor, place: Tensor, m_indices: Tensor, w: tuple[Tensor, Tensor]) -> Tensor:
    if a.is_cuda:
        return _aligned_nt(a, place, m_indices, w).to(a.dtype)
    out = a.new_zeros(a.shape[0], w[0].shape[1])
    for j, (s, e) in enumerate(_segments(offs)):
        out[s:e] = emulated_nt(*quant.quantize_rows(a[s:e]), w, j, a.dtype)
    return out


@torch.library.custom_op("moe_lab::fp8_grouped_mm", mutates_args=())
def fp8_grouped_mm(
    a: Tensor,
    offs: Tensor,
    place: Tensor,
    m_indices: Tensor,
    w: Tensor,
    w_q: Tensor,
    w_scale: Tensor,
    w_qt: Tensor,
    w_scale_t: Tensor,
) -> Tensor:
    """a [R, K] @ w[e].T per expert segment (``offs``), in blockwise FP8 -> [R, N] in a's dtype. ``place``,
    ``m_indices``: ``aligned_layout``'s; ``w``: the parameter (its gradient's shape and dtype), ``w_q`` ...
    ``w_scale_t``: its FP8 copy and its transpose's (``moe_lab.moe.fp8.weights``)."""
    return _grouped_nt(a, offs, place, m_indices, (w_q, w_scale))


@fp8_grouped_mm.register_fake
def _(a, offs, place, m_indices, w, w_q, w_scale, w_qt, w_scale_t):
    return a.new_empty(a.shape[0], w.shape[1])


@torch.library.custom_op("moe_lab::fp8_grouped_mm_backward", mutates_args=())
def fp8_grouped_mm_backward(
    grad: Tensor, a: Tensor, offs: Tensor, place: Tensor, m_indices: Tensor, w: Tensor, w_qt: Tensor, w_scale_t: Tensor
) -> tuple[Tensor, Tensor]:
    """-> da [R, K] (grad against w's transposed FP8 copy), dw [L, N, K] in w's dtype (bf16 grouped GEMM)."""
    da = _grouped_nt(grad, offs, place, m_indices, (w_qt, w_scale_t))
    return da, weight_gradient(grad, a, offs).to(w.dtype)


@fp8_grouped_mm_backward.register_fake
def _(grad, a, offs, place, m_indices, w, w_qt, w_scale_t):
    return a.new_empty(a.shape), w.new_empty(w.shape)


def _setup_context(ctx, inputs, output):
    a, offs, place, m_indices, w, _, _, w_qt, w_scale_t = inputs
    ctx.save_for_backward(a, offs, place, m_indices, w, w_qt, w_scale_t)


def _backward(ctx, grad):
    da, dw = fp8_grouped_mm_backward(grad.contiguous(), *ctx.saved_tensors)
    return da, None, None, None, dw, None, None, None, None


fp8_grouped_mm.register_autograd(_backward, setup_context=_setup_context)


def fp8_grouped_gemm(offs: Tensor, rows: int):
    """The grouped GEMM of ``moe_lab.moe.experts.grouped_swiglu`` in blockwise FP8, for ``rows`` expert-contiguous
    rows ending at ``offs``: (a, expert stack parameter) -> a @ w[e].T. The aligned layout is made once for both of
    a layer's GEMMs, the stacks' FP8 copies come from the per-step cache."""
    place, m_indices = aligned_layout(offs, rows)

    def gemm(a: Tensor, w: Tensor) -> Tensor:
        return torch.ops.moe_lab.fp8_grouped_mm(a, offs, place, m_indices, w, *torch.ops.moe_lab.fp8_expert_weights(w))

    return gemm
