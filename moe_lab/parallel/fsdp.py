"""FSDP2 per decoder block; experts on their own sub-mesh."""

from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from moe_lab.parallel.mesh import Meshes


def apply_fsdp(model, meshes: Meshes, compute_dtype: torch.dtype) -> None:
    """Dense weights are sharded over all ranks and averaged over all ranks. Expert weights are sharded over the
    ``expert_shard`` ranks only; their gradients already sum the tokens of every EP peer, so they are summed over
    ``expert_shard`` and divided by the whole world to give the same mean-over-the-global-batch as dense weights."""
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        experts = layer.mlp.experts
        fully_shard(experts, mesh=meshes.expert_shard, mp_policy=policy, reshard_after_forward=True)
        experts.set_gradient_divide_factor(float(meshes.world_size))
        fully_shard(layer, mesh=meshes.dense, mp_policy=policy, reshard_after_forward=True)
    fully_shard(model, mesh=meshes.dense, mp_policy=policy, reshard_after_forward=True)
