"""The fused MoE op: dispatch + SwiGLU experts + combine as one ``torch.library`` custom op, with its backward as a
second custom op, fake implementations and registered autograd, so a decoder block that calls it compiles with
``fullgraph=True`` and selective activation checkpointing can save its outputs.

``fused_moe`` returns y and, as extra outputs, what backward needs (the routed rows, the gate/up pre-activations,
each row's routing weight and source, the layout), so saving the op's outputs means nothing is re-dispatched in
recompute, and backward starts at its first GEMM's inputs (no slot exchange: at EP > 1 that is two barriers less).
Those residuals have as many rows as this rank receives (each local expert's rows padded to the backend's
alignment; see ``moe_lab.moe.fused.layout``), a number only the routing decides: the fake implementation gives them
an unbacked size, as the torch dispatcher's all-to-all does (``moe_lab.moe.collectives``), and the op reads it back
to the host once per forward.

``backend`` names the implementation, registered by its module (``register_backend``): ``reference`` (plain
PyTorch, any device; ``moe_lab.moe.fused.reference``) or ``gpu`` / ``gpu_deep_gemm`` (Triton kernels with torch or
DeepGEMM grouped GEMMs; ``moe_lab.moe.fused.gpu``).

``precision`` is the experts' GEMMs': ``bf16`` (the compute dtype) or ``fp8`` (blockwise e4m3,
``moe_lab.moe.fp8``: x quantized per token before dispatch, so the rows travel and are kept in FP8 with their
scales; the SwiGLU output and the gradients quantized where they are made). ``weights`` carries the expert stacks
as the precision's GEMMs read them: nothing at bf16 (``gate_up_proj`` and ``down_proj`` themselves), at fp8 each
stack's FP8 copy and its transpose's (``moe_lab.moe.fp8.weights``, once per optimizer step); ``gate_up_proj`` and
``down_proj`` are then the parameters as stored, their gradients returned in their dtype. ``wgrad_precision`` is
the weight gradients' GEMMs': ``bf16`` (at fp8, on the kept FP8 rows dequantized) or, at precision fp8 only,
``fp8`` (DeepGEMM's k-grouped FP8 kernel; measured slower end to end on the H200, docs/fp8.md).

``save`` trades memory for backward work (``SAVES``): ``rows`` keeps the received rows and gate/up; ``rows_only`` keeps
the received rows and recomputes gate/up in backward; ``gate_up`` keeps gate/up and not the rows (x is saved instead,
T rows rather than T x K): backward gathers the rows again, as forward did; ``inputs`` keeps neither, and backward
gathers the rows and recomputes gate/up. At either precision: kept rows are the rows as they travel (FP8 and scales
at fp8), gate/up is in the compute dtype. The dropped residuals come out with zero rows, so every mode has one
schema and selective AC, which keeps all outputs, keeps only the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed.distributed_c10d import _resolve_process_group

from moe_lab.moe.fp8 import weights as fp8_weights  # noqa: F401  (registers torch.ops.moe_lab.fp8_expert_weights)
from moe_lab.moe.fp8.quant import FP8, TILE

# What forward keeps for backward: the received rows (x_routed) and/or gate/up; what it drops, backward rebuilds.
SAVES = {"rows": ("x_routed", "gate_up"), "rows_only": ("x_routed",), "gate_up": ("gate_up",), "inputs": ()}


@dataclass(frozen=True)
class Backend:
    """An implementation of the op. ``forward(x, topk_ids, topk_weights, gate_up_proj, down_proj, weights,
    num_experts, group, kept, precision)`` -> the op's outputs; ``backward(dy, residuals, topk_ids, gate_up_proj,
    down_proj, weights, group, precision, x, wgrad_precision)`` (``residuals``: forward's outputs after y) -> dx,
    d_topk_weights and the stacks' gradients; ``align``: rows of each expert's segment start at a multiple of it
    (the grouped GEMM's need)."""

    forward: Callable
    backward: Callable
    align: int


BACKENDS: dict[str, Backend] = {}


def register_backend(name: str, backend: Backend) -> None:
    """Called by each backend's module as it is imported (``moe_lab.moe.fused`` imports them all)."""
    BACKENDS[name] = backend


def align(backend: str) -> int:
    """Rows of each expert's segment start at a multiple of this in ``backend``'s receive buffer (DeepGEMM's
    contiguous layout needs its M block)."""
    return BACKENDS[backend].align


def process_group(group_name: str):
    """The EP group an op is handed by name; None for '' (every expert local)."""
    return _resolve_process_group(group_name) if group_name else None


def kept_residuals(kept: tuple, rows: tuple[Tensor, Tensor], gate_up: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """A backend's forward: the received rows (values and their scales) and gate/up where ``kept`` (a ``SAVES``
    value) names them, else with 0 rows (backward rebuilds them)."""

    def keep(name, t):
        return t if name in kept else t[:0].clone()

    return keep("x_routed", rows[0]), keep("x_routed", rows[1]), keep("gate_up", gate_up)


def expert_weights(precision: str, gate_up_proj: Tensor, down_proj: Tensor) -> list[Tensor]:
    """The op's ``weights`` for the expert stacks (parameters, written in place by their optimizer)."""
    if precision == "bf16":
        return []
    return [*torch.ops.moe_lab.fp8_expert_weights(gate_up_proj), *torch.ops.moe_lab.fp8_expert_weights(down_proj)]


def row_shapes(precision: str, rows, hidden: int, dtype: torch.dtype) -> tuple[tuple, torch.dtype, tuple]:
    """(shape, dtype) of the received rows and the shape of their scales, as ``precision`` moves and keeps them."""
    if precision == "fp8":
        return (rows, hidden), FP8, (rows, hidden // TILE)
    return (rows, hidden), dtype, (rows, 0)


@torch.library.custom_op("moe_lab::fused_moe", mutates_args=())
def fused_moe(
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    gate_up_proj: Tensor,
    down_proj: Tensor,
    weights: list[Tensor],
    num_experts: int,
    group_name: str,
    backend: str,
    save: str,
    precision: str,
    wgrad_precision: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> y [T, H], rows [R, H] (the compute dtype, or e4m3 at fp8), row_scales [R, H / 128] fp32 ([R, 0] at bf16),
    gate_up [R, 2I], row_weight [R] fp32, row_src [R] int64 (source rank * T + token, -1 for padding), pos [T, K]
    int64, offs [L] int32, with R the rows this rank receives (padded per expert); rows, row_scales and gate_up with
    0 rows where ``save`` drops them. ``wgrad_precision``: the experts' weight gradients' (``bf16``, or ``fp8`` at
    precision fp8), for backward."""
    return BACKENDS[backend].forward(
        x,
        topk_ids,
        topk_weights,
        gate_up_proj,
        down_proj,
        weights,
        num_experts,
        process_group(group_name),
        SAVES[save],
        precision,
    )


@fused_moe.register_fake
def _(
    x, topk_ids, topk_weights, gate_up_proj, down_proj, weights, num_experts, group_name, backend, save, precision, _
):
    # No lower bound: torch 2.11's Inductor fails on a size bound (min=...) that reaches the backward graph as an input.
    rows = torch.library.get_ctx().new_dynamic_size()
    kept = SAVES[save]
    row_shape, row_dtype, scale_shape = row_shapes(precision, rows if "x_routed" in kept else 0, x.shape[1], x.dtype)
    return (
        x.new_empty(x.shape),
        x.new_empty(row_shape, dtype=row_dtype),
        x.new_empty(scale_shape, dtype=torch.float32),
        x.new_empty(rows if "gate_up" in kept else 0, gate_up_proj.shape[1]),
        x.new_empty(rows, dtype=torch.float32),
        x.new_empty(rows, dtype=torch.int64),
        topk_ids.new_empty(topk_ids.shape, dtype=torch.int64),
        topk_ids.new_empty(gate_up_proj.shape[0], dtype=torch.int32),
    )


@torch.library.custom_op("moe_lab::fused_moe_backward", mutates_args=())
def fused_moe_backward(
    dy: Tensor,
    rows: Tensor,
    row_scales: Tensor,
    gate_up: Tensor,
    row_weight: Tensor,
    row_src: Tensor,
    pos: Tensor,
    offs: Tensor,
    topk_ids: Tensor,
    gate_up_proj: Tensor,
    down_proj: Tensor,
    weights: list[Tensor],
    group_name: str,
    backend: str,
    precision: str,
    wgrad_precision: str,
    x: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """-> dx [T, H], d_topk_weights [T, K] fp32, d_gate_up_proj, d_down_proj (in the stacks' dtypes). ``x``:
    forward's input, where forward kept no received rows (``rows`` with 0 rows)."""
    residuals = (rows, row_scales, gate_up, row_weight, row_src, pos, offs)
    dx, d_weights, d_gate_up_proj, d_down_proj = BACKENDS[backend].backward(
        dy,
        residuals,
        topk_ids,
        gate_up_proj,
        down_proj,
        weights,
        process_group(group_name),
        precision,
        x,
        wgrad_precision,
    )
    return dx, d_weights, d_gate_up_proj.to(gate_up_proj.dtype), d_down_proj.to(down_proj.dtype)


@fused_moe_backward.register_fake
def _(dy, rows, row_scales, gate_up, row_weight, row_src, pos, offs, topk_ids, gate_up_proj, down_proj, *rest):
    return (
        dy.new_empty(dy.shape),
        dy.new_empty(pos.shape, dtype=torch.float32),
        gate_up_proj.new_empty(gate_up_proj.shape),
        down_proj.new_empty(down_proj.shape),
    )


def _setup_context(ctx, inputs, output):
    (
        x,
        topk_ids,
        topk_weights,
        gate_up_proj,
        down_proj,
        weights,
        _,
        group_name,
        backend,
        save,
        precision,
        wgrad_precision,
    ) = inputs
    _, *residuals = output
    regather = "x_routed" not in SAVES[save]
    ctx.save_for_backward(*residuals, topk_ids, gate_up_proj, down_proj, x if regather else None, *weights)
    ctx.group_name, ctx.backend, ctx.weights_dtype = group_name, backend, topk_weights.dtype
    ctx.precision, ctx.wgrad_precision = precision, wgrad_precision
    ctx.set_materialize_grads(False)  # the residual outputs get no gradient: don't allocate zeros for them


def _backward(ctx, dy, *unused_residual_grads):
    saved = ctx.saved_tensors  # once: under checkpointing each read unpacks them
    *residuals, x = saved[:11]
    weights = list(saved[11:])
    dx, d_weights, d_gate_up_proj, d_down_proj = fused_moe_backward(
        dy.contiguous(), *residuals, weights, ctx.group_name, ctx.backend, ctx.precision, ctx.wgrad_precision, x
    )
    no_grads = [None] * len(weights)  # the weights' copies
    return (dx, None, d_weights.to(ctx.weights_dtype), d_gate_up_proj, d_down_proj, no_grads) + (None,) * 6


fused_moe.register_autograd(_backward, setup_context=_setup_context)


def fused_moe_layer(
    x,
    topk_ids,
    topk_weights,
    gate_up_proj,
    down_proj,
    num_experts,
    group_name,
    backend,
    save,
    precision,
    wgrad_precision,
) -> Tensor:
    """The op as ``FusedDispatcher`` calls it, for the parameters as stored (the master dtype) and x, topk_weights
    in the compute dtype -> y [T, H]. bf16 multiplies the stacks cast to the compute dtype; fp8 their FP8 copies
    (the per-step cache), returning the masters' gradients directly. ``wgrad_precision`` fp8 (at precision fp8
    only): the weight gradients' GEMMs in FP8 too."""
    if precision == "bf16":
        gate_up_proj, down_proj = gate_up_proj.to(x.dtype), down_proj.to(x.dtype)
    weights = expert_weights(precision, gate_up_proj, down_proj)
    y, *_ = torch.ops.moe_lab.fused_moe(
        x,
        topk_ids,
        topk_weights,
        gate_up_proj,
        down_proj,
        weights,
        num_experts,
        group_name,
        backend,
        save,
        precision,
        wgrad_precision,
    )
    return y
