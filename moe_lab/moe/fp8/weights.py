"""The expert stacks' FP8 copies: each stack [L, N, K] quantized in 128x128 blocks, with its transpose (the
input-gradient GEMMs read w[e] as stored, transposed; DeepGEMM's FP8 kernels on SM90 take K-major operands only), made
once per optimizer step.

``fp8_expert_weights`` is a custom op (a fake implementation, so a compiled block calls it like any op) whose
implementation keeps one copy per parameter: it is reused while nothing can have changed the parameter (every
micro-batch and every recompute of a step) and made again after any optimizer step or in-place write that moves
the version counter (``copy_``, ``load_state_dict``; a write through ``.data`` moves none and is not seen: moe_lab
writes none). A copy is keyed
on the tensor object itself (weakly, so a temporary that happens to reuse a freed parameter's address never hits), its
storage, its version counter and the optimizer-step epoch: ``torch.optim.AdamW(fused=True)`` updates parameters
without bumping their version counter, so the version alone let FP8 experts train on stale weights. The epoch moves
on every ``torch.optim.Optimizer.step`` in the process (a global step hook): the plain, foreach and fused paths alike,
the offload modes' chunk and host steps (all ``torch.optim.Optimizer`` subclasses) and the steps taken inside
backward, whichever optimizer a config names.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.weak import WeakIdKeyDictionary

from moe_lab.moe.fp8 import quant

_CACHE = WeakIdKeyDictionary()  # tensor -> ((data_ptr, version, epoch), quantized)
stats = {"quantized": 0, "reused": 0}
_epoch = [0]  # optimizer steps taken in this process


def _optimizer_stepped(optimizer, args, kwargs) -> None:
    _epoch[0] += 1


register_optimizer_step_post_hook(_optimizer_stepped)


def _key(w: Tensor) -> tuple[int, int, int]:
    return w.data_ptr(), w._version, _epoch[0]


def quantize_expert_stack(w: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """w [L, N, K] -> (e4m3 w, block scales [L, N/128, K/128], e4m3 w^T [L, K, N], scales [L, K/128, N/128])."""
    if not w.is_cuda:
        q, scale = quant.quantize_blocks(w)
        return q, scale, *quant.transpose_blocks(q, scale)
    from moe_lab.moe.fp8 import kernels

    lead, n, k = w.shape
    w = w.contiguous()
    q = torch.empty(w.shape, dtype=quant.FP8, device=w.device)
    qt = torch.empty(lead, k, n, dtype=quant.FP8, device=w.device)
    scale = torch.empty(lead, n // quant.TILE, k // quant.TILE, dtype=torch.float32, device=w.device)
    scale_t = torch.empty(lead, k // quant.TILE, n // quant.TILE, dtype=torch.float32, device=w.device)
    grid = (lead, n // quant.TILE, k // quant.TILE)
    kernels.weight_blocks_kernel[grid](w, q, scale, qt, scale_t, N=n, K=k)
    return q, scale, qt, scale_t


@torch.library.custom_op("moe_lab::fp8_expert_weights", mutates_args=())
def fp8_expert_weights(w: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The FP8 copy of expert stack ``w`` [L, N, K] (a parameter, written in place by its optimizer), cached."""
    hit = _CACHE.get(w)
    if hit is not None and hit[0] == _key(w):
        stats["reused"] += 1
        return hit[1]
    out = quantize_expert_stack(w.detach())
    _CACHE[w] = (_key(w), out)
    stats["quantized"] += 1
    return out


@fp8_expert_weights.register_fake
def _(w):
    lead, n, k = w.shape
    t = quant.TILE
    return (
        w.new_empty(w.shape, dtype=quant.FP8),
        w.new_empty(lead, n // t, k // t, dtype=torch.float32),
        w.new_empty(lead, k, n, dtype=quant.FP8),
        w.new_empty(lead, k // t, n // t, dtype=torch.float32),
    )


def _no_gradient(ctx, inputs, output):
    # The copies carry no gradient (the FP8 op returns the parameters' own): marked so, autograd neither tracks them
    # nor zero-fills a gradient for each in backward (four weight-sized fills per layer otherwise).
    ctx.mark_non_differentiable(*output)


fp8_expert_weights.register_autograd(lambda ctx, *grads: None, setup_context=_no_gradient)
