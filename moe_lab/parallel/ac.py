"""Activation checkpointing per decoder block: the ``ac`` group. Parameter names are left unchanged (the block's
forward is wrapped, not the block), so checkpoints load the same with any mode.

Every option is applied as ``apply(model, saved_ops)`` (the ``Checkpointing`` contract). ``saved_ops`` names,
per declarer (``router``, ``dispatcher``), the ops whose outputs ac=selective keeps beyond the generic sets below:
the caller passes what the model's router and dispatcher declare (``moe_lab.parallel.parallelize``), so this module
knows no MoE op.

``ac.keep`` (selective) picks which of the named sets (``KEEP_SETS``) are kept, so a sweep can walk from keeping
everything (the default) towards full recompute; ``ac.offload_activations`` (none, selective) moves what autograd
saves per block to host memory (``moe_lab.parallel.activation_offload``).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Literal, Protocol, runtime_checkable

import torch
from omegaconf import DictConfig
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from moe_lab.parallel.activation_offload import ActivationOffload
from moe_lab.runtime.errors import ConfigError

_aten = torch.ops.aten

# The generic sets ac=selective may keep: matmuls, grouped GEMMs, attention. Keeping all three, recompute re-runs only
# norms and elementwise work.
GENERIC_SETS = {
    "matmul": frozenset({_aten.mm.default, _aten.addmm.default, _aten.bmm.default}),
    "grouped_mm": frozenset({_aten._grouped_mm.default}),
    "attention": frozenset(
        {
            _aten._scaled_dot_product_flash_attention.default,
            _aten._scaled_dot_product_efficient_attention.default,
            _aten._scaled_dot_product_cudnn_attention.default,
            _aten._scaled_dot_product_flash_attention_for_cpu.default,
            torch.ops.higher_order.flex_attention,  # attention inside packed documents on a GPU (data.document_mask)
        }
    ),
}
GENERIC_SAVED_OPS = frozenset().union(*GENERIC_SETS.values())
# The sets the model's parts declare: the routing decision, and the dispatcher's collectives / fused op.
DECLARED_SETS = ("router", "dispatcher")
KeepSet = Literal["matmul", "grouped_mm", "attention", "router", "dispatcher"]
KEEP_SETS: tuple[str, ...] = (*GENERIC_SETS, *DECLARED_SETS)


def kept_ops(keep, saved_ops: Mapping[str, frozenset]) -> frozenset:
    """The ops whose outputs ac=selective keeps under ``keep`` (names of ``KEEP_SETS``), the declared sets from
    ``saved_ops`` (which may add to a generic one: a precision option's FP8 GEMMs to ``matmul``)."""
    sets = (GENERIC_SETS.get(name, frozenset()) | saved_ops.get(name, frozenset()) for name in keep)
    return frozenset().union(*sets)


def _layers(model):
    return model.model.layers


def _wrap(layer, context_fn=None) -> None:
    kwargs = {"use_reentrant": False, "preserve_rng_state": False}
    if context_fn is not None:
        kwargs["context_fn"] = context_fn
    layer.forward = functools.partial(checkpoint, layer.forward, **kwargs)


@runtime_checkable
class Checkpointing(Protocol):
    """What an ``ac`` option provides. Validation calls ``validate``; ``moe_lab.parallel.parallelize`` calls
    ``apply`` once, after expert parallelism and before compile and FSDP2."""

    def validate(self, cfg, target) -> None:
        """Refuse, with a ``ConfigError`` naming the key, a composed config this mode cannot run (``target``: where,
        ``moe_lab.runtime.device.Target``); the default accepts every config."""

    def apply(self, model, saved_ops: Mapping[str, frozenset] = {}) -> None:
        """Wrap each decoder block's forward so that backward recomputes what this mode does not keep; ``saved_ops``:
        per declarer (``router``, ``dispatcher``), the ops whose outputs must never be recomputed (routing,
        collectives)."""
        ...


class _Offloading(Checkpointing):
    """``offload_activations``: each block's saved tensors go to host memory (installed around the block's call,
    outside what compile replaces)."""

    def __init__(self, offload_activations: bool):
        self.offload_activations = offload_activations
        self.offload: ActivationOffload | None = None

    def _install_offload(self, model) -> None:
        if self.offload_activations:
            self.offload = ActivationOffload(list(_layers(model)))


class NoCheckpoint(_Offloading):
    """Keep every activation (in host memory with ``offload_activations``)."""

    def __init__(self, offload_activations: bool = False):
        super().__init__(offload_activations)

    def apply(self, model, saved_ops: Mapping[str, frozenset] = {}) -> None:
        self._install_offload(model)


def _recompute(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE


class FullCheckpoint(Checkpointing):
    """Keep only each block's input; recompute the whole block in backward.

    The block's every op is marked for recompute by a selective-checkpoint policy rather than by plain
    ``checkpoint``: under torch.compile, torch 2.11 tags plain checkpoint's region at the level of dynamo's graph, and
    the ops inside an ``autograd.Function`` there (the torch dispatcher's ``gather_rows``) stay untagged; the
    partitioner then keeps their output for backward (one [tokens x top-k, hidden] tensor per block, 0.5 GiB a layer
    on Qwen3-30B-A3B at seq 16384). A policy tags each op as it is dispatched, those included."""

    def apply(self, model, saved_ops: Mapping[str, frozenset] = {}) -> None:
        context_fn = functools.partial(create_selective_checkpoint_contexts, _recompute)
        for layer in _layers(model):
            _wrap(layer, context_fn)


class SelectiveCheckpoint(_Offloading):
    """Op-level policy: keep the outputs of the ops of the ``keep`` sets (matmuls, grouped GEMMs, attention, and the
    routing decisions and collectives the router and dispatcher declare); recompute norms, elementwise ops and the
    ops of the sets left out. ``offload_activations`` moves what is kept to host memory (needs trainer.compile: only
    the compiled block keeps its selected outputs as autograd saved tensors, which the offload hooks see)."""

    def __init__(self, keep: list[KeepSet] | None = None, offload_activations: bool = False):
        keep = KEEP_SETS if keep is None else tuple(keep)
        unknown = [name for name in keep if name not in KEEP_SETS]
        if unknown:
            raise ConfigError("ac.keep", f"unknown set {unknown[0]!r}; allowed: {', '.join(KEEP_SETS)}")
        self.keep = keep
        super().__init__(offload_activations)

    def validate(self, cfg: DictConfig, target) -> None:
        if self.offload_activations and not cfg.trainer.compile:
            raise ConfigError(
                "ac.offload_activations",
                "with ac=selective it needs trainer.compile=true (eager selective AC keeps its outputs outside "
                "autograd's saved tensors, where no offload hook sees them); use ac=none or compile",
            )

    def apply(self, model, saved_ops: Mapping[str, frozenset] = {}) -> None:
        # A list of ops is torch's own policy: MUST_SAVE for those, PREFER_RECOMPUTE for every other op.
        context_fn = functools.partial(create_selective_checkpoint_contexts, list(kept_ops(self.keep, saved_ops)))
        for layer in _layers(model):
            _wrap(layer, context_fn)
        self._install_offload(model)
