"""Device meshes: ``dp_replicate`` replicas (HSDP), each an FSDP group of ``world / dp_replicate`` ranks; inside a
replica dense weights are sharded over all its ranks, experts split over ``ep`` of them and sharded over the rest."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass
class Meshes:
    # FSDP of dense weights: 1-D (dp_shard) over the replica's ranks, or 2-D (dp_replicate, dp_shard) with replicas
    dense: DeviceMesh
    # FSDP of experts: 1-D (expert_shard) over the replica's ranks that hold the same experts, or 2-D
    # (dp_replicate, expert_shard)
    expert_shard: DeviceMesh
    ep: DeviceMesh  # 1-D over the ranks that split the experts between them

    @property
    def world_size(self) -> int:
        return self.dense.size()


def build_meshes(device_type: str, ep: int, dp_replicate: int = 1) -> Meshes:
    """Rank r is shard r % S of replica r // S (S = world / dp_replicate: a replica is consecutive ranks, one or more
    nodes), and inside its replica at (s // ep, s % ep) of an (expert_shard, ep) grid, so EP groups are consecutive
    ranks (one node's NVLink domain) as in torchtitan, where EP borrows its ranks from the sharding dimension. With
    one replica the meshes are 1-D: plain FSDP2, no all-reduce over a replica dimension of one rank."""
    world = dist.get_world_size()
    shard = world // dp_replicate
    ranks = init_device_mesh(device_type, (world,), mesh_dim_names=("world",))
    dense = ranks._unflatten(0, (dp_replicate, shard), ("dp_replicate", "dp_shard"))
    grid = ranks._unflatten(0, (dp_replicate, shard // ep, ep), ("dp_replicate", "expert_shard", "ep"))
    replicated = dp_replicate > 1
    return Meshes(
        dense=dense if replicated else dense["dp_shard"],
        expert_shard=grid["dp_replicate", "expert_shard"] if replicated else grid["expert_shard"],
        ep=grid["ep"],
    )


def grid_ranks(world: int, ep: int, dp_replicate: int = 1) -> torch.Tensor:
    """The ranks of the (dp_replicate, expert_shard, ep) grid as ``build_meshes`` lays them out (filled row by
    row): rank r at (r // S, (r % S) // ep, r % ep), S = world / dp_replicate."""
    return torch.arange(world).reshape(dp_replicate, world // dp_replicate // ep, ep)
