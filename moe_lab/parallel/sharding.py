"""What one rank holds of a (possibly FSDP2- or EP-sharded) tensor."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank holds: a DTensor's local shard (same storage), else ``t`` itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def first_row(t: torch.Tensor) -> int:
    """Index, in the whole tensor, of the first row (dim 0) of this rank's shard: FSDP2 shards dim 0 into contiguous
    row ranges."""
    if not isinstance(t, DTensor):
        return 0
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


def _mesh_like(mesh: DeviceMesh, device_type: str) -> DeviceMesh:
    """``mesh``'s ranks for tensors on ``device_type``: the mesh itself, or a description of the same ranks that
    creates no process group (DCP and DTensor's shape arithmetic need only the ranks)."""
    if mesh.device_type == device_type:
        return mesh
    return _rank_mesh(device_type, tuple(mesh.mesh.flatten().tolist()), tuple(mesh.mesh.shape), mesh.mesh_dim_names)


def _rank_mesh(
    device_type: str, ranks: tuple[int, ...], shape: tuple[int, ...], names: tuple[str, ...] | None
) -> DeviceMesh:
    # A DeviceMesh holds this process's rank and its coordinates from when it was built: the cache is per rank (a
    # sweep of emulated ranks is one process whose rank changes from point to point).
    return _rank_mesh_of(dist.get_rank() if dist.is_initialized() else 0, device_type, ranks, shape, names)


@functools.cache
def _rank_mesh_of(
    rank: int, device_type: str, ranks: tuple[int, ...], shape: tuple[int, ...], names: tuple[str, ...] | None
) -> DeviceMesh:
    return DeviceMesh(device_type, torch.tensor(ranks).reshape(shape), mesh_dim_names=names, _init_backend=False)


def shaped_like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local``, a tensor of the shape of this rank's piece of ``param``, shaped like ``param``: a DTensor with its
    placements and global shape where ``param`` is a DTensor, sharing ``local``'s storage wherever that lives (host
    memory for offloaded optimizer state); ``local`` itself otherwise."""
    if not isinstance(param, DTensor):
        return local
    mesh = _mesh_like(param.device_mesh, local.device.type)
    return DTensor.from_local(local, mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride())


class GlobalLayout:
    """Where each parameter's piece on this rank sits in the whole parameter, for checkpoints that any mesh shape
    reads back (``torch.distributed.checkpoint`` reshards by it).

    Dense parameters are FSDP2's DTensors already (with replicas, Replicate() over dp_replicate: DCP writes one
    replica's pieces and every replica reads them). An expert stack is a DTensor of the EP-local stack over the
    expert_shard ranks (and dp_replicate); in the whole [num_experts, ...] stack its rows are first split over the
    EP ranks, then sharded over expert_shard, which is a DTensor over the ([dp_replicate,] ep, expert_shard) grid
    with Shard(0) on both. At one rank every parameter is whole. So the layout on disk is the whole model's,
    whatever the world, EP degree or number of replicas that wrote it.
    """

    def __init__(self, model: torch.nn.Module):
        from moe_lab.moe.experts import GroupedExperts
        from moe_lab.parallel.mesh import grid_ranks

        self.params: dict[str, torch.Tensor] = {}
        self._placement: dict[str, tuple] = {}  # name -> (ranks, dim names, placements, global shape)
        for module_name, module in model.named_modules():
            for name, p in module.named_parameters(recurse=False):
                name = f"{module_name}.{name}" if module_name else name
                self.params[name] = p
                if not isinstance(p, DTensor):
                    continue
                if isinstance(module, GroupedExperts):
                    ep = module.num_experts // module.num_local_experts
                    mesh = p.device_mesh
                    replicas = mesh.size(0) if mesh.ndim == 2 else 1
                    ranks = grid_ranks(mesh.size() * ep, ep, replicas).transpose(1, 2)  # (replica, ep, shard)
                    names, placements = ("ep", "expert_shard"), (Shard(0), p.placements[-1])
                    if mesh.ndim == 2:
                        names, placements = ("dp_replicate", *names), (p.placements[0], *placements)
                    else:
                        ranks = ranks[0]
                    shape = torch.Size((module.num_experts, *p.shape[1:]))
                    self._placement[name] = (ranks, names, placements, shape)
                else:
                    self._placement[name] = (p.device_mesh.mesh, p.device_mesh.mesh_dim_names, p.placements, p.shape)
        rows = local_rows(model)
        for name in self._placement:  # the layout must agree with where the model put each piece
            view = self.view(name, local_shard(self.params[name]).detach())
            _, offset = compute_local_shape_and_global_offset(view.shape, view.device_mesh, view.placements)
            if view.to_local().numel() and offset[0] != rows[name][1]:
                raise AssertionError(
                    f"{name}: the checkpoint layout puts this rank's rows at {offset[0]}, the model at {rows[name][1]}"
                )

    def shape(self, name: str) -> torch.Size:
        """The whole parameter's shape."""
        return self._placement[name][3] if name in self._placement else self.params[name].shape

    def local_shape(self, name: str) -> torch.Size:
        return local_shard(self.params[name]).shape

    def view(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """``local`` (shaped like this rank's piece of parameter ``name``: the parameter itself, its gradient, an
        optimizer state of it) as this rank's piece of the whole parameter, sharing ``local``'s storage."""
        if name not in self._placement:
            return local
        ranks, names, placements, shape = self._placement[name]
        mesh = _rank_mesh(local.device.type, tuple(ranks.flatten().tolist()), tuple(ranks.shape), names)
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)
