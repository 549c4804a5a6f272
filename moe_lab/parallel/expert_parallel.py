"""Expert parallelism applied from outside the model: each MoE block keeps its rank's slice of every expert stack
and gets the dispatcher that moves tokens over the EP group."""

from __future__ import annotations

from torch import nn

from moe_lab.models.qwen3_moe import SparseMoeBlock
from moe_lab.moe.dispatcher import TokenDispatcher
from moe_lab.moe.experts import GroupedExperts


def apply_expert_parallel(model: nn.Module, dispatcher: TokenDispatcher, ep_rank: int, ep_size: int) -> None:
    for block in model.modules():
        if isinstance(block, SparseMoeBlock):
            keep_local_experts(block.experts, ep_rank, ep_size)
            block.dispatcher = dispatcher


def keep_local_experts(experts: GroupedExperts, ep_rank: int, ep_size: int) -> None:
    """Replace each expert stack by EP rank ``ep_rank``'s consecutive share of it."""
    local = experts.num_experts // ep_size
    for name, param in list(experts.named_parameters(recurse=False)):
        local_stack = param.detach()[ep_rank * local : (ep_rank + 1) * local]
        setattr(experts, name, nn.Parameter(local_stack.clone(), requires_grad=param.requires_grad))
    experts.expert_offset = ep_rank * local
