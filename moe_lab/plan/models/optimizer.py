"""The optimizer group's models: state bytes per parameter, the step's HBM traffic and temporaries."""

from __future__ import annotations

import torch

from moe_lab.optim.optimizers import SignSGD
from moe_lab.plan.memory import Step
from moe_lab.plan.models import OptionModel, planner_model

ADAMW_BYTES = 28  # fp32 param, grad, exp_avg, exp_avg_sq read; param and moments written
FOREACH_ADAMW_BYTES = 60  # the same through foreach kernels, one pass per op


@planner_model("optimizer", torch.optim.AdamW)
class AdamWPlan(OptionModel):
    name = "adamw"
    state_bytes = 8  # exp_avg, exp_avg_sq in fp32

    @property
    def foreach(self) -> bool:
        """Without fused=true: torch's foreach path (the option is a partial of AdamW)."""
        return not self.option.keywords.get("fused", False)

    def device_step_bytes(self, step: Step) -> float:
        """HBM traffic of its step per parameter on the device."""
        return FOREACH_ADAMW_BYTES if self.foreach else ADAMW_BYTES

    def step_temporaries(self, step: Step, params: float) -> float:
        """Device bytes its step allocates over ``params`` parameters: foreach AdamW's sqrt(exp_avg_sq) of every
        parameter at once."""
        return 4 * params if self.foreach else 0.0


@planner_model("optimizer", SignSGD)
class SignSGDPlan(OptionModel):
    name = "signsgd"
    state_bytes = 0

    def device_step_bytes(self, step: Step) -> float:
        return 12

    def step_temporaries(self, step: Step, params: float) -> float:
        return 0.0
