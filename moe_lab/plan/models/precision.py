"""The precision group's models. The experts' precision is the dispatchers' (``expert_precision``,
``models.dispatcher``); a precision option's model says which dense GEMMs run in FP8: their forward and backward at
``hardware.fp8_dense_gemm_efficiency`` of the FP8 peak, a rate that holds the FP8 casts of their inputs, weights and
gradients (calibrate measures it so). Memory as at bf16: torchao's float8 linears keep the same high-precision input
for backward."""

from __future__ import annotations

from moe_lab.parallel.precision import Bf16Dense, Fp8Dense
from moe_lab.plan.memory import Step
from moe_lab.plan.models import OptionModel, planner_model


@planner_model("precision", Bf16Dense)
class Bf16DensePlan(OptionModel):
    name = "bf16"

    def fp8_dense_flops(self, step: Step) -> float:
        """One micro-batch's forward FLOPs of the dense linears in FP8 (a part of ``Shapes.layer_dense_flops``)."""
        return 0.0


@planner_model("precision", Fp8Dense)
class Fp8DensePlan(Bf16DensePlan):
    name = "fp8"

    def fp8_dense_flops(self, step: Step) -> float:
        c = step.cfg
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        sizes = {"q_proj": q, "k_proj": kv, "v_proj": kv, "o_proj": q}
        return c.num_layers * 2 * step.tokens * c.hidden_size * sum(sizes[name] for name in self.option.linears)
