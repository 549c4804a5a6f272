"""Where a config runs, as validation is told it (``Target``), and facts about this machine that building needs:
its device, its compute precision, whether DeepGEMM imports, its GPUs' PCI addresses."""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Target:
    """What a config is validated for: built by train (``moe_lab.config.validate.job_target``: this machine, the
    job's ranks), by the planner (the hardware profile's mesh and GPU) and for an emulated rank (the emulated
    layout on this machine's device), and handed to every option's ``validate(cfg, target)``."""

    world_size: int  # ranks of the job
    ranks_per_node: int
    device_type: str  # "cuda" where the machine has a GPU, else "cpu"
    # The GPU's (major, minor); None for a planned GPU, whose hardware profile says what it runs (its FP8 peak).
    compute_capability: tuple[int, int] | None
    deep_gemm_error: str | None  # why deep_gemm does not import there; None where it does
    outer_launcher: bool = False  # the job's ranks were started by torchrun / srun, not by the job
    # This machine's GPUs' PCI addresses, whose NUMA nodes offload=full binds to; empty for a planned GPU (a profile's
    # GPUs are not this machine's). Read here once, so that validate touches no CUDA: the tune validates its points in
    # forked workers, where CUDA cannot start again once its parent has started it.
    gpu_pci_addresses: tuple[str, ...] = ()

    def runs_on_cuda(self, trainer) -> bool:
        """The job's device is a GPU: ``trainer.device`` cuda, or auto where the target has one."""
        return trainer.device != "cpu" and self.device_type == "cuda"

    def computes_in_bf16(self, trainer) -> bool:
        """bf16 compute: ``trainer.precision`` bf16, or auto on a GPU (fp32 on CPU)."""
        return trainer.precision == "bf16" or (trainer.precision == "auto" and self.runs_on_cuda(trainer))


def machine_target(world_size: int, ranks_per_node: int, outer_launcher: bool = False) -> Target:
    """This machine as the target of a job of ``world_size`` ranks, ``ranks_per_node`` on each node."""
    cuda = torch.cuda.is_available()
    return Target(
        world_size=world_size,
        ranks_per_node=ranks_per_node,
        device_type="cuda" if cuda else "cpu",
        compute_capability=torch.cuda.get_device_capability() if cuda else None,
        deep_gemm_error=deep_gemm_import_error(),
        outer_launcher=outer_launcher,
        gpu_pci_addresses=tuple(gpu_pci_address(gpu) for gpu in range(torch.cuda.device_count())) if cuda else (),
    )


def gpu_pci_address(gpu_index: int) -> str:
    """sysfs name of a CUDA device's PCI function, e.g. '0000:18:00.0'."""
    props = torch.cuda.get_device_properties(gpu_index)
    return f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"


@functools.cache
def deep_gemm_import_error() -> str | None:
    """Why deep_gemm cannot be imported on this machine; None if it can."""
    try:
        importlib.import_module("deep_gemm")
    except Exception as e:  # ImportError, or a CUDA/toolkit error raised while it loads
        return f"{type(e).__name__}: {e}"
    return None


def runs_on_cuda(trainer) -> bool:
    """The job's device, on this machine, is a GPU: ``trainer.device`` cuda, or auto on a machine with CUDA."""
    return trainer.device != "cpu" and torch.cuda.is_available()


def computes_in_bf16(trainer) -> bool:
    """bf16 compute on this machine: ``trainer.precision`` bf16, or auto on a GPU (fp32 on CPU)."""
    return trainer.precision == "bf16" or (trainer.precision == "auto" and runs_on_cuda(trainer))
