"""Expert parallelism applied from outside the model: keep this rank's slice of every expert stack and hand each
MoE layer the dispatcher that moves tokens over the EP group."""

from __future__ import annotations

from torch import nn

from moe_lab.moe.layer import GroupedExperts


def apply_expert_parallel(model: nn.Module, dispatcher, ep_rank: int, ep_size: int) -> None:
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            local = module.num_experts // ep_size
            for name, param in list(module.named_parameters(recurse=False)):
                sliced = param.detach()[ep_rank * local : (ep_rank + 1) * local]
                setattr(module, name, nn.Parameter(sliced.clone(), requires_grad=param.requires_grad))
            module.expert_offset = ep_rank * local
            module.dispatcher = dispatcher
