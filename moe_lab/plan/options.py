"""The planner's model of each option: what a dispatcher, an activation checkpointing mode, an offload mode or an
optimizer (or a precision recipe) does to one rank's step memory and time, registered under the option's class (``planner_model``) and
found for a built option by ``model_of``. ``memory`` and ``step_time`` hold what every step shares and ask the
step's models for the rest, so a new option is planned by registering its model here (a test fails when a yaml
of conf/<group>/ names a class without one).

A model is stateless: what an option's values change (its chunk size, the GEMM alignment its backend needs) it
puts into the plan's ``Step`` through ``step_fields``.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import torch

from moe_lab.models.loss import ChunkedLoss, FullLoss
from moe_lab.moe.dispatcher import FusedDispatcher, TorchDispatcher
from moe_lab.moe.fused.ops import SAVES, align
from moe_lab.optim.offload import FullOffload, NoOffload, OptimizerOffload
from moe_lab.optim.optimizers import SignSGD
from moe_lab.parallel.ac import FullCheckpoint, NoCheckpoint, SelectiveCheckpoint
from moe_lab.parallel.precision import Bf16Dense, Fp8Dense
from moe_lab.plan.hardware import Hardware
from moe_lab.plan.memory import (
    Step,
    chunks,
    full_offload_chunks,
    fused_receive_rows,
    op_outputs,
    pinned,
    ring_params,
    routed_rows,
    saved_per_layer,
    state_bytes,
)
from moe_lab.runtime.errors import ConfigError

# group -> option class -> its model, in registration order
MODELS: dict[str, dict[type, object]] = {
    "dispatcher": {},
    "precision": {},
    "ac": {},
    "offload": {},
    "optimizer": {},
    "loss": {},
}
PLANNED_GROUPS = tuple(MODELS)  # the groups whose options a plan depends on


def planner_model(group: str, option_class: type):
    """Class decorator: the planner's model of ``option_class`` (an option of ``group``)."""

    def register(model_class):
        model = model_class()
        model.option_class = option_class
        MODELS[group][option_class] = model
        return model_class

    return register


def option_class(option) -> type:
    """The class an option is of: an optimizer option is a partial of its class."""
    return option.func if isinstance(option, partial) else type(option)


def model_of(group: str, option):
    """The planner's model of a built option of ``group`` (its class's, or the nearest base class's)."""
    cls = option_class(option)
    for klass in cls.__mro__:
        if klass in MODELS[group]:
            return MODELS[group][klass]
    known = ", ".join(f"{c.__module__}.{c.__qualname__}" for c in MODELS[group])
    name = f"{cls.__module__}.{cls.__qualname__}"
    raise ConfigError(f"{group}._target_", f"the planner has no model of {name}; it models {known}")


def named(group: str, name: str):
    """The model of ``group``'s option named ``name`` (its yaml's)."""
    return next(m for m in MODELS[group].values() if m.name == name)


# --- dispatcher -------------------------------------------------------------------------------------------------
# Fitted on the H200 records (experiments/plan/README.md): what each dispatcher's expert compute reaches of the
# grouped-GEMM rate (the torch dispatcher's scope holds its SwiGLU, casts and the grouped GEMM's layout copies) and
# its glue's memory traffic per routed row element (H wide) and pass (forward 1, backward 2, ac=full's recompute 1
# more).
_aten = torch.ops.aten


# FP8 experts (experiments/fp8/README.md): the quantizing kernels' extra traffic over the bf16 glue, per routed row
# element and pass (the routed gradient's quantization, the saved rows' dequantization, the SwiGLU kernels' FP8
# outputs; records/h200_layer/2026-12-01_21-28.json), and the weight copies' quantization from the fp32 masters, once
# per optimizer step: 10 bytes per parameter at the HBM rate, the 4-layer proxy's dispatch_glue beside bf16's
# (records/h200_e2e/2026-12-02_05-44: 8.9 ms more, less the gradients' widening and the glue above), where the
# spilling kernel of the layer records took 13.
FP8_GLUE_BYTES_PER_ELEMENT = 1.5
# The torch dispatcher's FP8 GEMMs place their e4m3 rows in a 128-aligned layout and take their bf16 outputs back
# (moe_lab.moe.fp8.grouped.fp8_grouped_mm), per routed row element and pass: an estimate, not fitted yet.
ALIGNED_LAYOUT_BYTES_PER_ELEMENT = 6.0
FUSED_GLUE_BYTES_PER_ELEMENT = 10.25  # the fused op's dispatch, SwiGLU and combine kernels (bf16)
FP8_WEIGHT_QUANT_BYTES_PER_PARAM = 10.0


class Fp8ExpertsPlan:
    """What ``expert_precision=fp8`` adds to either dispatcher's plan (nothing at bf16): the expert GEMMs but the
    weight gradients' at the FP8 rate, the per-step weight copies and their quantization."""

    def fp8_passes(self, step: Step, passes: float) -> float:
        """Of its expert GEMMs' ``passes``, those at the FP8 rate: every pass but the weight gradients' (bf16
        grouped GEMMs)."""
        return passes - 1.0 if step.expert_precision == "fp8" else 0.0

    def weight_copies(self, step: Step) -> float:
        """Device bytes of expert weight copies it keeps over a step. FP8: every local expert stack in e4m3 and its
        transpose, with a fp32 scale per 128x128 block (``moe_lab.moe.fp8.weights``), kept from the first forward
        of a step to its optimizer step."""
        if step.expert_precision != "fp8":
            return 0.0
        return self._local_expert_params(step) * 2 * (1 + 4 / 128**2)

    def per_step_glue_bytes(self, step: Step) -> float:
        """HBM traffic it adds once per optimizer step (not per micro-batch): FP8's weight quantization."""
        if step.expert_precision != "fp8":
            return 0.0
        return self._local_expert_params(step) * FP8_WEIGHT_QUANT_BYTES_PER_PARAM

    def fp8_expert_params(self, step: Step) -> float:
        """The local expert parameters it runs in FP8 (0 at bf16)."""
        return self._local_expert_params(step) if step.expert_precision == "fp8" else 0.0

    @staticmethod
    def _local_expert_params(step: Step) -> float:
        return step.cfg.num_layers * step.shapes.expert_layer_params / step.mesh.ep

    @staticmethod
    def fp8_row_bytes(step: Step) -> float:
        """A received row as the FP8 op keeps it: e4m3 with a fp32 scale per 128."""
        return step.cfg.hidden_size * (1 + 4 / 128)

    @staticmethod
    def op_residuals(step: Step, rows: float, kept_row_bytes: float) -> float:
        """Bytes per layer the fused op (either precision) keeps for ``rows`` received rows: what its save mode
        keeps of each row (``kept_row_bytes``), its weight and source; the slot positions."""
        return rows * (kept_row_bytes + 4 + 8) + 8 * step.tokens * step.cfg.num_experts_per_tok


@planner_model("dispatcher", TorchDispatcher)
class TorchDispatcherPlan(Fp8ExpertsPlan):
    name = "torch"
    expert_rate = 0.72
    exchange_in_kernels = False  # its NCCL all-to-alls are a category of their own (ep_all_to_all)
    buffer_ops = frozenset()  # no op's saved outputs are counted apart from the activations

    def expert_keep_set(self, step: Step) -> str:
        """The ac.keep set whose ops hold its expert GEMMs (at FP8 its FP8 GEMM op, which it declares)."""
        return "dispatcher" if step.expert_precision == "fp8" else "grouped_mm"

    def save_modes(self, step: Step) -> tuple[str, ...]:
        """The ``dispatcher.save`` values this step may take (none: no such key)."""
        return ()

    def step_fields(self, option, train) -> dict:
        return {"expert_precision": option.expert_precision}

    def kernel_rows(self, step: Step) -> float:
        """Rows its kernels move per layer and pass (step time)."""
        return routed_rows(step)

    def glue_bytes_per_element(self, step: Step) -> float:
        """Its glue's HBM traffic per element of a row its kernels move (H wide), per pass. FP8 (not fitted yet):
        its permutations' and, on top, the quantization and the aligned layout's copies."""
        fp8 = FP8_GLUE_BYTES_PER_ELEMENT + ALIGNED_LAYOUT_BYTES_PER_ELEMENT if step.expert_precision == "fp8" else 0.0
        return 7.3 + fp8

    def dispatch_exchange_share(self, step: Step) -> float:
        """Forward's dispatch exchange, of a bf16 one's bytes (its rows travel in bf16 at either precision)."""
        return 1.0

    def buffer_rows(self, step: Step) -> float:
        """Rows its backward's working set is sized by (memory)."""
        return routed_rows(step)

    def op_outputs(self, step: Step) -> dict:
        """Bytes per layer of its ops' outputs in one block's forward, by op (``memory.op_outputs``)."""
        c, t, k = step.cfg, step.tokens, step.cfg.num_experts_per_tok
        rows = routed_rows(step)
        outputs = {_aten.sort.stable: [16 * t * k]}
        # the grouped GEMMs' outputs (gate/up, the expert output), bf16 at either precision
        gemm = torch.ops.moe_lab.fp8_grouped_mm.default if step.expert_precision == "fp8" else _aten._grouped_mm.default
        outputs[gemm] = [rows * 4 * c.moe_intermediate_size, rows * 2 * c.hidden_size]
        if step.mesh.ep > 1:
            outputs[torch.ops.moe_lab.all_to_all_rows.default] = [rows * 2 * c.hidden_size, t * k * 2 * c.hidden_size]
        return outputs

    # The all-to-all's outputs feed permutations (index_select, whose backward needs the indices alone): without AC
    # autograd does not keep them; selective AC does because the dispatcher names them.
    unread_ops = frozenset({torch.ops.moe_lab.all_to_all_rows.default})

    def elementwise_outputs(self, step: Step) -> float:
        """Bytes per layer of its outputs backward reads that ac=selective recomputes (the routed rows' gather, the
        SwiGLU's inputs: what either precision's grouped GEMMs keep of their inputs)."""
        c = step.cfg
        return routed_rows(step) * 2 * (c.hidden_size + c.moe_intermediate_size)

    def dropped_row_bytes(self, step: Step) -> float:
        """Bytes per row its backward rebuilds beyond what it saved (in backward's working set)."""
        return 0.0

    def backward_rebuild(self, step: Step) -> dict[str, float]:
        """What its backward runs again per layer beyond ac's recompute: gate/up GEMM passes, row gathers and row
        exchanges."""
        return {"gate_up": 0.0, "gathers": 0.0, "exchanges": 0.0}

    def outside_allocator(self, step: Step) -> dict:
        return {}

    def index_adds(self, step: Step) -> int:
        """Its permutation backwards outside any scope (``other``): bf16 index_add with atomics, one per layer (the
        unsort) at EP=1, three at EP>1 (and the received rows' reordering both ways)."""
        return 3 if step.mesh.ep > 1 else 1


@planner_model("dispatcher", FusedDispatcher)
class FusedDispatcherPlan(Fp8ExpertsPlan):
    name = "fused"
    expert_rate = 1.0
    exchange_in_kernels = True  # the rows it pulls and pushes over NVLink are its kernels' work (dispatch_glue)
    # its receive-side residuals and output (the op, at either expert precision)
    buffer_ops = frozenset({torch.ops.moe_lab.fused_moe.default})
    unread_ops = frozenset()

    def expert_keep_set(self, step: Step) -> str:
        return "dispatcher"  # its expert GEMMs run inside the op it declares

    def save_modes(self, step: Step) -> tuple[str, ...]:
        return tuple(SAVES)  # at either precision

    def step_fields(self, option: FusedDispatcher, train) -> dict:
        # The GPU machine's backend by the dispatcher's own rule, DeepGEMM taken as importable there.
        return {
            "fused_align": align(option.gpu_backend(train.parallel.ep, deep_gemm_error=None)),
            "fused_save": option.save,
            "expert_precision": option.expert_precision,
        }

    def kernel_rows(self, step: Step) -> float:
        # the padded received rows (a worst-case buffer's unused rows are skipped)
        return fused_receive_rows(step, worst_case=False)

    def buffer_rows(self, step: Step) -> float:
        return fused_receive_rows(step)

    def glue_bytes_per_element(self, step: Step) -> float:
        return FUSED_GLUE_BYTES_PER_ELEMENT + (FP8_GLUE_BYTES_PER_ELEMENT if step.expert_precision == "fp8" else 0.0)

    def dispatch_exchange_share(self, step: Step) -> float:
        # FP8 dispatches e4m3 rows with a fp32 scale per 128
        return (1 + 4 / 128) / 2 if step.expert_precision == "fp8" else 1.0

    def op_outputs(self, step: Step) -> dict:
        # per received row: x_routed and gate/up where dispatcher.save keeps them
        kept = self._row_bytes(step, "inputs") - self.dropped_row_bytes(step)
        # Its output [T, H] only uncompiled, where selective AC caches every output of a kept op: compiled, the
        # partitioner keeps what backward reads, and no backward reads it (it feeds the residual add).
        output = 0 if step.compile else 2 * step.tokens * step.cfg.hidden_size
        saved = output + self.op_residuals(step, fused_receive_rows(step), kept)
        return {torch.ops.moe_lab.fused_moe.default: [saved]}

    def elementwise_outputs(self, step: Step) -> float:
        """The op's input, which autograd keeps for it where save=inputs."""
        return 2 * step.tokens * step.cfg.hidden_size if "x_routed" not in SAVES[step.fused_save] else 0.0

    def _row_bytes(self, step: Step, save: str) -> float:
        """Bytes per received row the ``save`` mode does not keep: gate/up (2I in bf16) where it drops them, and the
        row itself (H: bf16, or FP8's e4m3 with a fp32 scale per 128) where it drops the rows."""
        c, kept = step.cfg, SAVES[save]
        gate_up = 0.0 if "gate_up" in kept else 4 * c.moe_intermediate_size
        row = self.fp8_row_bytes(step) if step.expert_precision == "fp8" else 2 * c.hidden_size
        return gate_up + (0.0 if "x_routed" in kept else row)

    def dropped_row_bytes(self, step: Step) -> float:
        return self._row_bytes(step, step.fused_save)

    def backward_rebuild(self, step: Step) -> dict[str, float]:
        # dropped gate/up: its GEMM again; dropped rows: their gather (and the rows' exchange at EP > 1) again
        kept = SAVES[step.fused_save]
        gathers = float("x_routed" not in kept)
        return {"gate_up": float("gate_up" not in kept), "gathers": gathers, "exchanges": gathers * (step.mesh.ep > 1)}

    def outside_allocator(self, step: Step) -> dict:
        """The symmetric workspace at EP>1: 4 receive-side buffers, the 1.25x ladder."""
        if step.mesh.ep == 1:
            return {}
        c, rows = step.cfg, fused_receive_rows(step) * 1.25
        workspace = rows * (8 + 4 + 4 + 2 * c.hidden_size) + 2 * 2 * step.tokens * c.hidden_size
        return {"fused symmetric workspace": workspace}

    def index_adds(self, step: Step) -> int:
        return 0


# --- precision ----------------------------------------------------------------------------------------------------
# The experts' precision is the dispatchers' (expert_precision, above); a precision option's model says which dense
# GEMMs run in FP8: their forward and backward at ``hardware.fp8_dense_gemm_efficiency`` of the FP8 peak, a rate
# that holds the FP8 casts of their inputs, weights and gradients (calibrate measures it so). Memory as at bf16:
# torchao's float8 linears keep the same high-precision input for backward.
@planner_model("precision", Bf16Dense)
class Bf16DensePlan:
    name = "bf16"

    def step_fields(self, option, train) -> dict:
        return {}

    def fp8_dense_flops(self, step: Step) -> float:
        """One micro-batch's forward FLOPs of the dense linears in FP8 (a part of ``Shapes.layer_dense_flops``)."""
        return 0.0


@planner_model("precision", Fp8Dense)
class Fp8DensePlan(Bf16DensePlan):
    name = "fp8"

    def step_fields(self, option: Fp8Dense, train) -> dict:
        return {"fp8_linears": option.linears}

    def fp8_dense_flops(self, step: Step) -> float:
        c = step.cfg
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        sizes = {"q_proj": q, "k_proj": kv, "v_proj": kv, "o_proj": q}
        return c.num_layers * 2 * step.tokens * c.hidden_size * sum(sizes[name] for name in step.fp8_linears)


# --- activation checkpointing -----------------------------------------------------------------------------------
@planner_model("ac", NoCheckpoint)
class NoCheckpointPlan:
    name = "none"
    recompute_passes = 0.0  # forwards of the whole block backward runs again, beyond the one
    keeps_elementwise = True  # autograd keeps the elementwise outputs backward reads

    def step_fields(self, option, train) -> dict:
        return {"offload_activations": option.offload_activations}

    def recomputed(self, step: Step, part: str) -> float:
        """Forward passes of ``part`` (dense | attention | dispatcher | experts) backward runs again."""
        return self.recompute_passes

    def keeps(self, op, step: Step) -> bool:
        """Whether the block keeps ``op``'s outputs for backward: every output backward reads."""
        return op not in step.dispatcher.unread_ops

    def recompute_workspace(self, step: Step) -> float:
        return 0.0


@planner_model("ac", SelectiveCheckpoint)
class SelectiveCheckpointPlan(NoCheckpointPlan):
    name = "selective"
    keeps_elementwise = False

    def step_fields(self, option: SelectiveCheckpoint, train) -> dict:
        return {"keep": tuple(option.keep), "offload_activations": option.offload_activations}

    def keeps(self, op, step: Step) -> bool:
        return op in step.saved_ops

    def recomputed(self, step: Step, part: str) -> float:
        # those of the sets ac.keep leaves out (the experts: the set the dispatcher's expert GEMMs are in)
        needs = {"dense": "matmul", "attention": "attention", "dispatcher": "dispatcher"}.get(part)
        if part == "experts":
            needs = step.dispatcher.expert_keep_set(step)
        return 0.0 if needs in step.keep else 1.0

    def recompute_workspace(self, step: Step) -> float:
        """The outputs of the sets ac.keep leaves out, recomputed for one layer."""
        return sum(sum(sizes) for op, sizes in op_outputs(step).items() if op not in step.saved_ops)


@planner_model("ac", FullCheckpoint)
class FullCheckpointPlan(NoCheckpointPlan):
    name = "full"
    recompute_passes = 1.0
    keeps_elementwise = False

    def step_fields(self, option, train) -> dict:
        return {}

    def keeps(self, op, step: Step) -> bool:
        return False

    def recompute_workspace(self, step: Step) -> float:
        """Backward's recomputed forward of one block: what that block keeps without AC."""
        return saved_per_layer(dataclasses.replace(step, ac=named("ac", "none")))


# --- optimizer ----------------------------------------------------------------------------------------------------
ADAMW_BYTES = 28  # fp32 param, grad, exp_avg, exp_avg_sq read; param and moments written
FOREACH_ADAMW_BYTES = 60  # the same through foreach kernels, one pass per op


@planner_model("optimizer", torch.optim.AdamW)
class AdamWPlan:
    name = "adamw"
    state_bytes = 8  # exp_avg, exp_avg_sq in fp32

    def step_fields(self, option, train) -> dict:
        return {"foreach": not option.keywords.get("fused", False)}  # without fused=true: torch's foreach path

    def device_step_bytes(self, step: Step) -> float:
        """HBM traffic of its step per parameter on the device."""
        return FOREACH_ADAMW_BYTES if step.foreach else ADAMW_BYTES

    def step_temporaries(self, step: Step, params: float) -> float:
        """Device bytes its step allocates over ``params`` parameters: foreach AdamW's sqrt(exp_avg_sq) of every
        parameter at once."""
        return 4 * params if step.foreach else 0.0


@planner_model("optimizer", SignSGD)
class SignSGDPlan:
    name = "signsgd"
    state_bytes = 0

    def step_fields(self, option, train) -> dict:
        return {}

    def device_step_bytes(self, step: Step) -> float:
        return 12

    def step_temporaries(self, step: Step, params: float) -> float:
        return 0.0


# --- offload ------------------------------------------------------------------------------------------------------
@planner_model("offload", NoOffload)
class NoOffloadPlan:
    name = "none"
    fp32_weights_on_device = True  # fp32 weights, which autocast casts (one rank)
    accumulated_grad_bytes = 4  # per parameter, .grad between micro-batches

    def step_fields(self, option, train=None) -> dict:
        return {}

    def device_state(self, step: Step, params: float) -> tuple[dict, float, float, float]:
        """Model state on the device: (weights by kind, gradient bytes per parameter at the step, optimizer state,
        gradients in flight to the host)."""
        return {"fp32 params (masters)": 4 * params}, 4, state_bytes(step) * params, 0.0

    def step_temporaries(self, step: Step, params: float) -> float:
        return step.optimizer.step_temporaries(step, params)

    def host(self, step: Step) -> dict[str, float]:
        return {}

    def optimizer_seconds(self, step: Step, hw: Hardware, params: float) -> dict[str, float]:
        return {"optimizer": params * step.optimizer.device_step_bytes(step) / hw.hbm_bytes_per_s}

    def exposed_pcie(self, step: Step, hw: Hardware, params: float, compute: float) -> float:
        return 0.0


@planner_model("offload", OptimizerOffload)
class OptimizerOffloadPlan(NoOffloadPlan):
    name = "optimizer"

    def step_fields(self, option: OptimizerOffload, train=None) -> dict:
        return {"chunk_mib": option.chunk_mib, "max_inflight": option.max_inflight}

    def device_state(self, step: Step, params: float) -> tuple[dict, float, float, float]:
        # the device ring its state streams through, at every phase
        return {"fp32 params (masters)": 4 * params}, 4, state_bytes(step) * ring_params(step), 0.0

    def step_temporaries(self, step: Step, params: float) -> float:
        return 0.0

    def host(self, step: Step) -> dict[str, float]:
        # each chunk's state is one pinned block, rounded up to a power of two
        return {"pinned moments": sum(pinned(state_bytes(step) * c) for c in chunks(step, reverse=True, split=True))}

    def optimizer_seconds(self, step: Step, hw: Hardware, params: float) -> dict[str, float]:
        return {"optimizer": params * ADAMW_BYTES / hw.hbm_bytes_per_s}  # its exposed PCIe follows the compute

    def exposed_pcie(self, step: Step, hw: Hardware, params: float, compute: float) -> float:
        # The ring's worth of state comes in under the earlier micro-batches; the rest comes in during the last
        # micro-batch's backward as chunks step and free their place (the new state going home in the other
        # direction, and on into the next step, where the host reads no longer wait for it): what that backward,
        # about two thirds of a micro-batch's compute, does not cover is exposed (experiments/offload_accum).
        moved = state_bytes(step) * (params - ring_params(step)) / hw.pcie_bytes_per_s
        return max(0.0, moved - compute / step.grad_accum * 2 / 3)


@planner_model("offload", FullOffload)
class FullOffloadPlan(NoOffloadPlan):
    name = "full"
    fp32_weights_on_device = False  # bf16 weights only (and its device share's masters)
    accumulated_grad_bytes = 2  # .grad in bf16 until the final backward's hooks take them

    def step_fields(self, option: FullOffload, train=None) -> dict:
        return {"chunk_mib": option.chunk_mib, "max_inflight": option.max_inflight, "device_share": option.device_share}

    def device_state(self, step: Step, params: float) -> tuple[dict, float, float, float]:
        host_chunks, device_chunks = full_offload_chunks(step)
        on_device = sum(device_chunks)
        weights = {"bf16 params": 2 * params, "fp32 masters on the device": 4 * on_device}
        # gradients leave for the host as they are made, a chunk or so in flight; a device chunk steps with its
        # gradients widened to fp32
        in_flight = 2 * max(host_chunks, default=0.0) + 4 * max(device_chunks, default=0.0)
        return weights, 0, state_bytes(step) * on_device, in_flight

    def step_temporaries(self, step: Step, params: float) -> float:
        return 0.0

    def host(self, step: Step) -> dict[str, float]:
        host_chunks = full_offload_chunks(step)[0]
        on_host = sum(host_chunks)
        return {
            "fp32 masters": 4 * on_host,
            "moments": state_bytes(step) * on_host,
            "pinned transfer buffers": min(step.max_inflight, len(host_chunks))
            * pinned(2 * max(host_chunks, default=0.0)),
        }

    def optimizer_seconds(self, step: Step, hw: Hardware, params: float) -> dict[str, float]:
        # its device chunks step on the GPU as the optimizer does under offload=optimizer, the rest on the host
        host_chunks, device_chunks = full_offload_chunks(step)
        ranks_on_node = min(step.mesh.world, step.mesh.gpus_per_node)
        return {
            "optimizer": sum(device_chunks) * ADAMW_BYTES / hw.hbm_bytes_per_s,
            "host_step": sum(host_chunks) / hw.host_adamw_params_per_s(ranks_on_node),
        }


# --- loss ---------------------------------------------------------------------------------------------------------
# The LM head's GEMMs are the same three passes under either loss (``dense_gemm``: forward's, and backward's for the
# hidden states' and the weight's gradients, which chunked runs in forward): what differs is what the loss holds at its
# peak and its memory traffic (``other``).
LOSS_BYTES_PER_LOGIT = 12.0  # the compiled loss: bf16 logits read, fp32 log-softmax forward and backward
# loss=chunked over several chunks, per head parameter: each chunk's bf16 share of the weight gradient written and
# read, the fp32 sum read and written; once, the sum scaled in place and cast to bf16
CHUNK_SUM_BYTES_PER_PARAM = 12.0
SUM_CAST_BYTES_PER_PARAM = 14.0
EAGER_CHUNK_BYTES_PER_LOGIT = 19.0  # uncompiled chunk: bf16 logits, fp32 upcast, exponentials, select, scaled


@planner_model("loss", FullLoss)
class FullLossPlan:
    name = "full"
    saves_head_weight = True  # for backward (one rank: autocast's bf16 copy of the fp32 head, kept into backward)

    def step_fields(self, option, train) -> dict:
        return {}

    def peak_bytes(self, tokens: int, hidden_size: int, vocab_size: int, chunk_tokens: int | None, compiled: bool):
        """Device bytes it holds at its peak beyond its inputs: the logits [T, V] in bf16 and their gradient;
        uncompiled, the fp32 upcast and log-softmax too."""
        return tokens * vocab_size * (2 + 2 if compiled else 2 + 4 + 4 + 4)

    def workspace(self, step: Step) -> float:
        """What it holds at the loss, the step's memory phase (``memory.plan_memory``)."""
        c = step.cfg
        return self.peak_bytes(step.tokens, c.hidden_size, c.vocab_size, step.loss_chunk_tokens, step.compile)

    def traffic_bytes(self, step: Step) -> float:
        """HBM bytes of its memory-bound work per micro-batch (``other``)."""
        return step.tokens * step.cfg.vocab_size * LOSS_BYTES_PER_LOGIT


@planner_model("loss", ChunkedLoss)
class ChunkedLossPlan(FullLossPlan):
    name = "chunked"
    saves_head_weight = False  # its gradients are made in forward

    def step_fields(self, option: ChunkedLoss, train) -> dict:
        return {"loss_chunk_tokens": option.chunk_tokens}

    def peak_bytes(self, tokens: int, hidden_size: int, vocab_size: int, chunk_tokens: int | None, compiled: bool):
        """One chunk's logits and their gradient (uncompiled, ``EAGER_CHUNK_BYTES_PER_LOGIT``), the hidden states'
        gradient [T, H] in bf16 and the weight's: over one chunk in bf16; over several in fp32 beside, once the
        chunk's logits are gone, the chunk's bf16 share of it and the logits' gradient."""
        chunk = min(chunk_tokens, tokens) * vocab_size
        in_chunk = chunk * (4 if compiled else EAGER_CHUNK_BYTES_PER_LOGIT)
        head, grad_hidden = hidden_size * vocab_size, 2 * tokens * hidden_size
        if tokens <= chunk_tokens:
            return 2 * head + grad_hidden + in_chunk
        return 4 * head + grad_hidden + max(in_chunk, 2 * chunk + 2 * head)

    def traffic_bytes(self, step: Step) -> float:
        """The logits' reads and writes as ``full``'s, chunk by chunk; over several chunks the weight gradient's sum."""
        logits = super().traffic_bytes(step)
        chunks = -(-step.tokens // step.loss_chunk_tokens)
        if chunks == 1:
            return logits
        head = step.cfg.hidden_size * step.cfg.vocab_size
        return logits + head * (chunks * CHUNK_SUM_BYTES_PER_PARAM + SUM_CAST_BYTES_PER_PARAM)
