"""FSDP2 per decoder block, embedding, and final norm + LM head; experts on their own sub-mesh."""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from moe_lab.parallel.mesh import Meshes


def apply_fsdp(model, meshes: Meshes, compute_dtype: torch.dtype, reshard_after_forward: bool = True) -> None:
    """Dense weights are sharded over a replica's ranks and averaged over all ranks. Expert weights are sharded over
    the replica's ``expert_shard`` ranks only; their gradients already sum the tokens of every EP peer, so they are
    summed over ``expert_shard`` (and the replicas) and divided by the whole world to give the same
    mean-over-the-global-batch as dense weights. With ``parallel.dp_replicate`` > 1 the meshes are 2-D and FSDP2
    runs HSDP: each gradient is reduce-scattered inside the replica, then all-reduced across replicas.

    The experts' FSDP hooks fire at the block's boundary: the experts module is never called (the block reads its
    weights and hands them to the dispatcher), and a compiled block has no FSDP hook inside it and compiles as one
    graph. The experts are gathered when their block starts and resharded when it ends (the block's pre-backward
    hook gathers them again before recompute and backward).

    ``reshard_after_forward`` (``parallel.reshard_after_forward``, FSDP2's own) false: no group reshards after
    forward, so backward gathers nothing again (and, with ``set_micro_batch``, nothing is gathered again until the
    step's last backward).
    """
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    # Embedding, blocks, and final norm + LM head each their own group (as torchtitan does): the head's gradient
    # (1.2 GB fp32 for Qwen3's vocabulary) is reduce-scattered while the blocks' backward runs, not after it, and
    # the head stays gathered from its forward into backward, which starts with it.
    reshard = reshard_after_forward
    fully_shard(model.model.embed_tokens, mesh=meshes.dense, mp_policy=policy, reshard_after_forward=reshard)
    for layer in model.model.layers:
        experts = layer.mlp.experts
        fully_shard(experts, mesh=meshes.expert_shard, mp_policy=policy, reshard_after_forward=reshard)
        experts.set_gradient_divide_factor(float(meshes.world_size))
        if meshes.expert_shard.size(meshes.expert_shard.ndim - 1) > 1:
            # Sum, then divide the shard: gloo has no PREMUL_SUM, and on NCCL the divide is one small kernel.
            # (Not on a shard of one rank: FSDP2 then skips the reduce-scatter, divides as it copies, and would
            # divide again after the replicas' all-reduce.)
            experts.set_force_sum_reduction_for_comms(True)
        _hook_at(layer, fully_shard.state(experts))
        fully_shard(layer, mesh=meshes.dense, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard([model.model.norm, model.lm_head], mesh=meshes.dense, mp_policy=policy, reshard_after_forward=False)
    fully_shard(model, mesh=meshes.dense, mp_policy=policy, reshard_after_forward=reshard)
    _prefetch_explicitly(model)


def _prefetch_explicitly(model) -> None:
    """Each group gathers the next one's weights as it starts (forward: embedding, blocks with their experts, head;
    backward the reverse). FSDP2 otherwise issues a group's all-gather only when the CPU reaches that group, and the
    dispatchers read row counts back to the host once per layer (the fused op's layout, the torch dispatcher's
    all-to-all splits): the CPU then arrives late and the all-gather waits exposed (16.7 ms a step on two H200s with
    the fused op, grid_30b's 2026-12-01_01-15 record). torchtitan sets the same order under EP for the same reason."""
    # Each entry: the modules of one step of the order, the first one's FSDP state being the step's own. norm and
    # lm_head share one state (one fully_shard call), so the head step names lm_head alone.
    steps = (
        [[model.model.embed_tokens]] + [[layer, layer.mlp.experts] for layer in model.model.layers] + [[model.lm_head]]
    )
    for current, following in zip(steps, steps[1:]):
        current[0].set_modules_to_forward_prefetch(following)
    for current, preceding in zip(steps[1:], steps[:-1]):
        current[0].set_modules_to_backward_prefetch(preceding)


def set_micro_batch(model: torch.nn.Module, final: bool, grad_sync: str, reshard_after_forward: bool) -> None:
    """Before each micro-batch of an optimizer step (``trainer.grad_accum``). ``grad_sync="step"``: FSDP2
    reduces the gradients in the final micro-batch's backward only; before it they accumulate unsharded (in the fp32
    reduce dtype), so a step reduces once. ``"micro_batch"``: every backward reduce-scatters, and the sharded
    gradients accumulate; across replicas (HSDP) they are all-reduced in the final backward only. With
    ``reshard_after_forward`` false the blocks stay gathered after every backward but the final one. A model
    without FSDP2 (one rank) accumulates in ``.grad`` as autograd does: nothing to set."""
    if not isinstance(model, FSDPModule):
        return
    model.set_requires_gradient_sync(final or grad_sync == "micro_batch")
    model.set_requires_all_reduce(final)  # a no-op without replicas
    if not reshard_after_forward:
        model.set_reshard_after_backward(final)


def replica_group(model: torch.nn.Module):
    """The process group of this rank's replica (every gradient element lives once on its ranks: the group a global
    gradient norm sums over), or None for a model without FSDP2."""
    if not isinstance(model, FSDPModule):
        return None
    mesh = next(p for p in model.parameters() if isinstance(p, DTensor)).device_mesh
    return mesh.get_group(mesh.ndim - 1)


def _hook_at(module: torch.nn.Module, state) -> None:
    """Move an FSDP state's forward hooks from its own module to ``module`` (an ancestor). FSDP2 has no public API
    for this; the hook handles are the ones ``fully_shard`` registered (torch 2.11 to 2.13 alike)."""
    state._pre_forward_hook_handle.remove()
    state._post_forward_hook_handle.remove()
    state._pre_forward_hook_handle = module.register_forward_pre_hook(
        state._pre_forward, prepend=True, with_kwargs=True
    )
    state._post_forward_hook_handle = module.register_forward_hook(state._post_forward, prepend=False)
