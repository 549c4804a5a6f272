"""Device meshes: dense weights sharded over all ranks; experts split over ``ep`` ranks and sharded over the rest."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass
class Meshes:
    dense: DeviceMesh  # 1-D over all dp_shard ranks (FSDP of dense weights)
    expert_shard: DeviceMesh  # 1-D over the dp_shard / ep ranks that hold the same experts (FSDP of experts)
    ep: DeviceMesh  # 1-D over the ranks that split the experts between them

    @property
    def world_size(self) -> int:
        return self.dense.size()


def build_meshes(device_type: str, ep: int) -> Meshes:
    """Rank r sits at (r // ep, r % ep) of an (expert_shard, ep) grid, so EP groups are consecutive ranks (one
    node's NVLink domain) as in torchtitan, where EP borrows its ranks from the sharding dimension."""
    world = dist.get_world_size()
    grid = init_device_mesh(device_type, (world // ep, ep), mesh_dim_names=("expert_shard", "ep"))
    dense = grid._flatten("dp_shard")
    return Meshes(dense=dense, expert_shard=grid["expert_shard"], ep=grid["ep"])


def grid_ranks(world: int, ep: int) -> torch.Tensor:
    """The ranks of the (expert_shard, ep) grid as ``build_meshes`` lays them out (init_device_mesh fills it row by
    row): rank r at (r // ep, r % ep)."""
    return torch.arange(world).reshape(world // ep, ep)
