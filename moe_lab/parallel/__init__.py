"""Parallelism applied to a model from outside: expert parallelism, activation checkpointing, compile, FSDP2."""

from __future__ import annotations

import torch
import torch.distributed as dist

from moe_lab.moe.router import Router
from moe_lab.parallel.compile import apply_compile, compile_loss
from moe_lab.parallel.expert_parallel import apply_expert_parallel
from moe_lab.parallel.fsdp import apply_fsdp, set_micro_batch
from moe_lab.parallel.mesh import build_meshes

__all__ = ["compile_loss", "parallelize", "set_micro_batch"]


def parallelize(
    model: torch.nn.Module,
    dispatcher,
    ac,
    *,
    ep: int,
    compile: bool,
    device: torch.device,
    compute_dtype: torch.dtype,
    keep_unsharded: bool = False,
) -> None:
    """In torchtitan's order: EP, then AC, then compile, then FSDP. A single rank gets no process group at all."""
    meshes = build_meshes(device.type, ep) if dist.is_initialized() and dist.get_world_size() > 1 else None
    ep_group = meshes.ep.get_group() if meshes is not None and ep > 1 else None
    ep_rank = meshes.ep.get_local_rank() if meshes is not None else 0
    dispatcher.set_ep_group(ep_group)
    apply_expert_parallel(model, dispatcher, ep_rank, ep)
    # ac=selective keeps the routing decisions and the dispatcher's collectives: recompute never re-routes or
    # re-communicates.
    ac.apply(model, saved_ops={"router": Router.saved_ops, "dispatcher": dispatcher.saved_ops})
    if compile:
        apply_compile(model)
    if meshes is not None:
        apply_fsdp(model, meshes, compute_dtype, keep_unsharded)
