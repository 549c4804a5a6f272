"""The ``hardware`` group of ``python -m moe_lab.plan``: what a GPU, its links and its host can do, and the mesh of
nodes x GPUs per node the plan runs on.

A profile holds public peak figures (vendor datasheets) and, for each, the fraction of it the kernels this project
runs reach. The fractions' defaults were fitted on this project's H200 records (experiments/plan/README.md says
which record gives which); ``python -m moe_lab.plan.calibrate`` measures them on the GPU it runs on and writes a
profile with its own. A profile for another GPU (h100, b200, b300) sets its peaks and keeps the H200 fractions: that
the kernels reach the same share of each peak there is the planner's main assumption off the H200.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import yaml

from moe_lab.runtime.errors import ConfigError

GIB = 2**30


@dataclass
class Hardware:
    """One GPU model and its machine. Peaks are per GPU and per direction; ``*_efficiency`` the achieved share."""

    name: str
    # Datasheet peaks: each profile's yaml (conf/hardware/) sets them.
    peak_bf16_tflops: float  # dense bf16 tensor-core FLOP/s (no sparsity), also MFU's denominator
    hbm_gib: float  # device memory torch reports as total
    hbm_tbps: float  # device memory bandwidth
    nvlink_gbps: float  # GPU-to-GPU inside a node, per direction
    internode_gbps: float  # GPU-to-GPU across nodes (the GPU's NIC), per direction
    pcie_gbps: float  # host <-> device, per direction
    # Host memory per node, as the OS reports it; null: ``host_memory_gib_per_gpu`` times the node's GPUs (a
    # profile that leaves the node's size to the plan says how much host memory comes with each GPU).
    host_memory_gib: float | None
    host_memory_gbps: float  # per node
    peak_fp8_tflops: float | None = None  # dense e4m3 tensor-core FLOP/s; None: the planner refuses FP8 experts
    nodes: int = 1
    gpus_per_node: int | None = None  # None: the job's own ranks (trainer.nproc_per_node), set by the planner
    host_memory_gib_per_gpu: float | None = None  # what host_memory_gib null scales with the node's GPUs
    # Achieved shares of those peaks (the H200 fit, experiments/plan/README.md).
    dense_gemm_efficiency: float = 0.77  # bf16 matmuls of the model's shapes, forward and backward
    grouped_gemm_efficiency: float = 0.64  # expert grouped GEMMs (DeepGEMM / torch._grouped_mm), forward and backward
    # DeepGEMM's blockwise-FP8 m-grouped GEMMs, of peak_fp8_tflops (experiments/fp8/: 1300 of 1979 TFLOP/s at the 30B
    # experts' gate/up shape, 131k rows, on the H200)
    fp8_grouped_gemm_efficiency: float = 0.66
    # precision=fp8's attention projections, forward and backward through torchao's float8 training with its casts
    # and the launch gaps they add, of peak_fp8_tflops: fitted end to end on the full-depth share at seq 4096 x 4
    # (experiments/tune/records/h200_1gpu_share/2026-12-04_20-56_trace, fp8 beside bf16: their FP8 GEMMs, casts and
    # gaps took 160-172 ms where bf16's projections took 121), below bf16's rate at these shapes; calibrate's
    # one-projection probe leaves the gaps out
    fp8_dense_gemm_efficiency: float = 0.27
    attention_efficiency: float = 0.55  # causal flash attention, executed FLOPs, forward and backward
    hbm_efficiency: float = 0.73  # streaming kernels (AdamW, casts, norms)
    nvlink_efficiency: float = 0.70  # all-to-all and FSDP collectives inside a node
    internode_efficiency: float = 0.80  # FSDP collectives across nodes
    pcie_efficiency: float = 0.83  # pinned host <-> device copies
    # ac.offload_activations: the share of its copies' time the step shows even where compute is long enough to hide
    # them (fitted on full_depth's save-inputs_offload at seq 16384, 0.19 s over the plan without; the same point at
    # 32768 then planned within 0.4 %)
    activation_offload_exposed: float = 0.19
    host_adamw_efficiency: float = (
        0.75  # offload=full's host step kernel in a run (32 bytes per parameter) of host bandwidth
    )
    # What torch's allocator cannot use.
    context_gib: float = 1.0  # CUDA context, cuBLAS / NCCL workspaces, other processes
    host_memory_in_use_gib: float = 4.0  # the OS and other processes on each node
    step_overhead_ms: float = 18.0  # per optimizer step: launch gaps the compute stream idles in (one GPU, compiled)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in ("gpus_per_node", "host_memory_gib", "host_memory_gib_per_gpu") and value is None:
                continue
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if f.name.startswith("host_memory_gib") and not (number and value > 0):
                raise ConfigError(f"hardware.{f.name}", f"must be null or a number > 0, got {value!r}")
            if f.name in ("nodes", "gpus_per_node"):
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise ConfigError(f"hardware.{f.name}", f"must be an integer >= 1, got {value!r}")
            elif f.type == "float" and not (isinstance(value, (int, float)) and value >= 0):
                raise ConfigError(f"hardware.{f.name}", f"must be a number >= 0, got {value!r}")
            if f.name.endswith("_efficiency") and not 0 < value <= 1:
                raise ConfigError(f"hardware.{f.name}", f"must be in (0, 1], got {value!r}")
        if self.host_memory_gib is None and self.host_memory_gib_per_gpu is None:
            raise ConfigError("hardware.host_memory_gib", "must be set (GiB per node) where its per-GPU figure is null")

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def on_mesh(self, gpus_per_node: int) -> Hardware:
        """This profile on its mesh: with ``gpus_per_node`` where it left it to the job (None), and the node's host
        memory where it gave it per GPU."""
        placed = copy.copy(self)
        if placed.gpus_per_node is None:
            placed.gpus_per_node = gpus_per_node
        if placed.host_memory_gib is None:
            placed.host_memory_gib = placed.host_memory_gib_per_gpu * placed.gpus_per_node
        return placed

    # Achieved rates, in bytes/s and FLOP/s.
    def flops(self, kind: str) -> float:
        peak = self.peak_fp8_tflops if kind.startswith("fp8_") else self.peak_bf16_tflops
        if peak is None:  # FP8 GEMMs planned on a profile without an FP8 peak
            raise ConfigError(
                "hardware.peak_fp8_tflops",
                f"FP8 GEMMs (dispatcher.expert_precision=fp8, precision=fp8) are planned at the FP8 peak, which "
                f"hardware={self.name} does not set",
            )
        return peak * 1e12 * getattr(self, f"{kind}_efficiency")

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.hbm_tbps * 1e12 * self.hbm_efficiency

    def link_bytes_per_s(self, across_nodes: bool) -> float:
        if across_nodes:
            return self.internode_gbps * 1e9 * self.internode_efficiency
        return self.nvlink_gbps * 1e9 * self.nvlink_efficiency

    @property
    def pcie_bytes_per_s(self) -> float:
        return self.pcie_gbps * 1e9 * self.pcie_efficiency

    def host_adamw_params_per_s(self, ranks_on_node: int) -> float:
        """offload=full's host step rate of one rank, the node's memory bandwidth shared by its ranks."""
        return self.host_memory_gbps * 1e9 * self.host_adamw_efficiency / 32 / ranks_on_node

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class HardwareFile(Hardware):
    """``hardware=file hardware.path=<profile.yaml>``: a profile written by ``python -m moe_lab.plan.calibrate``
    (keys of ``Hardware``: one GPU and its host); the mesh (``hardware.nodes``, ``hardware.gpus_per_node``) is the
    command's."""

    def __init__(self, path: str, nodes: int = 1, gpus_per_node: int | None = None):
        file = Path(path)
        if not file.is_file():
            raise ConfigError("hardware.path", f"no hardware profile at {path!r}")
        values = yaml.safe_load(file.read_text()) or {}
        values.pop("_target_", None)
        known = {f.name for f in dataclasses.fields(Hardware)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(
                "hardware.path", f"{path}: unknown key {unknown[0]!r}; a profile holds {', '.join(sorted(known))}"
            )
        self.path = path
        super().__init__(**(values | {"nodes": nodes, "gpus_per_node": gpus_per_node}))

    def to_dict(self) -> dict:
        return {"path": self.path, **super().to_dict()}


def profile_path_overrides(argv: list[str]) -> list[str]:
    """``hardware=<a .yaml file>`` is short for ``hardware=file hardware.path=<it>`` (plan's and tune's command lines)."""
    out = []
    for arg in argv:
        key, _, value = arg.partition("=")
        if key == "hardware" and (value.endswith((".yaml", ".yml")) or "/" in value):
            out += ["hardware=file", f"hardware.path={Path(value).resolve()}"]
        else:
            out.append(arg)
    return out
