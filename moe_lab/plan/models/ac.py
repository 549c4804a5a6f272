"""The ac group's models: what each activation checkpointing mode keeps of a block's forward for its backward, and
what backward runs again."""

from __future__ import annotations

import dataclasses
import functools

from moe_lab.moe.router import Router
from moe_lab.parallel.ac import FullCheckpoint, NoCheckpoint, SelectiveCheckpoint, kept_ops
from moe_lab.plan.memory import Step, op_outputs, saved_per_layer
from moe_lab.plan.models import OptionModel, planner_model


@planner_model("ac", NoCheckpoint)
class NoCheckpointPlan(OptionModel):
    name = "none"
    recompute_passes = 0.0  # forwards of the whole block backward runs again, beyond the one
    keeps_elementwise = True  # autograd keeps the elementwise outputs backward reads

    @property
    def offload_activations(self) -> bool:
        """``ac.offload_activations``: the saved tensors to pinned host memory in forward, back ahead of backward."""
        return self.option.offload_activations

    def recomputed(self, step: Step, part: str) -> float:
        """Forward passes of ``part`` (dense | attention | dispatcher | experts) backward runs again."""
        return self.recompute_passes

    def keeps(self, op, step: Step) -> bool:
        """Whether the block keeps ``op``'s outputs for backward: every output backward reads."""
        return op not in step.dispatcher.unread_ops

    def recompute_workspace(self, step: Step) -> float:
        return 0.0


@functools.cache
def _kept_ops(keep: tuple, dispatcher_ops: frozenset) -> frozenset:
    return kept_ops(keep, {"router": Router.saved_ops, "dispatcher": dispatcher_ops})


@planner_model("ac", SelectiveCheckpoint)
class SelectiveCheckpointPlan(NoCheckpointPlan):
    name = "selective"
    keeps_elementwise = False

    def saved_ops(self, step: Step) -> frozenset:
        """The ops whose outputs it keeps: those of its ``keep`` sets, the router's and the dispatcher's declared
        ones included (``moe_lab.parallel.ac.kept_ops``, as ``parallelize`` gives them)."""
        return _kept_ops(tuple(self.option.keep), step.dispatcher.declared_ops)

    def keeps(self, op, step: Step) -> bool:
        return op in self.saved_ops(step)

    def recomputed(self, step: Step, part: str) -> float:
        # those of the sets ac.keep leaves out (the experts: the set the dispatcher's expert GEMMs are in)
        needs = {"dense": "matmul", "attention": "attention", "dispatcher": "dispatcher"}.get(part)
        if part == "experts":
            needs = step.dispatcher.expert_keep_set(step)
        return 0.0 if needs in self.option.keep else 1.0

    def recompute_workspace(self, step: Step) -> float:
        """The outputs of the sets ac.keep leaves out, recomputed for one layer."""
        return sum(sum(sizes) for op, sizes in op_outputs(step).items() if not self.keeps(op, step))


@planner_model("ac", FullCheckpoint)
class FullCheckpointPlan(NoCheckpointPlan):
    name = "full"
    recompute_passes = 1.0
    keeps_elementwise = False
    offload_activations = False

    def keeps(self, op, step: Step) -> bool:
        return False

    def recompute_workspace(self, step: Step) -> float:
        """Backward's recomputed forward of one block: what that block keeps without AC."""
        return saved_per_layer(dataclasses.replace(step, ac=NoCheckpointPlan(NoCheckpoint())))
