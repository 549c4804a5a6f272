"""What one rank holds of a (possibly FSDP2- or EP-sharded) tensor."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank holds: a DTensor's local shard (same storage), else ``t`` itself."""
    return t._local_tensor if isinstance(t, DTensor) else t
