"""Blockwise FP8 quantization in plain PyTorch: the reference the Triton kernels (``moe_lab.moe.fp8.kernels``) and the
fused op's FP8 path are tested against.

A tile's scale is its absolute maximum over e4m3's largest finite value (448), so the tile's largest element maps to
+-448 and every element is rounded to nearest (3 mantissa bits: a relative error of at most 2**-4 for a normal value).
An all-zero tile gets scale 1 (its values stay 0). Dequantized: value = fp8 * scale.
"""

from __future__ import annotations

import torch

TILE = 128
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448


def _scale(amax: torch.Tensor) -> torch.Tensor:
    scale = amax.float() / FP8_MAX
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (e4m3 [M, K], fp32 scales [M, K / 128]): one scale per 1x128 tile of each row."""
    m, k = x.shape
    tiles = x.float().view(m, k // TILE, TILE)
    scale = _scale(tiles.abs().amax(-1))
    return (tiles / scale[..., None]).to(FP8).view(m, k), scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    m, k = q.shape
    return (q.float().view(m, k // TILE, TILE) * scale[..., None]).view(m, k)


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[L, N, K] -> (e4m3 [L, N, K], fp32 scales [L, N / 128, K / 128]): one scale per 128x128 block."""
    lead, n, k = w.shape
    blocks = w.float().view(lead, n // TILE, TILE, k // TILE, TILE)
    scale = _scale(blocks.abs().amax(dim=(2, 4)))
    return (blocks / scale[:, :, None, :, None]).to(FP8).view(lead, n, k), scale


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    lead, n, k = q.shape
    return (q.float().view(lead, n // TILE, TILE, k // TILE, TILE) * scale[:, :, None, :, None]).view(lead, n, k)


def transpose_blocks(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The blockwise quantization of w.transpose(1, 2): the same blocks, transposed (a block's amax does not care)."""

    def transposed(t):
        return t.transpose(1, 2).clone(memory_format=torch.contiguous_format)  # a copy even where a view is contiguous

    return transposed(q), transposed(scale)


def quantize_cols(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[K, M] -> (e4m3 [K, M], fp32 scales [ceil(K / 128), M]): one scale per 128x1 tile of each column, K padded
    with zero rows to whole tiles (as each expert's rows are in the gpu backend's layout). The weight gradient's
    operands: its GEMM reduces over K."""
    k, m = x.shape
    tiles = -(-k // TILE)
    padded = x.float().new_zeros(tiles * TILE, m)
    padded[:k] = x.float()
    scale = _scale(padded.view(tiles, TILE, m).abs().amax(1))
    q = (padded.view(tiles, TILE, m) / scale[:, None, :]).to(FP8).view(tiles * TILE, m)
    return q[:k], scale


def dequantize_cols(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.repeat_interleave(TILE, 0)[: q.shape[0]]
