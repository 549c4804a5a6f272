"""The ``precision`` group: which GEMMs of the step run in FP8, one switch for the recipe (``precision=bf16 |
fp8_experts | fp8``), applied to the model from outside as ``moe_lab.parallel.parallelize`` applies EP, AC,
compile and FSDP2 (first of them: the conversion swaps modules, the rest wraps and shards what it finds).

- ``bf16``: every GEMM in bf16 (autocast on one rank, FSDP2's parameter dtype on more).
- ``fp8_experts``: the routed experts' GEMMs in blockwise FP8 (``dispatcher.expert_precision=fp8``, docs/fp8.md):
  every option names the experts' precision (``experts``) and the dispatchers' yamls take theirs from it
  (``expert_precision: ${precision.experts}``), so a command line's ``dispatcher.expert_precision=...`` still wins.
- ``fp8``: ``fp8_experts`` and the attention projections (``self_attn.{q,k,v,o}_proj`` of every block) in FP8
  through torchao's float8 training (``convert_to_float8_training`` with a module filter; ``recipe=blockwise``:
  torchao's blockwise prototype, ``Float8BlockwiseLinear``, DeepSeek-V3's 1x128 / 128x128 tiles); torchao documents
  both as composing with FSDP2 and ``torch.compile``.

Kept in bf16 / fp32 in every option: the router, the LM head, the embedding, attention's core (flash attention), the
loss and the optimizer (masters and moments fp32). The parameters keep their names, dtype and values: checkpoints,
the export and the optimizer see the same model.
"""

from __future__ import annotations

from typing import Literal, Protocol, runtime_checkable

import torch

from moe_lab.runtime.device import Target
from moe_lab.runtime.errors import ConfigError

_aten = torch.ops.aten
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
# torchao's recipe -> (the compute capability its GEMMs need, the multiple each linear's sides must be)
RECIPES = {"tensorwise": ((8, 9), 16), "rowwise": ((8, 9), 16), "blockwise": ((9, 0), 128)}
# The FP8 GEMMs ac=selective keeps as ``matmul`` (torchao's tensorwise and rowwise GEMMs are ``_scaled_mm``; its
# blockwise prototype's ``torch.nn.functional.scaled_mm`` is ``_scaled_mm_v2``).
FP8_MATMULS = frozenset(
    getattr(_aten, name).default for name in ("_scaled_mm", "_scaled_mm_v2") if hasattr(_aten, name)
)


@runtime_checkable
class Precision(Protocol):
    """What a ``precision`` option provides. Validation calls ``validate``; ``moe_lab.parallel.parallelize`` calls
    ``apply`` once on the built model, before expert parallelism, AC, compile and FSDP2, and adds ``matmul_ops`` to
    the matmuls ac=selective keeps (``ac.keep``'s ``matmul`` set). ``experts`` is the routed experts' precision,
    which the dispatchers' ``expert_precision`` follows through the config (the dispatcher applies it)."""

    experts: Literal["bf16", "fp8"]
    matmul_ops: frozenset

    def validate(self, cfg, target: Target) -> None:
        """Refuse, with a ``ConfigError`` naming the key, a composed config whose dense GEMMs this option cannot run
        on ``target``; the default accepts every config."""

    def apply(self, model) -> None:
        """Convert, in place, the model's dense linears this option runs in another precision; the default converts
        none."""


class Bf16Dense(Precision):
    """The dense linears in bf16, as built (``precision=bf16``; ``fp8_experts``: its experts in FP8)."""

    matmul_ops = frozenset()

    def __init__(self, experts: Literal["bf16", "fp8"] = "bf16"):
        self.experts = experts


class Fp8Dense(Precision):
    """The attention projections in FP8 through torchao's float8 training (``precision=fp8``, with FP8 experts).

    ``recipe``: ``tensorwise`` (one dynamic scale per tensor), ``rowwise`` (per row of each GEMM operand, its
    weight gradient's operands too) or ``blockwise`` (1x128 activation and 128x128 weight tiles, torchao's
    prototype). ``linears``: which of the projections (default all four). ``experts``: fp8 (``precision.experts=bf16``
    leaves the experts in bf16)."""

    matmul_ops = FP8_MATMULS

    def __init__(
        self,
        experts: Literal["bf16", "fp8"] = "fp8",
        recipe: Literal["tensorwise", "rowwise", "blockwise"] = "rowwise",
        linears: list[Literal["q_proj", "k_proj", "v_proj", "o_proj"]] = PROJECTIONS,
    ):
        if not linears:
            raise ConfigError("precision.linears", f"some of {', '.join(PROJECTIONS)}; got none")
        self.experts, self.recipe, self.linears = experts, recipe, tuple(linears)

    def converts(self, fqn: str) -> bool:
        """Whether the module at ``fqn`` (a name of ``model.named_modules()``) is one this option converts."""
        *parent, name = fqn.split(".")
        return bool(parent) and parent[-1] == "self_attn" and name in self.linears

    def validate(self, cfg, target: Target) -> None:
        capability, multiple = RECIPES[self.recipe]
        key = "precision"
        if not target.runs_on_cuda(cfg.trainer):
            raise ConfigError(
                key,
                f"fp8 runs the attention projections through torchao's float8 training ({self.recipe}), which needs "
                f"a CUDA GPU of compute capability {capability[0]}.{capability[1]}+; without one use fp8_experts "
                "(the experts' FP8 has an emulation) or bf16",
            )
        if target.compute_capability is not None and target.compute_capability < capability:
            raise ConfigError(
                key,
                f"fp8 ({self.recipe}) needs compute capability {capability[0]}.{capability[1]}+, this GPU has "
                f"{target.compute_capability}; use fp8_experts or bf16",
            )
        m = cfg.model
        sides = {"model.hidden_size": m.hidden_size, "model.num_heads x head_dim": m.num_heads * m.head_dim}
        sides["model.num_kv_heads x head_dim"] = m.num_kv_heads * m.head_dim
        for name, size in sides.items():
            if size % multiple:
                raise ConfigError(
                    name.split(" ")[0],
                    f"precision=fp8 ({self.recipe}) needs each projection's sides a multiple of {multiple}: "
                    f"{name} is {size}",
                )
        if target.compute_capability is None:
            return  # a planned GPU: torchao is needed where it runs, not where it is planned
        try:
            import torchao.float8  # noqa: F401
        except ImportError as e:
            raise ConfigError(key, f"fp8 needs torchao (pip install 'moe_lab[fp8]'): {e}") from None

    def apply(self, model) -> None:
        def keep(module, fqn: str) -> bool:
            return isinstance(module, torch.nn.Linear) and self.converts(fqn)

        if self.recipe == "blockwise":
            from torchao.prototype.blockwise_fp8_training.linear import Float8BlockwiseLinearConfig
            from torchao.quantization import quantize_

            quantize_(model, Float8BlockwiseLinearConfig(), filter_fn=keep)
            return
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(
            model, config=Float8LinearConfig.from_recipe_name(self.recipe), module_filter_fn=keep
        )
