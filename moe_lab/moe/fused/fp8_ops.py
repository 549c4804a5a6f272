"""The fused MoE op with its routed experts in blockwise FP8 (``moe_lab.moe.fp8``): ``fused_moe_fp8`` and its
backward, custom ops like ``moe_lab.moe.fused.ops.fused_moe`` (fake implementations, registered autograd) with the
same dispatch, SwiGLU and combine, and their three kinds of GEMMs on e4m3 operands with fp32 scales:

- forward, gate/up and down: rows quantized per 1x128 tile (x before it is dispatched, so the received rows are FP8
  with their scales: half the bytes; the SwiGLU output in its kernel), the expert stacks per 128x128 block;
- input gradients: the routed output gradient and the gate/up gradient (in the SwiGLU backward kernel) per 1x128
  tile, against the stacks' transposes (the same blocks, transposed);
- weight gradients: bf16 grouped GEMMs (``torch._grouped_mm``) on the bf16 gradients and the saved FP8 rows
  dequantized (experiments/fp8/README.md says why not FP8 there).

The expert stacks come in quantized (``moe_lab.moe.fp8.weights.fp8_expert_weights``: once per optimizer step); the
parameters themselves come in only for their gradients' shape and dtype. The saved residuals are the received rows
in FP8 with their scales, the gate/up pre-activations (bf16: SwiGLU's backward reads them), the routing weights and
the layout. Master weights and optimizer state are untouched. ``backend``: ``reference`` (plain PyTorch:
quantize-dequantize with the same scales, GEMMs in fp32, any device and process group) or ``gpu_deep_gemm``
(Triton kernels and DeepGEMM's FP8 grouped GEMMs; SM90+).
"""

from __future__ import annotations

import importlib
import os

import torch
from torch import Tensor

from moe_lab.moe.experts import compute_dtype
from moe_lab.moe.fp8 import weights  # noqa: F401  (registers torch.ops.moe_lab.fp8_expert_weights)
from moe_lab.moe.fp8.quant import FP8, TILE
from moe_lab.moe.fused.ops import ALIGN, _group

_BACKEND_MODULES = {"reference": "moe_lab.moe.fused.fp8_reference", "gpu_deep_gemm": "moe_lab.moe.fused.fp8_gpu"}


def _impl(backend: str):
    return importlib.import_module(_BACKEND_MODULES[backend])


@torch.library.custom_op("moe_lab::fused_moe_fp8", mutates_args=())
def fused_moe_fp8(
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    gate_up_proj: Tensor,
    down_proj: Tensor,
    gate_up_q: Tensor,
    gate_up_scale: Tensor,
    gate_up_qt: Tensor,
    gate_up_scale_t: Tensor,
    down_q: Tensor,
    down_scale: Tensor,
    down_qt: Tensor,
    down_scale_t: Tensor,
    num_experts: int,
    group_name: str,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> y [T, H], x_q [R, H] e4m3, x_scale [R, H / 128] fp32, gate_up [R, 2I], row_weight [R] fp32, row_src [R]
    int64, pos [T, K] int64, offs [L] int32 (R: the rows this rank receives, each expert's padded to 128)."""
    return _impl(backend).forward(
        x,
        topk_ids,
        topk_weights,
        (gate_up_q, gate_up_scale),
        (down_q, down_scale),
        gate_up_proj.shape[0],
        num_experts,
        _group(group_name),
        ALIGN[backend],
    )


@fused_moe_fp8.register_fake
def _(x, topk_ids, topk_weights, gate_up_proj, down_proj, *quantized_and_rest):
    rows = torch.library.get_ctx().new_dynamic_size()
    return (
        x.new_empty(x.shape),
        x.new_empty(rows, x.shape[1], dtype=FP8),
        x.new_empty(rows, x.shape[1] // TILE, dtype=torch.float32),
        x.new_empty(rows, gate_up_proj.shape[1]),
        x.new_empty(rows, dtype=torch.float32),
        x.new_empty(rows, dtype=torch.int64),
        topk_ids.new_empty(topk_ids.shape, dtype=torch.int64),
        topk_ids.new_empty(gate_up_proj.shape[0], dtype=torch.int32),
    )


@torch.library.custom_op("moe_lab::fused_moe_fp8_backward", mutates_args=())
def fused_moe_fp8_backward(
    dy: Tensor,
    x_q: Tensor,
    x_scale: Tensor,
    gate_up: Tensor,
    row_weight: Tensor,
    row_src: Tensor,
    pos: Tensor,
    offs: Tensor,
    topk_ids: Tensor,
    gate_up_qt: Tensor,
    gate_up_scale_t: Tensor,
    down_qt: Tensor,
    down_scale_t: Tensor,
    gate_up_proj: Tensor,
    down_proj: Tensor,
    group_name: str,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """-> dx [T, H], d_topk_weights [T, K] fp32, d_gate_up_proj, d_down_proj (in the parameters' dtypes)."""
    dx, d_weights, d_gate_up_proj, d_down_proj = _impl(backend).backward(
        dy,
        x_q,
        x_scale,
        gate_up,
        row_weight,
        row_src,
        pos,
        offs,
        topk_ids,
        (gate_up_qt, gate_up_scale_t),
        (down_qt, down_scale_t),
        gate_up_proj.shape[0],
        _group(group_name),
    )
    return dx, d_weights, d_gate_up_proj.to(gate_up_proj.dtype), d_down_proj.to(down_proj.dtype)


@fused_moe_fp8_backward.register_fake
def _(dy, x_q, x_scale, gate_up, row_weight, row_src, pos, offs, topk_ids, *rest):
    gate_up_proj, down_proj = rest[4], rest[5]
    return (
        dy.new_empty(dy.shape),
        dy.new_empty(pos.shape, dtype=torch.float32),
        gate_up_proj.new_empty(gate_up_proj.shape),
        down_proj.new_empty(down_proj.shape),
    )


def _setup_context(ctx, inputs, output):
    x, topk_ids, topk_weights, gate_up_proj, down_proj, _, _, gu_qt, gu_st, _, _, d_qt, d_st, _, group_name, backend = (
        inputs
    )
    _, *residuals = output
    ctx.save_for_backward(*residuals, topk_ids, gu_qt, gu_st, d_qt, d_st, gate_up_proj, down_proj)
    ctx.group_name, ctx.backend, ctx.weights_dtype = group_name, backend, topk_weights.dtype
    ctx.set_materialize_grads(False)


def _backward(ctx, dy, *unused_residual_grads):
    dx, d_weights, d_gate_up_proj, d_down_proj = fused_moe_fp8_backward(
        dy.contiguous(), *ctx.saved_tensors, ctx.group_name, ctx.backend
    )
    return (dx, None, d_weights.to(ctx.weights_dtype), d_gate_up_proj, d_down_proj) + (None,) * 11


fused_moe_fp8.register_autograd(_backward, setup_context=_setup_context)


def fused_moe_fp8_layer(
    x, topk_ids, topk_weights, gate_up_proj, down_proj, ep_size: int, group_name: str, backend: str
) -> Tensor:
    """The FP8 layer as ``FusedDispatcher`` calls it: the parameters as stored (master dtype; their FP8 copies come
    from the per-step cache) and x, topk_weights in the compute dtype -> y [T, H]."""
    gate_up_w = torch.ops.moe_lab.fp8_expert_weights(gate_up_proj)
    down_w = torch.ops.moe_lab.fp8_expert_weights(down_proj)
    y, *_ = torch.ops.moe_lab.fused_moe_fp8(
        x,
        topk_ids,
        topk_weights,
        gate_up_proj,
        down_proj,
        *gate_up_w,
        *down_w,
        ep_size * gate_up_proj.shape[0],
        group_name,
        backend,
    )
    return y


def fp8_grouped_swiglu(rows, tokens_per_expert, gate_up_proj, down_proj) -> Tensor:
    """``moe_lab.moe.experts.grouped_swiglu`` in blockwise FP8, for the torch dispatcher: the FP8 op on its
    expert-contiguous rows [R, H] as a routing of one choice (each row to its own local expert, weight 1: the
    dispatcher's combine applies the routing weights) with no exchange. The op's gather gives DeepGEMM the
    128-aligned expert segments it needs; its layout costs a host sync per layer. CUDA: DeepGEMM; else the
    reference emulation."""
    rows = rows.to(compute_dtype(rows))
    # each row's expert, by where it falls among the segments' ends (no guard on the count tensor's size)
    ends = tokens_per_expert.cumsum(0)
    expert = torch.searchsorted(ends, torch.arange(rows.shape[0], device=rows.device), right=True)
    backend = "gpu_deep_gemm" if rows.is_cuda else "reference"
    ones = rows.new_ones(rows.shape[0], 1)
    return fused_moe_fp8_layer(rows, expert.view(-1, 1), ones, gate_up_proj, down_proj, 1, "", backend)


# Set (to the profile's name) while the planner validates a config for a GPU it is not running on.
PLANNED_HARDWARE = "MOE_LAB_PLANNED_HARDWARE"


def validate(cfg, backend: str, gemm: str, cuda: bool, deep_gemm_error: str | None) -> None:
    """Where ``dispatcher.expert_precision=fp8`` can run: 128-multiple expert shapes always (the tiles); the
    reference backend's emulation anywhere; otherwise a CUDA GPU of compute capability 9.0+ with DeepGEMM (for a
    planned GPU, ``moe_lab.plan`` checks its profile instead). ``deep_gemm_error``: why deep_gemm cannot be
    imported here, None if it can."""
    from moe_lab.runtime.errors import ConfigError

    key = "dispatcher.expert_precision"
    for name in ("hidden_size", "moe_intermediate_size"):
        if cfg.model[name] % TILE:
            raise ConfigError(
                f"model.{name}",
                f"{key}=fp8 quantizes in {TILE}-wide tiles: needs a multiple of {TILE}, got {cfg.model[name]}",
            )
    if gemm == "torch":
        raise ConfigError(
            "dispatcher.gemm", "expert_precision=fp8 runs DeepGEMM's FP8 GEMMs: use gemm=auto or deep_gemm"
        )
    if backend == "reference" or os.environ.get(PLANNED_HARDWARE):
        return
    if not cuda:
        raise ConfigError(
            key,
            "fp8 runs DeepGEMM's FP8 GEMMs on an SM90+ GPU; without CUDA only dispatcher.backend=reference emulates it (slowly)",
        )
    if torch.cuda.get_device_capability() < (9, 0):
        raise ConfigError(
            key,
            f"fp8 needs compute capability 9.0+ (Hopper), this GPU has {torch.cuda.get_device_capability()}; use bf16",
        )
    if deep_gemm_error is not None:
        raise ConfigError(key, f"fp8 needs deep_gemm, which cannot be imported here ({deep_gemm_error}); use bf16")
