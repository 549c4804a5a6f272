"""Where each routed (token, k) slot lands on the rank that owns its expert, computed on device without a host sync.

Every rank owns ``L = num_experts // ep`` experts and a receive buffer of a fixed ``capacity`` rows, laid out
expert-contiguously: local expert j's rows start at a multiple of ``align`` (what the grouped GEMM needs), and within
an expert the rows of source rank 0 come first, then rank 1, and so on, each in the source's stable (token, k) order.
The capacity is the worst case (every token of every rank sends min(K, L) rows to one rank, plus alignment), so
routing can never overflow it and no count ever travels through the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


def capacity(num_tokens: int, top_k: int, num_experts: int, ep: int, align: int) -> int:
    local = num_experts // ep
    rows = ep * num_tokens * min(top_k, local) + local * (align - 1)
    return -(-rows // align) * align


@dataclass
class Layout:
    pos: torch.Tensor  # [T, K] int64: row of slot (t, k) in the owner's receive buffer
    offs: torch.Tensor  # [L] int32: end row of each local expert's (padded) segment, the grouped GEMM's offsets


def routing_layout(topk_ids: torch.Tensor, num_experts: int, align: int, group: dist.ProcessGroup | None) -> Layout:
    ep = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    local = num_experts // ep
    flat = topk_ids.reshape(-1)
    # scatter_add rather than bincount: CUDA's bincount reads the max id back to the host.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    if ep > 1:
        gathered = [torch.empty_like(counts) for _ in range(ep)]
        dist.all_gather(gathered, counts, group=group)  # device to device: no host sync
        all_counts = torch.stack(gathered)
    else:
        all_counts = counts.unsqueeze(0)
    received = all_counts.sum(0)  # rows each expert receives on its owner
    padded = (received + align - 1) // align * align
    seg_end = padded.view(ep, local).cumsum(1).view(-1)
    seg_start = seg_end - padded
    src_offset = all_counts.cumsum(0)[rank] - counts  # rows earlier source ranks put in each expert
    order = torch.argsort(flat, stable=True)
    sorted_ids = flat[order]
    rank_in_expert = torch.arange(flat.numel(), device=flat.device) - (counts.cumsum(0) - counts)[sorted_ids]
    pos = torch.empty_like(flat)
    pos[order] = seg_start[sorted_ids] + src_offset[sorted_ids] + rank_in_expert
    offs = seg_end.view(ep, local)[rank].to(torch.int32)
    return Layout(pos.view(topk_ids.shape), offs)
