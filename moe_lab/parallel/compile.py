"""torch.compile per decoder block, after activation checkpointing and before FSDP (as in torchtitan), and of the
loss.

The block's ``forward`` is compiled, not its ``__call__``: FSDP2's hooks stay outside the graph and parameter names
are unchanged (no ``_orig_mod.`` prefix). Each block is one graph (``fullgraph=True``; the dispatcher's collectives
are custom ops) and blocks of the same shape share the compiled code.
"""

import functools

import torch


def apply_compile(model) -> None:
    # A sweep may run several points in one process: compile each model afresh, so a point never inherits another's
    # compiled code or runs into the recompile limit (past which dynamo would quietly fall back to eager).
    torch._dynamo.reset()
    for layer in model.model.layers:
        layer.forward = _without_runtime_asserts(torch.compile(layer.forward, fullgraph=True))


def _without_runtime_asserts(compiled):
    """Compile (at the first call, and at any recompile) without dynamo's runtime size assertions. torch 2.11's
    partitioner hands the backward graph the SymBool of such an assertion (``u0 >= 0`` on the fused op's
    data-dependent row count) under selective AC, and Inductor then refuses the graph ("Unsupported graph input
    type: GreaterThan"); later torch skips assertion-only SymBools. The assertions only check sizes the custom ops'
    implementations guarantee."""

    @functools.wraps(compiled)
    def forward(*args, **kwargs):
        with torch._dynamo.config.patch(do_not_emit_runtime_asserts=True):
            return compiled(*args, **kwargs)

    return forward


def compile_loss(loss):
    """The loss (a ``moe_lab.models.loss`` option) with its work over the vocabulary compiled, as torchtitan
    compiles its loss: the upcast of the logits and the log-softmax fuse, so no fp32 copy of the logits is
    materialised (10 GB and about 25 ms of copies and softmax kernels per step at seq 16384 with Qwen3's 151,936-token
    vocabulary on an H200, when every token's logits are at once)."""
    return loss.compiled()
