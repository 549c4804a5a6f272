"""Initial weights that depend on (seed, parameter name, row) alone, never on how the parameter is split.

A parameter's rows (its first dimension: experts of an expert stack, output features of a matrix) are drawn in
fixed blocks of about a million elements, each from a generator seeded by (seed, name, block). A rank that holds
rows [a, b) of a parameter draws the blocks that cover them and keeps its rows, so every mesh shape (one rank, FSDP
shards, EP slices) starts from the same model. Draws are made on the tensor's device: CPU and CUDA runs of one seed
differ from each other, not between mesh shapes.
"""

from __future__ import annotations

import math
import zlib

import torch

BLOCK_NUMEL = 2**20


def _block_seed(seed: int, name: str, block: int) -> int:
    return (seed * 0x9E3779B1 + zlib.crc32(name.encode()) * 0x85EBCA77 + block) % 2**63


@torch.no_grad()
def fill_normal_rows(out: torch.Tensor, std: float, *, seed: int, name: str, first_row: int = 0) -> None:
    """Fill ``out`` with rows ``[first_row, first_row + len(out))`` of parameter ``name`` drawn from N(0, std^2)."""
    if out.numel() == 0:
        return
    row_shape = out.shape[1:]
    rows_per_block = max(1, BLOCK_NUMEL // math.prod(row_shape))
    end = first_row + out.shape[0]
    for block in range(first_row // rows_per_block, (end - 1) // rows_per_block + 1):
        start = block * rows_per_block
        generator = torch.Generator(out.device).manual_seed(_block_seed(seed, name, block))
        # Always the whole block, so its values never depend on how many of its rows this caller keeps.
        values = torch.empty((rows_per_block, *row_shape), device=out.device).normal_(0.0, std, generator=generator)
        lo, hi = max(start, first_row), min(start + rows_per_block, end)
        out[lo - first_row : hi - first_row].copy_(values[lo - start : hi - start])
