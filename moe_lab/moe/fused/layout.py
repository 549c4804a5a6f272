"""Where each routed (token, k) slot lands on the rank that owns its expert, and how many rows each rank receives.

Every rank owns ``L = num_experts // ep`` experts and a receive buffer laid out expert-contiguously: local expert j's
rows start at a multiple of ``align`` (what the grouped GEMM needs), and within an expert the rows of source rank 0
come first, then rank 1, and so on, each in the source's stable (token, k) order.

The buffer holds exactly the rows this rank receives, each expert's segment padded to ``align`` (and at least one
aligned block, so no kernel or GEMM ever sees an empty buffer). The per-expert counts of every rank are gathered
device to device, then the receive-buffer size of every rank is copied to the host: the layer's one host sync, as in
the torch dispatcher. Sizing for the worst case instead (every token of every rank sending min(K, L) rows to one
rank) needs no sync but holds, and saves for backward, EP x the rows actually received under balanced routing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_lab.runtime.host_read import to_host


@dataclass
class Layout:
    pos: torch.Tensor  # [T, K] int64: row of slot (t, k) in the owner's receive buffer
    offs: torch.Tensor  # [L] int32: end row of each local expert's (padded) segment, the grouped GEMM's offsets
    rows: int  # rows of this rank's receive buffer
    max_rows: int  # the largest receive buffer over the EP group (what a buffer peers write into must hold)


def gather_counts(counts: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's slots per expert [E] -> every rank's [EP, E] (device to device: no host sync)."""
    if group is None:
        return counts.unsqueeze(0)
    gathered = [torch.empty_like(counts) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, counts, group=group)
    return torch.stack(gathered)


def layout_from_counts(topk_ids: torch.Tensor, all_counts: torch.Tensor, rank: int, align: int) -> Layout:
    """The layout of rank ``rank``'s slots ``topk_ids`` given every rank's counts ``all_counts`` [EP, E]; no
    communication, one device-to-host copy (the sizes)."""
    ep, num_experts = all_counts.shape
    local = num_experts // ep
    flat = topk_ids.reshape(-1)
    counts = all_counts[rank]
    padded = (all_counts.sum(0) + align - 1) // align * align  # each expert's segment on its owner
    seg_end = padded.view(ep, local).cumsum(1)
    seg_start = seg_end.view(-1) - padded
    src_offset = all_counts.cumsum(0)[rank] - counts  # rows earlier source ranks put in each expert
    order = torch.argsort(flat, stable=True)
    sorted_ids = flat[order]
    rank_in_expert = torch.arange(flat.numel(), device=flat.device) - (counts.cumsum(0) - counts)[sorted_ids]
    pos = torch.empty_like(flat)
    pos[order] = seg_start[sorted_ids] + src_offset[sorted_ids] + rank_in_expert
    return Layout(pos.view(topk_ids.shape), seg_end[rank].to(torch.int32), *receive_rows(seg_end, rank, align))


def routing_layout(topk_ids: torch.Tensor, num_experts: int, align: int, group: dist.ProcessGroup | None) -> Layout:
    """The reference backend's layout, in torch ops (the gpu backend computes the same in two kernels:
    ``moe_lab.moe.fused.gpu.kernel_layout``)."""
    rank = 0 if group is None else dist.get_rank(group)
    flat = topk_ids.reshape(-1)
    # scatter_add rather than bincount: CUDA's bincount reads the max id back to the host.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )
    return layout_from_counts(topk_ids, gather_counts(counts, group), rank, align)


def receive_rows(seg_end: torch.Tensor, rank: int, align: int) -> tuple[int, int]:
    """Every owner's segment ends [EP, L] -> (this rank's receive-buffer rows, the group's largest): the host sync."""
    rows = [max(r, align) for r in to_host(seg_end[:, -1]).tolist()]
    return rows[rank], max(rows)


def workspace_rows(rows: int) -> int:
    """``rows`` rounded up to the next step of a ladder whose steps are at most 1.25x apart (m * 2**e, m in 4..8), so
    a buffer sized by it is reused across small changes in routing and never exceeds 1.25x what was asked."""
    shift = max(rows.bit_length() - 3, 0)
    return -(-rows >> shift) << shift
