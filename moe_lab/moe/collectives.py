"""Expert-parallel collectives as ``torch.library`` custom ops.

The token all-to-all moves a data-dependent number of rows, which the compiler cannot see through. As custom ops
with fake implementations (an unbacked size for the rows received) and registered autograd, a decoder block with
the torch dispatcher compiles with ``fullgraph=True``, and selective activation checkpointing can name their
outputs to keep instead of re-communicating in backward. Process groups travel by name (a string the compiler
can hold); the ops run over any backend torch.distributed has (gloo on CPU, NCCL on GPU).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group


@torch.library.custom_op("moe_lab::exchange_counts", mutates_args=())
def exchange_counts(counts: torch.Tensor, group_name: str) -> torch.Tensor:
    """Equal-sized all-to-all of a count vector: block r of ``counts`` (split into group-size blocks) goes to
    rank r; block r of the result came from rank r."""
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=_resolve_process_group(group_name))
    return out


@exchange_counts.register_fake
def _(counts, group_name):
    return torch.empty_like(counts)


@torch.library.custom_op("moe_lab::all_to_all_rows", mutates_args=())
def all_to_all_rows(x: torch.Tensor, send_rows: torch.Tensor, recv_rows: torch.Tensor, group_name: str) -> torch.Tensor:
    """All-to-all of rows with data-dependent splits: ``send_rows[r]`` consecutive rows of ``x`` go to rank r,
    ``recv_rows[r]`` rows come from rank r, in rank order. The split vectors are int64 CPU tensors, so reading
    them here costs no device synchronisation."""
    out = x.new_empty((int(recv_rows.sum()), *x.shape[1:]))
    group = _resolve_process_group(group_name)
    dist.all_to_all_single(out, x.contiguous(), recv_rows.tolist(), send_rows.tolist(), group=group)
    return out


@all_to_all_rows.register_fake
def _(x, send_rows, recv_rows, group_name):
    rows = torch.library.get_ctx().new_dynamic_size()
    return x.new_empty((rows, *x.shape[1:]))


def _setup_context(ctx, inputs, output):
    _, send_rows, recv_rows, group_name = inputs
    ctx.save_for_backward(send_rows, recv_rows)
    ctx.group_name = group_name


def _backward(ctx, grad):
    # The gradient travels back the way the rows came: the same all-to-all with the splits swapped.
    send_rows, recv_rows = ctx.saved_tensors
    return all_to_all_rows(grad, recv_rows, send_rows, ctx.group_name), None, None, None


all_to_all_rows.register_autograd(_backward, setup_context=_setup_context)
