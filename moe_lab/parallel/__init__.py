"""Parallelism applied to a model from outside: the precision recipe's conversion (``precision``), expert parallelism,
activation checkpointing, compile, FSDP2."""

from __future__ import annotations

import torch
import torch.distributed as dist

from moe_lab.moe.router import Router
from moe_lab.parallel.compile import apply_compile, compile_loss
from moe_lab.parallel.expert_parallel import apply_expert_parallel
from moe_lab.parallel.fsdp import apply_fsdp, replica_group, set_micro_batch
from moe_lab.parallel.mesh import build_meshes
from moe_lab.parallel.precision import Precision

__all__ = ["compile_loss", "parallelize", "replica_group", "set_micro_batch"]


def parallelize(
    model: torch.nn.Module,
    dispatcher,
    ac,
    *,
    ep: int,
    compile: bool,
    device: torch.device,
    compute_dtype: torch.dtype,
    precision: Precision | None = None,
    dp_replicate: int = 1,
    reshard_after_forward: bool = True,
) -> None:
    """In torchtitan's order: the precision option's conversion (None: the linears as built), EP, AC, compile, then
    FSDP. A single rank gets no process group at all."""
    if precision is not None:
        precision.apply(model)
    meshes = (
        build_meshes(device.type, ep, dp_replicate) if dist.is_initialized() and dist.get_world_size() > 1 else None
    )
    ep_group = meshes.ep.get_group() if meshes is not None and ep > 1 else None
    ep_rank = meshes.ep.get_local_rank() if meshes is not None else 0
    dispatcher.set_ep_group(ep_group)
    apply_expert_parallel(model, dispatcher, ep_rank, ep)
    # ac=selective keeps the routing decisions and the dispatcher's collectives: recompute never re-routes or
    # re-communicates.
    # ... and FP8 dense GEMMs are matmuls: ac.keep's matmul set keeps them too.
    matmuls = precision.matmul_ops if precision is not None else frozenset()
    ac.apply(model, saved_ops={"router": Router.saved_ops, "dispatcher": dispatcher.saved_ops, "matmul": matmuls})
    if compile:
        apply_compile(model)
    if meshes is not None:
        apply_fsdp(model, meshes, compute_dtype, reshard_after_forward)
