"""Activation checkpointing per decoder block: the ``ac`` group. Parameter names are left unchanged (the block's
forward is wrapped, not the block), so checkpoints load the same with any mode."""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import moe_lab.moe.collectives  # noqa: F401  (registers the moe_lab:: ops named in SAVED_OPS)
import moe_lab.moe.fused.ops  # noqa: F401

_aten = torch.ops.aten

# Outputs kept by selective checkpointing: matmuls, grouped GEMMs, attention, EP collectives and the routing
# decisions (top-k, sorts), so recompute re-runs only norms and elementwise work and never re-routes or
# re-communicates.
SAVED_OPS = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten._grouped_mm.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten.topk.default,
    _aten.sort.stable,
    _aten.sort.default,
    _aten.bincount.default,
    torch.ops.moe_lab.exchange_counts.default,
    torch.ops.moe_lab.all_to_all_rows.default,
    torch.ops.moe_lab.fused_moe.default,  # the fused dispatcher: recompute never re-runs dispatch, experts, combine
}


def _layers(model):
    return model.model.layers


def _wrap(layer, context_fn=None) -> None:
    kwargs = {"use_reentrant": False, "preserve_rng_state": False}
    if context_fn is not None:
        kwargs["context_fn"] = context_fn
    layer.forward = functools.partial(checkpoint, layer.forward, **kwargs)


class NoCheckpoint:
    """Keep every activation."""

    def apply(self, model) -> None:
        pass


class FullCheckpoint:
    """Keep only each block's input; recompute the whole block in backward."""

    def apply(self, model) -> None:
        for layer in _layers(model):
            _wrap(layer)


def _selective_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


class SelectiveCheckpoint:
    """Op-level policy: keep outputs of matmuls, grouped GEMMs, attention, collectives and routing; recompute
    norms and elementwise ops."""

    def apply(self, model) -> None:
        context_fn = functools.partial(create_selective_checkpoint_contexts, _selective_policy)
        for layer in _layers(model):
            _wrap(layer, context_fn)
