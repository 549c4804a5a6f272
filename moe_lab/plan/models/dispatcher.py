"""The dispatcher group's models: each dispatcher's expert rate, glue traffic and exchange, the ops whose outputs
it keeps and the buffers it holds; what ``expert_precision=fp8`` adds to either."""

from __future__ import annotations

import torch

from moe_lab.moe.dispatcher import FusedDispatcher, TorchDispatcher
from moe_lab.moe.fused.ops import SAVES, align
from moe_lab.parallel.ac import KEEP_SETS, kept_ops
from moe_lab.plan.memory import Step, routed_rows
from moe_lab.plan.models import OptionModel, planner_model

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
# What a torch-dispatcher permutation costs beyond its glue, per element, by ``permute``. select: its backward's zero
# fill and index_add with atomics, fitted on the H200's 10 ms per 4 layers of 131,072 rows x 2048 (experiments/plan/
# README.md). copy: its backward's gather and its forward's materialized scatter (Inductor's index_copy kernels, at
# about a quarter of HBM's rate in the trace), fitted on one H100 (no H200 could be started): select -> copy took
# 321 ms off reference_30b's emulated rank 0 of 8 (torch + full AC, 2.499 -> 2.178 s), where 20 bytes less plan 316
# (experiments/emulate/README.md, "The torch dispatcher's permutations").
PERMUTATION_BYTES_PER_ELEMENT = {"copy": 12.0, "select": 32.0}
FUSED_GLUE_BYTES_PER_ELEMENT = 10.25  # the fused op's dispatch, SwiGLU and combine kernels (bf16)
FP8_WEIGHT_QUANT_BYTES_PER_PARAM = 10.0
# The fused op's FP8 weight gradients (where ``dispatcher.wgrad_precision=fp8``): DeepGEMM 0.1.5's
# k-grouped FP8 kernel reached 890 TFLOP/s on the H200 at 16 experts x 8,192 rows, gate/up and down together, for
# both the 30B and the 235B widths (experiments/fp8/records/h200_kernel_probe/2026-12-03_14-20.json: 796-954 each),
# 0.45 of the FP8 peak. The planner bills a pass either at the bf16 grouped rate or at the FP8 one: this share of
# the weight gradients' pass at the FP8 rate (the rest at bf16's) gives 890 at the H200 profile's rates
# (0.64 x 989 and 0.66 x 1979 TFLOP/s): x / 1306 + (1 - x) / 633 = 1 / 890.
FP8_WGRAD_FP8_SHARE = 0.56
# Their operands requantized in 128-row tiles (moe_lab.moe.fp8.kernels.quantize_k_tiles: each read, written as e4m3
# with a scale per 128), less the bf16 path's dequantization of the kept rows, per routed row element (H wide) once per
# backward, at the Qwen3 experts' moe_intermediate = 0.375 x hidden (30B and 235B alike): the gate/up
# gradient 2 x 0.375 x 3 + the FP8 rows 2 + the output gradient 3 + the activation 0.375 x 3 - the dequantization 3
# = 5.4 bytes, an estimate from the bytes moved (the probe's quantizer point ran out of its time budget).
FP8_WGRAD_GLUE_BYTES_PER_ELEMENT = 5.4


class DispatcherPlan(OptionModel):
    """What either dispatcher's plan shares: its ``expert_precision`` (nothing added at bf16; FP8: the expert GEMMs
    but the weight gradients' at the FP8 rate (the fused op's weight gradients too at its ``wgrad_precision=fp8``),
    the per-step weight copies and their quantization) and the ac.keep set of its expert GEMMs."""

    expert_gemm_op: object  # the op its expert GEMMs run as (or inside)

    @property
    def fp8(self) -> bool:
        return self.option.expert_precision == "fp8"

    @property
    def declared_ops(self) -> frozenset:
        """The ops it declares for ac=selective to keep (its option's ``saved_ops``)."""
        return self.option.saved_ops

    def expert_keep_set(self, step: Step) -> str:
        """The ac.keep set whose ops hold its expert GEMMs: the generic set of their op, or the one it declares it
        in."""
        declared = {"dispatcher": self.declared_ops}
        return next(name for name in KEEP_SETS if self.expert_gemm_op in kept_ops([name], declared))

    def fp8_passes(self, step: Step, passes: float) -> float:
        """Of its expert GEMMs' ``passes``, those at the FP8 rate: every pass but the weight gradients' (bf16
        grouped GEMMs)."""
        return passes - 1.0 if self.fp8 else 0.0

    def weight_copies(self, step: Step) -> float:
        """Device bytes of expert weight copies it keeps over a step. FP8: every local expert stack in e4m3 and its
        transpose, with a fp32 scale per 128x128 block (``moe_lab.moe.fp8.weights``), kept from the first forward
        of a step to its optimizer step."""
        return self.fp8_expert_params(step) * 2 * (1 + 4 / 128**2)

    def per_step_glue_bytes(self, step: Step) -> float:
        """HBM traffic it adds once per optimizer step (not per micro-batch): FP8's weight quantization."""
        return self.fp8_expert_params(step) * FP8_WEIGHT_QUANT_BYTES_PER_PARAM

    def fp8_expert_params(self, step: Step) -> float:
        """The local expert parameters it runs in FP8 (0 at bf16)."""
        return step.cfg.num_layers * step.shapes.expert_layer_params / step.mesh.ep if self.fp8 else 0.0

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
class TorchDispatcherPlan(DispatcherPlan):
    name = "torch"
    expert_rate = 0.72
    exchange_in_kernels = False  # its NCCL all-to-alls are a category of their own (ep_all_to_all)
    buffer_ops = frozenset()  # no op's saved outputs are counted apart from the activations
    # The all-to-all's outputs feed permutations (index_select, whose backward needs the indices alone): without AC
    # autograd does not keep them; selective AC does because the dispatcher names them.
    unread_ops = frozenset({torch.ops.moe_lab.all_to_all_rows.default})

    @property
    def expert_gemm_op(self):
        """``moe_lab.moe.experts.grouped_swiglu``'s GEMMs at its precision."""
        return torch.ops.moe_lab.fp8_grouped_mm.default if self.fp8 else _aten._grouped_mm.default

    def save_modes(self, step: Step) -> tuple[str, ...]:
        """The ``dispatcher.save`` values this step may take (none: no such key)."""
        return ()

    def kernel_rows(self, step: Step) -> float:
        """Rows its kernels move per layer and pass (step time)."""
        return routed_rows(step)

    def glue_bytes_per_element(self, step: Step) -> float:
        """Its glue's HBM traffic per element of a row its kernels move (H wide), per pass. FP8 (not fitted yet):
        its permutations' and, on top, the quantization and the aligned layout's copies."""
        fp8 = FP8_GLUE_BYTES_PER_ELEMENT + ALIGNED_LAYOUT_BYTES_PER_ELEMENT if self.fp8 else 0.0
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
        outputs[self.expert_gemm_op] = [rows * 4 * c.moe_intermediate_size, rows * 2 * c.hidden_size]
        if step.mesh.ep > 1:
            outputs[torch.ops.moe_lab.all_to_all_rows.default] = [rows * 2 * c.hidden_size, t * k * 2 * c.hidden_size]
        return outputs

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

    def permutation_bytes_per_element(self, step: Step) -> float:
        """HBM traffic of its permutations beyond its glue, billed in ``other`` (where select's backwards fall), per
        layer and element of a routed row (H wide): one permutation per layer (the unsort) at EP=1, three at EP>1
        (and the received rows' reordering both ways), each as its ``permute`` runs it
        (``moe_lab.moe.dispatcher.permute_rows``)."""
        per_permutation = PERMUTATION_BYTES_PER_ELEMENT[self.option.permute]
        return per_permutation * (3 if step.mesh.ep > 1 else 1)


@planner_model("dispatcher", FusedDispatcher)
class FusedDispatcherPlan(DispatcherPlan):
    name = "fused"
    expert_rate = 1.0
    exchange_in_kernels = True  # the rows it pulls and pushes over NVLink are its kernels' work (dispatch_glue)
    expert_gemm_op = torch.ops.moe_lab.fused_moe.default  # its expert GEMMs run inside its op
    # its receive-side residuals and output (the op, at either expert precision)
    buffer_ops = frozenset({torch.ops.moe_lab.fused_moe.default})
    unread_ops = frozenset()

    def save_modes(self, step: Step) -> tuple[str, ...]:
        return tuple(SAVES)  # at either precision

    def align(self, step: Step) -> int:
        """Rows per expert segment of its op's buffers: those of the GPU backend it runs at the step's EP degree on
        the step's target (the option's own rule)."""
        return align(self.option.gpu_backend(step.mesh.ep, step.target.deep_gemm_error))

    def receive_rows(self, step: Step) -> float:
        """Rows of the op's receive buffer and saved residuals (``moe_lab.moe.fused.layout``): the rows received,
        each local expert's segment padded to the GEMM's alignment (half a block on average, one at least)."""
        local_experts, align = step.cfg.num_experts // step.mesh.ep, self.align(step)
        per_expert = routed_rows(step) / local_experts
        padded = -(-per_expert // align) * align if per_expert == int(per_expert) else per_expert + align / 2
        return local_experts * max(padded, align)

    def kernel_rows(self, step: Step) -> float:
        return self.receive_rows(step)

    def buffer_rows(self, step: Step) -> float:
        return self.receive_rows(step)

    def glue_bytes_per_element(self, step: Step) -> float:
        from moe_lab.plan.step_time import passes  # (step_time plans with these models)

        fp8 = FP8_GLUE_BYTES_PER_ELEMENT
        if self.fp8_wgrad(step):  # once per backward, not per pass
            fp8 += FP8_WGRAD_GLUE_BYTES_PER_ELEMENT / passes(step, "dispatcher")
        return FUSED_GLUE_BYTES_PER_ELEMENT + (fp8 if self.fp8 else 0.0)

    def fp8_wgrad(self, step: Step) -> bool:
        """Whether its op runs the weight gradients in FP8: the option's ``wgrad_precision`` (fp8 at
        ``expert_precision=fp8`` only, as the option validates)."""
        return self.fp8 and self.option.wgrad_precision == "fp8"

    def fp8_passes(self, step: Step, passes: float) -> float:
        """Every pass but the weight gradients', and where its op runs those in FP8 their share at the FP8 rate."""
        fp8 = super().fp8_passes(step, passes)
        return fp8 + FP8_WGRAD_FP8_SHARE if self.fp8_wgrad(step) else fp8

    def dispatch_exchange_share(self, step: Step) -> float:
        # FP8 dispatches e4m3 rows with a fp32 scale per 128
        return (1 + 4 / 128) / 2 if self.fp8 else 1.0

    def op_outputs(self, step: Step) -> dict:
        # per received row: x_routed and gate/up where dispatcher.save keeps them
        kept = self._row_bytes(step, "inputs") - self.dropped_row_bytes(step)
        # Its output [T, H] only uncompiled, where selective AC caches every output of a kept op: compiled, the
        # partitioner keeps what backward reads, and no backward reads it (it feeds the residual add).
        output = 0 if step.compile else 2 * step.tokens * step.cfg.hidden_size
        saved = output + self.op_residuals(step, self.receive_rows(step), kept)
        return {torch.ops.moe_lab.fused_moe.default: [saved]}

    def elementwise_outputs(self, step: Step) -> float:
        """The op's input, which autograd keeps for it where save=inputs."""
        return 2 * step.tokens * step.cfg.hidden_size if "x_routed" not in SAVES[self.option.save] else 0.0

    def _row_bytes(self, step: Step, save: str) -> float:
        """Bytes per received row the ``save`` mode does not keep: gate/up (2I in bf16) where it drops them, and the
        row itself (H: bf16, or FP8's e4m3 with a fp32 scale per 128) where it drops the rows."""
        c, kept = step.cfg, SAVES[save]
        gate_up = 0.0 if "gate_up" in kept else 4 * c.moe_intermediate_size
        row = self.fp8_row_bytes(step) if self.fp8 else 2 * c.hidden_size
        return gate_up + (0.0 if "x_routed" in kept else row)

    def dropped_row_bytes(self, step: Step) -> float:
        return self._row_bytes(step, self.option.save)

    def backward_rebuild(self, step: Step) -> dict[str, float]:
        # dropped gate/up: its GEMM again; dropped rows: their gather (and the rows' exchange at EP > 1) again
        kept = SAVES[self.option.save]
        gathers = float("x_routed" not in kept)
        return {"gate_up": float("gate_up" not in kept), "gathers": gathers, "exchanges": gathers * (step.mesh.ep > 1)}

    def outside_allocator(self, step: Step) -> dict:
        """The symmetric workspace at EP>1: 4 receive-side buffers, the 1.25x ladder."""
        if step.mesh.ep == 1:
            return {}
        c, rows = step.cfg, self.receive_rows(step) * 1.25
        workspace = rows * (8 + 4 + 4 + 2 * c.hidden_size) + 2 * 2 * step.tokens * c.hidden_size
        return {"fused symmetric workspace": workspace}

    def permutation_bytes_per_element(self, step: Step) -> float:
        return 0.0
