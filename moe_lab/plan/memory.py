"""Peak device memory of one rank, by category, and host memory per offload mode.

The peak is what ``torch.cuda.max_memory_allocated`` reports (the figure every record holds): the largest sum over
the moments of a step where memory peaks. Those are walked as the step runs them:
- the loss: model state, every layer's saved activations, the logits and their gradient;
- the backward of its last layer and of its first (gradients grow and saved activations shrink by a layer each
  layer, so the peak of backward is at one end): the gradients made so far, the saved activations of the layers
  not yet run backward, and the layer's own working set (what full AC recomputes, and backward's temporaries);
- the optimizer step: model state and the step's temporaries (foreach AdamW's square roots; offload=optimizer's
  window of moments on the device).
Memory outside the caching allocator (the fused dispatcher's symmetric workspace at EP>1, the CUDA context) does
not count towards that peak but does towards what fits.

Activations follow the code: ac=full keeps each block's input; ac=selective keeps the outputs of the ops
``moe_lab.parallel.ac.GENERIC_SAVED_OPS`` and the router's and dispatcher's ``saved_ops`` name (the planner
reads those declarations, so a dispatcher that saves more or less is planned as it is); ac=none keeps those and the
elementwise outputs backward reads too. ``ac.keep`` narrows selective's ops to its sets (the others are recomputed,
one layer at a time, in backward's working set); ``dispatcher.save`` drops the fused op's received rows and/or gate/up
from what it keeps (rebuilt in backward's working set); ``ac.offload_activations`` moves every layer's saved tensors
but the last one's to pinned host memory, as fast as PCIe takes them (``offload_pace``).

What differs between the options of a group (a dispatcher's ops and buffers, an AC mode's kept outputs, an offload
mode's device and host state, an optimizer's state) is the option's planner model (``moe_lab.plan.models``, each
holding its built option), which the ``Step`` holds.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from moe_lab.moe.router import Router
from moe_lab.plan.shapes import Mesh, Shapes
from moe_lab.runtime.device import Target

GIB = 2**30
_aten = torch.ops.aten

# The fitted factor on one layer's backward temporaries (experts' activation gradients and weight gradients), from
# the one-GPU records (experiments/plan/README.md).
BACKWARD_WORKSPACE = 1.0


@dataclass
class Step:
    """What a step of one rank is made of, for memory and time alike: the model's shapes, the mesh, the sequence and
    batch, and the planner model of each option (which holds the option's values)."""

    shapes: Shapes
    mesh: Mesh
    seq_len: int
    batch_size: int
    grad_accum: int
    # the options' planner models (moe_lab.plan.models, which builds on this module: typed loosely here)
    dispatcher: Any
    ac: Any
    offload: Any
    optimizer: Any
    precision: Any
    loss: Any
    target: Target  # where it runs, as validation is told (``moe_lab.plan.planner.planned_target``)
    compile: bool
    grad_sync: str = "step"  # parallel.grad_sync
    reshard_after_forward: bool = True  # parallel.reshard_after_forward

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch on one rank."""
        return self.seq_len * self.batch_size

    @property
    def cfg(self):
        return self.shapes.cfg

    @property
    def fsdp(self) -> bool:
        return self.mesh.world > 1

    @property
    def residual_bytes(self) -> int:
        """The residual stream's dtype: fp32 on one rank (autocast keeps the fp32 embedding's output), bf16 under
        FSDP2's mixed precision (bf16 parameters)."""
        return 2 if self.fsdp else 4


def routed_rows(step: Step) -> float:
    """Rows the busiest rank's experts receive per layer: under balanced routing every rank receives as many (token,
    k) slots as it routes; under forced skewed routing the rank holding the most-chosen experts receives more, and the
    EP group waits for it (its memory is the group's peak too). Learned routing is planned as balanced."""
    c = step.cfg
    skewed = c.routing == "skewed" and step.mesh.ep > 1
    share = (
        busiest_rank_share(c.num_experts, c.num_experts_per_tok, c.routing_skew, step.mesh.ep)
        if skewed
        else 1 / step.mesh.ep
    )
    return routed_slots(step) * share * step.mesh.ep


def routed_slots(step: Step) -> int:
    """(token, k) slots this rank routes per layer."""
    return step.tokens * step.cfg.num_experts_per_tok


@functools.cache
def busiest_rank_share(num_experts: int, top_k: int, skew: float, ep: int, tokens: int = 8192) -> float:
    """The share of all routed slots that lands on the busiest of ``ep`` ranks (each holding a contiguous block of
    experts) under forced skewed routing, counted on the router's own draw (``Router.forced_ids``)."""
    router = Router(1, num_experts, top_k, norm_topk_prob=True, routing="skewed", routing_skew=skew)
    ids = router.forced_ids(tokens, torch.device("cpu"))
    per_rank = torch.bincount(ids.flatten() // (num_experts // ep), minlength=ep)
    return per_rank.max().item() / ids.numel()


def op_outputs(step: Step) -> dict:
    """Bytes per layer of each op's outputs in one decoder block's forward, by op (a list where the op runs more
    than once), for the ops whose outputs backward reads: what ac=selective may keep."""
    c, t = step.cfg, step.tokens
    q, kv, k = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_experts_per_tok
    outputs = {
        _aten.mm.default: [2 * t * q, 2 * t * kv, 2 * t * kv, 2 * t * c.hidden_size, 2 * t * c.num_experts],
        _aten._scaled_dot_product_flash_attention.default: [2 * t * q + 4 * t * c.num_heads],
        _aten.topk.default: [t * k * (4 + 8)],
    }
    return outputs | step.dispatcher.op_outputs(step)


def elementwise_outputs(step: Step) -> float:
    """Bytes per layer of the outputs backward reads that ac=selective recomputes (norms, RoPE, and the dispatcher's
    own, such as the SwiGLU and the routed rows' gather): what ac=none keeps beyond them."""
    c, t = step.cfg, step.tokens
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    attention = 2 * t * (2 * c.hidden_size + q + kv) + step.residual_bytes * t * c.hidden_size
    return attention + step.dispatcher.elementwise_outputs(step)


def saved_per_layer(step: Step) -> float:
    """Bytes one decoder block keeps from its forward to its backward: its input, the outputs of the ops the AC mode
    keeps and, without AC, the elementwise outputs backward reads."""
    block_input = step.residual_bytes * step.tokens * step.cfg.hidden_size
    saved = sum(sum(sizes) for op, sizes in op_outputs(step).items() if step.ac.keeps(op, step))
    return block_input + saved + (elementwise_outputs(step) if step.ac.keeps_elementwise else 0)


def fused_saved_per_layer(step: Step) -> float:
    """Of ``saved_per_layer``, what the dispatcher's buffers hold (the fused op's receive-side residuals, rows
    received, and, uncompiled, its output), counted apart from the activations."""
    outputs = op_outputs(step)
    return sum(sum(outputs[op]) for op in step.dispatcher.buffer_ops if op in outputs and step.ac.keeps(op, step))


def backward_workspace(step: Step) -> float:
    """One block's backward, beyond what it saved: under ac=full its recomputed forward, and the temporaries of its
    backward (the experts' activation gradients, their weight gradients in bf16 before the fp32 cast)."""
    c = step.cfg
    rows = step.dispatcher.buffer_rows(step)
    temporaries = rows * 2 * (2 * c.hidden_size + 3 * c.moe_intermediate_size)
    temporaries += rows * step.dispatcher.dropped_row_bytes(step)  # what its save mode left for backward to rebuild
    if not step.fsdp:  # gradients of the bf16 casts, before they are widened into fp32 .grad
        temporaries += 2 * step.shapes.layer_params_unsharded(step.mesh)
    return BACKWARD_WORKSPACE * (temporaries + step.ac.recompute_workspace(step))


# The pinned host allocator rounds each block up to a power of two: over sizes spread evenly on a log scale that is
# 1 / ln 2 of the bytes asked on average.
PINNED_ROUNDING = 1 / math.log(2)


def resident_layers(step: Step, layer: int | None, pace: float) -> float:
    """Layers' worth of saved tensors on the device with ``ac.offload_activations``: at the loss (``layer`` None) the
    last layer's and what the copies out have not taken yet (``pace``: the share of forward's saved bytes PCIe moves
    while forward runs: the copies go in layer order, so the ones left are the latest layers'); in backward of
    ``layer``, its own and the one before (prefetched), and the left ones below them."""
    layers = step.cfg.num_layers
    left = (1 - pace) * max(layers - 1, 0)
    if layer is None:
        return 1 + left
    return min(layer + 1, 2 + max(0.0, left - (layers - 1 - layer)))


def loss_workspace(step: Step) -> float:
    """What the loss holds at its peak (its option's model: all the logits and their gradient, or a chunk's and the
    head's weight gradient)."""
    return step.loss.workspace(step)


@dataclass
class Memory:
    """Device bytes at the peak, by category (``peak`` sums the allocator's; ``outside_allocator`` comes on top
    for what fits), and host bytes."""

    categories: dict[str, float]
    outside_allocator: dict[str, float]
    host: dict[str, float]
    phase: str  # where the peak is: loss | backward layer N | optimizer step
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def peak(self) -> float:
        return sum(self.categories.values())

    @property
    def device_total(self) -> float:
        return self.peak + sum(self.outside_allocator.values())

    @property
    def host_total(self) -> float:
        return sum(self.host.values())

    def gib(self) -> dict:
        return {
            "peak_gib": self.peak / GIB,
            "peak_phase": self.phase,
            "device_total_gib": self.device_total / GIB,
            "by_category_gib": {k: v / GIB for k, v in self.categories.items()},
            "outside_allocator_gib": {k: v / GIB for k, v in self.outside_allocator.items()},
            "host_gib": {k: v / GIB for k, v in self.host.items()},
            "host_total_gib": self.host_total / GIB,
        }


def parameter_sizes(step: Step) -> list[float]:
    """Elements of each parameter tensor this rank holds, in registration order: the embedding, each layer's (input
    norm, q/k/v/o projections, q/k norms, post-attention norm, router, gate/up and down expert stacks), the final
    norm, the LM head."""
    s = step.shapes
    c = s.cfg
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    layer = [
        c.hidden_size,
        c.hidden_size * q,
        c.hidden_size * kv,
        c.hidden_size * kv,
        q * c.hidden_size,
        c.head_dim,
        c.head_dim,
        c.hidden_size,
        c.num_experts * c.hidden_size,
        s.expert_layer_params * 2 / 3,
        s.expert_layer_params / 3,
    ]
    params = [s.embedding_params] + layer * c.num_layers + [c.hidden_size, s.embedding_params]
    return [p / step.mesh.shard for p in params]


def plan_memory(step: Step, offload_pace: float = 1.0) -> Memory:
    """``offload_pace``: with ``ac.offload_activations``, the share of forward's saved bytes PCIe moves while forward
    runs (``moe_lab.plan.step_time.offload_pace``; 1: all of it)."""
    s, mesh, c = step.shapes, step.mesh, step.cfg
    n = s.local_params(mesh)
    layers = c.num_layers
    layer_local = (s.dense_layer_params + s.expert_layer_params) / mesh.shard
    head_local = s.embedding_params / mesh.shard
    fsdp = step.fsdp

    # Model state on the device, per parameter of this rank, as the offload mode keeps it.
    weights, grad_bytes, state, in_flight = step.offload.device_state(step, n)
    grad_of = lambda p: grad_bytes * p  # noqa: E731
    # Gradients at the loss, after layer ``l``'s backward (its own included: they exist while its workspace does)
    # and at the optimizer step. With gradient accumulation the peak is in the last micro-batch, when the earlier
    # ones have left theirs: .grad itself on one rank (offload=full: in bf16, until the final backward's hooks take
    # them), FSDP2's fp32 unsharded accumulators of the whole EP-local model with grad_sync=step.
    layer_grads = lambda l: grad_of(head_local + (layers - l) * layer_local)  # noqa: E731
    grads = {
        "loss": in_flight,
        "step": grad_of(n) + in_flight,
        **{l: layer_grads(l) + in_flight for l in {0, layers - 1}},
    }
    if step.grad_accum > 1:
        if fsdp and step.grad_sync == "step":
            held = 4 * (s.outside_params + layers * s.layer_params_unsharded(mesh))
            grads = {k: v + (held if k != "step" else 0.0) for k, v in grads.items()}
        else:
            grads = {k: (step.offload.accumulated_grad_bytes * n if k != "step" else v) for k, v in grads.items()}

    # FSDP2: the gathered bf16 block (and the next, prefetched), the LM head kept gathered from forward into
    # backward; in backward also the block's unsharded gradients (bf16, then fp32 for the reduce-scatter).
    block = s.layer_params_unsharded(mesh)
    gathered_fwd = (2 * 2 * block + 2 * s.embedding_params) if fsdp else 0.0
    gathered_bwd = (2 * 2 * block + 6 * block + 2 * s.embedding_params) if fsdp else 0.0
    if fsdp and not step.reshard_after_forward:  # every block stays gathered from forward into backward
        gathered_fwd = gathered_bwd = 2 * (s.outside_params + layers * block) + 6 * block
    # One rank: autocast's bf16 copies of the LM head (saved for its backward) and of the current block.
    casts = 2 * (s.embedding_params + block) if not fsdp and step.offload.fp32_weights_on_device else 0.0
    # in backward, the head's copy only where the loss saved it (loss=chunked's backward needs no weight)
    casts_bwd = casts - (0.0 if not casts or step.loss.saves_head_weight else 2 * s.embedding_params)

    fused = fused_saved_per_layer(step)
    saved = saved_per_layer(step) - fused
    workspace = backward_workspace(step)
    base = {**weights, "optimizer state": state, "fp8 weight copies": step.dispatcher.weight_copies(step)}

    def resident(layer: int | None) -> float:
        """Layers' worth of saved tensors on the device at the loss (None) and in backward of ``layer``."""
        if step.ac.offload_activations:
            return resident_layers(step, layer, offload_pace)
        return layers if layer is None else layer + 1

    phases = {}
    # The loss of the last micro-batch: every layer's activations, the logits and their gradient.
    phases["loss"] = {
        **base,
        "grads": grads["loss"],
        "activations": resident(None) * saved,
        "fused dispatcher buffers": resident(None) * fused,
        "loss": loss_workspace(step),
        "bf16 params": base.get("bf16 params", 0.0) + casts,
        "comm buffers (FSDP2)": gathered_fwd,
    }
    # Gradients grow and saved activations shrink by a layer's worth each layer: the peak of the backward is at its
    # first layer or its last.
    for layer in sorted({layers - 1, 0}, reverse=True):
        phases[f"backward layer {layer}"] = {
            **base,
            "grads": grads[layer],
            "activations": resident(layer) * saved + workspace,
            "fused dispatcher buffers": resident(layer) * fused,
            "bf16 params": base.get("bf16 params", 0.0) + casts_bwd,
            "comm buffers (FSDP2)": gathered_bwd,
        }
    after = {**base, "grads": grads["step"], "comm buffers (FSDP2)": 0.0}
    if temporaries := step.offload.step_temporaries(step, n):  # an optimizer step's own allocations on the device
        after["optimizer step temporaries"] = temporaries
    phases["optimizer step"] = after

    totals = {name: sum(parts.values()) for name, parts in phases.items()}
    phase = max(totals, key=totals.get)
    categories = {k: v for k, v in phases[phase].items() if v}

    outside = step.dispatcher.outside_allocator(step)
    host = plan_host(step)
    return Memory(categories, outside, host, phase, {k: v / GIB for k, v in totals.items()})


def offloaded_bytes(step: Step) -> float:
    """Bytes ``ac.offload_activations`` sends to the host (and back) per micro-batch: every layer's saved tensors but
    the last layer's."""
    if not step.ac.offload_activations:
        return 0.0
    return max(step.cfg.num_layers - 1, 0) * saved_per_layer(step)


def plan_host(step: Step) -> dict[str, float]:
    """Host memory of one rank by what holds it (``moe_lab.optim.offload``; offloaded activations)."""
    activations = {"pinned activations": PINNED_ROUNDING * offloaded_bytes(step)} if step.ac.offload_activations else {}
    return step.offload.host(step) | activations
