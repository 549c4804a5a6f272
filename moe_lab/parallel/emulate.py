"""One process acting as rank r of an N-rank job (``parallel.emulate``): a ``torch.distributed`` backend whose
stand-in peers mirror this rank.

Every peer holds what this rank holds and sends what this rank sends, so each collective's output has the size, and
each kernel after it the work, it has on the real mesh, on every group of it (``world`` below is the group's size:
an HSDP mesh's replicas all-reduce what its shards reduce-scattered, each mirrored): an all-gather returns this rank's input once per peer, a
reduce-scatter this rank's own chunk reduced over ``world`` equal contributions (a sum is ``world`` times it, a mean
or max the chunk itself), an all-to-all delivers from every peer the rows this rank sends to itself, so the counts a
dispatcher exchanges are this rank's counts and the rows it receives are what it would receive if every rank routed
like it. Broadcasts and barriers have nothing to do (a broadcast leaves this rank's tensor as it is: a value only
the root knows, as ``broadcast_object_list`` sends, is this process's own, and its callers take it so). Nothing
moves on a wire: that time comes from the planner (``moe_lab.plan.emulated``). Where a caller's receive split asks
for more rows from a peer than this rank sends to itself (uneven routing), the rest of that peer's rows are zeros;
fewer, the first rows are kept.

The group also lends the fused dispatcher's symmetric memory (``symmetric_empty``): a peer's buffer is this rank's
own buffer, and barriers return at once. Losses of an emulated run are not a model's: a gathered weight is ``world``
copies of this rank's shard.
"""

from __future__ import annotations

import functools
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ReduceOp, _create_work_from_future
from torch.distributed.tensor.debug import _clear_sharding_prop_cache
from torch.futures import Future

from moe_lab.runtime.device import Target, machine_target

BACKEND = "emulated"
NOTE = (
    "emulated: one process as one rank of the mesh, stand-in peers mirror it; losses are not a model's, collectives "
    "move nothing on a wire (planned_exposed_comm_s adds the planner's)"
)


def emulated_target(nproc_per_node: int, nodes: int, outer_launcher: bool = False) -> Target:
    """What an emulated rank is validated for: the layout's ranks (``nodes`` x ``nproc_per_node``) on this machine's
    device, as the real job would see them."""
    return machine_target(nproc_per_node * nodes, nproc_per_node, outer_launcher=outer_launcher)


def _done(result=None):
    future = Future()
    future.set_result(result)
    return _create_work_from_future(future)


def _reduced(t: torch.Tensor, op, world: int) -> torch.Tensor:
    """``world`` equal contributions ``t`` reduced by ``op`` (a ``ReduceOp``), in place."""
    kind = getattr(op, "op", op)
    if kind == ReduceOp.SUM:
        return t.mul_(world)
    if kind == ReduceOp.PREMUL_SUM:  # NCCL's scaled sum (FSDP2's gradient divide)
        return t.mul_(op.factor * world)
    if kind == ReduceOp.PRODUCT:
        return t.pow_(world)
    if kind in (ReduceOp.AVG, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.BAND, ReduceOp.BOR):
        return t
    raise NotImplementedError(f"the emulated process group has no reduction {kind}")


def _mirror_rows(out: torch.Tensor, src: torch.Tensor) -> None:
    """``out`` <- ``src``'s rows, as many as fit; rows past ``src``'s are zeros."""
    rows = min(out.shape[0], src.shape[0])
    out[:rows].copy_(src[:rows])
    out[rows:].zero_()


def _split(t: torch.Tensor, sizes, world: int) -> list[torch.Tensor]:
    return list(t.split(list(sizes))) if sizes else list(t.chunk(world))


class EmulatedProcessGroup(dist.ProcessGroup):
    """Rank ``rank`` of a group of ``world`` ranks whose other members mirror it (the module's docstring)."""

    def __init__(self, rank: int, world: int):
        super().__init__(rank, world)
        self._rank, self._world = rank, world

    def getBackendName(self) -> str:
        return BACKEND

    # torch.distributed names a Python group through these (the C++ base keeps no name for it).
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:
        return self._group_name

    def size(self) -> int:
        return self._world

    # --- reductions ---------------------------------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        for t in tensors:
            _reduced(t, opts.reduceOp, self._world)
        return _done(tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def reduce(self, tensors, opts=None):
        if opts.rootRank == self._rank:
            for t in tensors:
                _reduced(t, opts.reduceOp, self._world)
        return _done(tensors)

    def reduce_scatter(self, outputs, inputs, opts=None):
        for out, chunks in zip(outputs, inputs):
            _reduced(out.copy_(chunks[self._rank]), opts.reduceOp, self._world)
        return _done(outputs)

    def _reduce_scatter_base(self, out, inp, opts=None):
        _reduced(out.copy_(inp.chunk(self._world)[self._rank].view_as(out)), opts.reduceOp, self._world)
        return _done(out)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        for out, inp in zip(outputs, inputs):
            self._reduce_scatter_base(out, inp, opts)
        return _done(outputs)

    # --- gathers ------------------------------------------------------------------------------------------------
    def allgather(self, outputs, inputs, opts=None):
        for outs, inp in zip(outputs, inputs):
            for out in outs:
                out.copy_(inp)
        return _done(outputs)

    def _allgather_base(self, out, inp, opts=None):
        for chunk in out.chunk(self._world):
            chunk.copy_(inp.view_as(chunk))
        return _done(out)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        for out, inp in zip(outputs, inputs):
            self._allgather_base(out, inp, opts)
        return _done(outputs)

    def allgather_coalesced(self, outputs, inputs, opts=None):
        for outs in outputs:
            for out, inp in zip(outs, inputs):
                out.copy_(inp)
        return _done(outputs)

    def gather(self, outputs, inputs, opts=None):
        if opts.rootRank == self._rank:
            for outs, inp in zip(outputs, inputs):
                for out in outs:
                    out.copy_(inp)
        return _done(outputs)

    # --- exchanges ----------------------------------------------------------------------------------------------
    def alltoall_base(self, out, inp, output_split_sizes, input_split_sizes, opts=None):
        own = _split(inp, input_split_sizes, self._world)[self._rank]
        for chunk in _split(out, output_split_sizes, self._world):
            _mirror_rows(chunk, own)
        return _done(out)

    def alltoall(self, outputs, inputs, opts=None):
        for out in outputs:
            _mirror_rows(out, inputs[self._rank])
        return _done(outputs)

    def broadcast(self, tensors, opts=None):
        return _done(tensors)  # the root holds what this rank holds

    def scatter(self, outputs, inputs, opts=None):
        if inputs:  # the root: its chunk for this rank; elsewhere the root's chunk is this rank's own value
            for out, chunks in zip(outputs, inputs):
                out.copy_(chunks[self._rank])
        return _done(outputs)

    def barrier(self, opts=None):
        return _done()

    # torch 2.13 names the tensor forms so; torch 2.11 (the GPU machines) by the names above.
    all_gather_single = _allgather_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced
    reduce_scatter_single = _reduce_scatter_base
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced
    all_to_all_single = alltoall_base

    # --- the fused dispatcher's symmetric memory ----------------------------------------------------------------
    def symmetric_empty(self, shape, dtype, device):
        """-> (this rank's buffer, every peer's buffer address: this one's, a barrier that returns at once), the
        triple ``moe_lab.moe.fused.gpu.symmetric_empty`` returns for torch symmetric memory. What this rank writes
        for a peer lands in its own buffer, inside the group's largest receive buffer the workspace is sized by; a
        stand-in peer's rows in this rank's receive buffer stay padding (their copies are the wire's, which the
        planner adds). Zeroed once, so a row this rank reads for a peer that it never wrote is finite."""
        local = torch.zeros(shape, dtype=dtype, device=device)
        ptrs = torch.full((self._world,), local.data_ptr(), dtype=torch.int64, device=device)
        return local, ptrs, _no_barrier


def _no_barrier(*args, **kwargs) -> None:
    return None


def _create(store, rank: int, world: int, timeout: timedelta) -> EmulatedProcessGroup:
    return EmulatedProcessGroup(rank, world)


@functools.cache
def register() -> None:
    dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])


def emulated_layout(cfg) -> dict | None:
    """What the record says of an emulated point (``emulated``): the layout's world, this process's rank in it, its
    mesh (replicas, shards per replica, EP, FSDP2's reshard choice); None when ``parallel.emulate`` is off."""
    p, nproc = cfg.parallel, cfg.trainer.nproc_per_node
    if not p.emulate:
        return None
    world = nproc * p.emulate_nodes
    shard = world // p.dp_replicate
    mesh = {
        "nodes": p.emulate_nodes,
        "gpus_per_node": nproc,
        "dp_replicate": p.dp_replicate,
        "dp_shard": shard,
        "ep": p.ep,
        "expert_shard": shard // p.ep,
        "reshard_after_forward": p.reshard_after_forward,
    }
    return {"world": world, "rank": p.emulate_rank, "mesh": mesh, "hardware": p.emulate_hardware, "note": NOTE}


def enter_world(emulated: dict | None) -> None:
    """Before a point's process group is made: the emulated group of ``emulated`` (``emulated_layout``), or none left
    over from an earlier emulated point of the sweep."""
    if emulated is not None:
        init_emulated_world(emulated["rank"], emulated["world"])
    elif is_emulated():
        dist.destroy_process_group()


def init_emulated_world(rank: int, world: int) -> None:
    """Make this process rank ``rank`` of an emulated default group of ``world`` ranks (a sweep's next point may
    ask for another one)."""
    register()
    if dist.is_initialized():
        if dist.get_backend() == BACKEND and (dist.get_rank(), dist.get_world_size()) == (rank, world):
            return
        dist.destroy_process_group()
    # DTensor caches each op's output placements by its inputs' meshes, and meshes of the same ranks compare equal
    # whichever rank built them: a mesh of the last point's rank (and its coordinates) would come back.
    _clear_sharding_prop_cache()
    dist.init_process_group(BACKEND, store=dist.HashStore(), rank=rank, world_size=world)


def is_emulated(group: dist.ProcessGroup | None = None) -> bool:
    return dist.is_initialized() and dist.get_backend(group) == BACKEND
