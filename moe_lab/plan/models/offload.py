"""The offload group's models: where each mode keeps the weights, gradients and optimizer state (device and host),
and what its optimizer step and copies take. The chunks are those the offload code makes of this rank's parameter
shards (``chunks``)."""

from __future__ import annotations

from moe_lab.optim.offload import FullOffload, NoOffload, OptimizerOffload
from moe_lab.optim.offload.full import device_chunk_count
from moe_lab.plan.hardware import Hardware
from moe_lab.plan.memory import Step, parameter_sizes
from moe_lab.plan.models import OptionModel, planner_model
from moe_lab.plan.models.optimizer import ADAMW_BYTES


def pinned(nbytes: float) -> float:
    """torch's pinned host allocator rounds every block up to a power of two."""
    return 0.0 if nbytes <= 0 else float(2 ** int(nbytes - 1).bit_length())


@planner_model("offload", NoOffload)
class NoOffloadPlan(OptionModel):
    name = "none"
    fp32_weights_on_device = True  # fp32 weights, which autocast casts (one rank)
    accumulated_grad_bytes = 4  # per parameter, .grad between micro-batches

    def device_state(self, step: Step, params: float) -> tuple[dict, float, float, float]:
        """Model state on the device: (weights by kind, gradient bytes per parameter at the step, optimizer state,
        gradients in flight to the host)."""
        return {"fp32 params (masters)": 4 * params}, 4, step.optimizer.state_bytes * params, 0.0

    def step_temporaries(self, step: Step, params: float) -> float:
        return step.optimizer.step_temporaries(step, params)

    def host(self, step: Step) -> dict[str, float]:
        return {}

    def optimizer_seconds(self, step: Step, hw: Hardware, params: float) -> dict[str, float]:
        return {"optimizer": params * step.optimizer.device_step_bytes(step) / hw.hbm_bytes_per_s}

    def exposed_pcie(self, step: Step, hw: Hardware, params: float, compute: float) -> float:
        return 0.0


class ChunkedOffloadPlan(NoOffloadPlan):
    """A mode that moves state in chunks of ``offload.chunk_mib``, ``offload.max_inflight`` of them at once."""

    def chunks(self, step: Step, reverse: bool = False, split: bool = False) -> list[float]:
        """Parameter counts of its chunks over this rank's shards in registration order (reversed with ``reverse``):
        ``moe_lab.optim.offload.chunked.chunked``, or with ``split`` offload=optimizer's ``chunked_pieces``, where a
        parameter larger than a chunk is cut into pieces of one (its element-wise optimizers)."""
        params = parameter_sizes(step)
        params = params[::-1] if reverse else params
        limit = self.option.chunk_mib * 2**20 / 4
        piece = limit // 64 * 64 if limit >= 64 else limit
        out, size = [0.0], 0.0
        for p in params:
            for part in [piece] * int(p // piece) + ([p % piece] if p % piece else []) if split and p > piece else [p]:
                if out[-1] and size + part > limit:
                    out.append(0.0)
                    size = 0.0
                out[-1] += part
                size += part
        return out


@planner_model("offload", OptimizerOffload)
class OptimizerOffloadPlan(ChunkedOffloadPlan):
    name = "optimizer"

    def ring_params(self, step: Step) -> float:
        """Parameters whose state its device ring holds at once: ``max_inflight`` of its largest chunk (AdamW and
        SignSGD step larger parameters in pieces of a chunk), at most all of this rank's, as the optimizer sizes it."""
        sizes = self.chunks(step, reverse=True, split=True)
        return min(self.option.max_inflight * max(sizes), sum(sizes))

    def device_state(self, step: Step, params: float) -> tuple[dict, float, float, float]:
        # the device ring its state streams through, at every phase
        return {"fp32 params (masters)": 4 * params}, 4, step.optimizer.state_bytes * self.ring_params(step), 0.0

    def step_temporaries(self, step: Step, params: float) -> float:
        return 0.0

    def host(self, step: Step) -> dict[str, float]:
        # each chunk's state is one pinned block, rounded up to a power of two
        state = step.optimizer.state_bytes
        return {"pinned moments": sum(pinned(state * c) for c in self.chunks(step, reverse=True, split=True))}

    def optimizer_seconds(self, step: Step, hw: Hardware, params: float) -> dict[str, float]:
        return {"optimizer": params * ADAMW_BYTES / hw.hbm_bytes_per_s}  # its exposed PCIe follows the compute

    def exposed_pcie(self, step: Step, hw: Hardware, params: float, compute: float) -> float:
        # The ring's worth of state comes in under the earlier micro-batches; the rest comes in during the last
        # micro-batch's backward as chunks step and free their place (the new state going home in the other
        # direction, and on into the next step, where the host reads no longer wait for it): what that backward,
        # about two thirds of a micro-batch's compute, does not cover is exposed (experiments/offload_accum).
        moved = step.optimizer.state_bytes * (params - self.ring_params(step)) / hw.pcie_bytes_per_s
        return max(0.0, moved - compute / step.grad_accum * 2 / 3)


@planner_model("offload", FullOffload)
class FullOffloadPlan(ChunkedOffloadPlan):
    name = "full"
    fp32_weights_on_device = False  # bf16 weights only (and its device share's masters)
    accumulated_grad_bytes = 2  # .grad in bf16 until the final backward's hooks take them

    def split_chunks(self, step: Step) -> tuple[list[float], list[float]]:
        """Its chunks in backward order, split into those stepped on the host and those on the device (the last
        ones, ``moe_lab.optim.offload.full.device_chunk_count`` of ``offload.device_share``)."""
        sizes = self.chunks(step, reverse=True)
        host = len(sizes) - device_chunk_count(sizes, self.option.device_share)
        return sizes[:host], sizes[host:]

    def device_state(self, step: Step, params: float) -> tuple[dict, float, float, float]:
        host_chunks, device_chunks = self.split_chunks(step)
        on_device = sum(device_chunks)
        weights = {"bf16 params": 2 * params, "fp32 masters on the device": 4 * on_device}
        # gradients leave for the host as they are made, a chunk or so in flight; a device chunk steps with its
        # gradients widened to fp32
        in_flight = 2 * max(host_chunks, default=0.0) + 4 * max(device_chunks, default=0.0)
        return weights, 0, step.optimizer.state_bytes * on_device, in_flight

    def step_temporaries(self, step: Step, params: float) -> float:
        return 0.0

    def host(self, step: Step) -> dict[str, float]:
        host_chunks = self.split_chunks(step)[0]
        on_host = sum(host_chunks)
        return {
            "fp32 masters": 4 * on_host,
            "moments": step.optimizer.state_bytes * on_host,
            "pinned transfer buffers": min(self.option.max_inflight, len(host_chunks))
            * pinned(2 * max(host_chunks, default=0.0)),
        }

    def optimizer_seconds(self, step: Step, hw: Hardware, params: float) -> dict[str, float]:
        # its device chunks step on the GPU as the optimizer does under offload=optimizer, the rest on the host
        host_chunks, device_chunks = self.split_chunks(step)
        ranks_on_node = min(step.mesh.world, step.mesh.gpus_per_node)
        return {
            "optimizer": sum(device_chunks) * ADAMW_BYTES / hw.hbm_bytes_per_s,
            "host_step": sum(host_chunks) / hw.host_adamw_params_per_s(ranks_on_node),
        }
