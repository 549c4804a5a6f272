"""The fused MoE op: dispatch + SwiGLU experts + combine as one ``torch.library`` custom op, with its backward as a
second custom op, fake implementations and registered autograd, so a decoder block that calls it compiles with
``fullgraph=True`` and selective activation checkpointing can save its outputs.

``fused_moe`` returns y and, as extra outputs, what backward needs (the routed rows, the gate/up pre-activations,
each row's routing weight and source, the layout), so saving the op's outputs means nothing is re-dispatched in
recompute, and backward starts at its first GEMM's inputs (no slot exchange: at EP > 1 that is two barriers less).
Those residuals have as many rows as this rank receives (each local expert's rows padded to ``ALIGN``; see
``moe_lab.moe.fused.layout``), a number only the routing decides: the fake implementation gives them an unbacked
size, as the torch dispatcher's all-to-all does (``moe_lab.moe.collectives``), and the op reads it back to the host
once per forward.
``backend`` names the implementation: ``reference`` (plain PyTorch, any device) or ``gpu`` / ``gpu_deep_gemm``
(Triton kernels with torch or DeepGEMM grouped GEMMs).

``save`` trades memory for backward work (``SAVES``): ``rows`` keeps the received rows and gate/up; ``rows_only`` keeps
the received rows and recomputes gate/up in backward; ``gate_up`` keeps gate/up and not the rows (x is saved instead,
T rows rather than T x K): backward gathers the rows again, as forward did; ``inputs`` keeps neither, and backward
gathers the rows and recomputes gate/up. The dropped residuals
come out with zero rows, so every mode has one schema and selective AC, which keeps all outputs, keeps only the rest.
"""

from __future__ import annotations

import importlib

import torch
from torch import Tensor
from torch.distributed.distributed_c10d import _resolve_process_group

_BACKEND_MODULES = {
    "reference": "moe_lab.moe.fused.reference",
    "gpu": "moe_lab.moe.fused.gpu",
    "gpu_deep_gemm": "moe_lab.moe.fused.gpu",
}
# Rows of each expert's segment start at a multiple of this (DeepGEMM's contiguous layout needs its M block).
ALIGN = {"reference": 1, "gpu": 8, "gpu_deep_gemm": 128}
# What forward keeps for backward: the received rows (x_routed) and/or gate/up; what it drops, backward rebuilds.
SAVES = {"rows": ("x_routed", "gate_up"), "rows_only": ("x_routed",), "gate_up": ("gate_up",), "inputs": ()}


def kept_residuals(kept: tuple, x_routed: Tensor, gate_up: Tensor) -> tuple[Tensor, Tensor]:
    """A backend's forward: the received rows and gate/up where ``kept`` (a ``SAVES`` value) names them, else with 0
    rows (backward rebuilds them)."""
    return tuple(t if name in kept else t[:0].clone() for name, t in (("x_routed", x_routed), ("gate_up", gate_up)))


def _impl(backend: str):
    return importlib.import_module(_BACKEND_MODULES[backend])


def _group(group_name: str):
    return _resolve_process_group(group_name) if group_name else None


@torch.library.custom_op("moe_lab::fused_moe", mutates_args=())
def fused_moe(
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    gate_up_proj: Tensor,
    down_proj: Tensor,
    num_experts: int,
    group_name: str,
    backend: str,
    save: str = "rows",
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> y [T, H], x_routed [R, H], gate_up [R, 2I], row_weight [R] fp32, row_src [R] int64 (source rank * T +
    token, -1 for padding), pos [T, K] int64, offs [L] int32, with R the rows this rank receives (padded per
    expert); x_routed and gate_up with 0 rows where ``save`` drops them."""
    return _impl(backend).forward(
        x,
        topk_ids,
        topk_weights,
        gate_up_proj,
        down_proj,
        num_experts,
        _group(group_name),
        ALIGN[backend],
        backend,
        SAVES[save],
    )


@fused_moe.register_fake
def _(x, topk_ids, topk_weights, gate_up_proj, down_proj, num_experts, group_name, backend, save="rows"):
    # No lower bound: torch 2.11's Inductor fails on a size bound (min=...) that reaches the backward graph as an input.
    rows = torch.library.get_ctx().new_dynamic_size()
    kept = SAVES[save]
    return (
        x.new_empty(x.shape),
        x.new_empty(rows if "x_routed" in kept else 0, x.shape[1]),
        x.new_empty(rows if "gate_up" in kept else 0, gate_up_proj.shape[1]),
        x.new_empty(rows, dtype=torch.float32),
        x.new_empty(rows, dtype=torch.int64),
        topk_ids.new_empty(topk_ids.shape, dtype=torch.int64),
        topk_ids.new_empty(gate_up_proj.shape[0], dtype=torch.int32),
    )


@torch.library.custom_op("moe_lab::fused_moe_backward", mutates_args=())
def fused_moe_backward(
    dy: Tensor,
    x_routed: Tensor,
    gate_up: Tensor,
    row_weight: Tensor,
    row_src: Tensor,
    pos: Tensor,
    offs: Tensor,
    topk_ids: Tensor,
    gate_up_proj: Tensor,
    down_proj: Tensor,
    group_name: str,
    backend: str,
    x: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """-> dx [T, H], d_topk_weights [T, K] fp32, d_gate_up_proj, d_down_proj. ``x``: forward's input, where forward
    kept no received rows (``x_routed`` with 0 rows)."""
    return _impl(backend).backward(
        dy,
        x_routed,
        gate_up,
        row_weight,
        row_src,
        pos,
        offs,
        topk_ids,
        gate_up_proj,
        down_proj,
        _group(group_name),
        backend,
        x,
    )


@fused_moe_backward.register_fake
def _(
    dy,
    x_routed,
    gate_up,
    row_weight,
    row_src,
    pos,
    offs,
    topk_ids,
    gate_up_proj,
    down_proj,
    group_name,
    backend,
    x=None,
):
    return (
        dy.new_empty(dy.shape),
        dy.new_empty(pos.shape, dtype=torch.float32),
        gate_up_proj.new_empty(gate_up_proj.shape),
        down_proj.new_empty(down_proj.shape),
    )


def _setup_context(ctx, inputs, output):
    x, topk_ids, topk_weights, gate_up_proj, down_proj, num_experts, group_name, backend, *save = inputs
    _, *residuals = output
    regather = "x_routed" not in SAVES[save[0] if save else "rows"]
    ctx.save_for_backward(*residuals, topk_ids, gate_up_proj, down_proj, x if regather else None)
    ctx.group_name, ctx.backend, ctx.weights_dtype = group_name, backend, topk_weights.dtype
    ctx.set_materialize_grads(False)  # the residual outputs get no gradient: don't allocate zeros for them


def _backward(ctx, dy, *unused_residual_grads):
    *saved, x = ctx.saved_tensors
    dx, d_weights, d_gate_up_proj, d_down_proj = fused_moe_backward(
        dy.contiguous(), *saved, ctx.group_name, ctx.backend, x
    )
    return dx, None, d_weights.to(ctx.weights_dtype), d_gate_up_proj, d_down_proj, None, None, None, None


fused_moe.register_autograd(_backward, setup_context=_setup_context)
