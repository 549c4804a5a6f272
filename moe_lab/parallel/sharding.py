"""What one rank holds of a (possibly FSDP2- or EP-sharded) tensor."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank holds: a DTensor's local shard (same storage), else ``t`` itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def first_row(t: torch.Tensor) -> int:
    """Index, in the whole tensor, of the first row (dim 0) of this rank's shard: FSDP2 shards dim 0 into contiguous
    row ranges."""
    if not isinstance(t, DTensor):
        return 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return offset[0]


def local_rows(model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, int]]:
    """Each parameter's piece on this rank, by name, with the index of its first row in the whole (unsplit)
    parameter: the FSDP shard's offset, plus the EP slice's first expert for expert stacks."""
    from moe_lab.moe.experts import GroupedExperts

    pieces = {}
    for module_name, module in model.named_modules():
        first_expert = module.expert_offset if isinstance(module, GroupedExperts) else 0
        for name, p in module.named_parameters(recurse=False):
            pieces[f"{module_name}.{name}" if module_name else name] = (local_shard(p), first_expert + first_row(p))
    return pieces
