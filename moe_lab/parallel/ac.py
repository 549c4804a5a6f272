"""Activation checkpointing per decoder block: the ``ac`` group. Parameter names are left unchanged (the block's
forward is wrapped, not the block), so checkpoints load the same with any mode.

Every option is applied as ``apply(model, saved_ops)`` (the ``Checkpointing`` contract). ``saved_ops`` are the
ops, beyond the generic ones below, whose outputs ac=selective keeps: the caller passes what the model's router and
dispatcher declare (``moe_lab.parallel.parallelize``), so this module knows no MoE op.
"""

from __future__ import annotations

import functools
from typing import Protocol, runtime_checkable

import torch
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

_aten = torch.ops.aten

# Outputs ac=selective always keeps: matmuls, grouped GEMMs and attention, so recompute re-runs only norms and
# elementwise work.
GENERIC_SAVED_OPS = frozenset(
    {
        _aten.mm.default,
        _aten.addmm.default,
        _aten.bmm.default,
        _aten._grouped_mm.default,
        _aten._scaled_dot_product_flash_attention.default,
        _aten._scaled_dot_product_efficient_attention.default,
        _aten._scaled_dot_product_cudnn_attention.default,
        _aten._scaled_dot_product_flash_attention_for_cpu.default,
        torch.ops.higher_order.flex_attention,  # attention inside packed documents on a GPU (data.document_mask)
    }
)


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

    def validate(self, cfg) -> None:
        """Refuse, with a ``ConfigError`` naming the key, a composed config this mode cannot run; the default
        accepts every config."""

    def apply(self, model, saved_ops: frozenset = frozenset()) -> None:
        """Wrap each decoder block's forward so that backward recomputes what this mode does not keep; ``saved_ops``:
        the router's and dispatcher's ops whose outputs must never be recomputed (routing, collectives)."""
        ...


class NoCheckpoint(Checkpointing):
    """Keep every activation."""

    def apply(self, model, saved_ops: frozenset = frozenset()) -> None:
        pass


class FullCheckpoint(Checkpointing):
    """Keep only each block's input; recompute the whole block in backward."""

    def apply(self, model, saved_ops: frozenset = frozenset()) -> None:
        for layer in _layers(model):
            _wrap(layer)


class SelectiveCheckpoint(Checkpointing):
    """Op-level policy: keep the outputs of matmuls, grouped GEMMs, attention and ``saved_ops`` (the routing
    decisions and collectives the caller names); recompute norms and elementwise ops."""

    def apply(self, model, saved_ops: frozenset = frozenset()) -> None:
        # A list of ops is torch's own policy: MUST_SAVE for those, PREFER_RECOMPUTE for every other op.
        context_fn = functools.partial(create_selective_checkpoint_contexts, list(GENERIC_SAVED_OPS | saved_ops))
        for layer in _layers(model):
            _wrap(layer, context_fn)
