"""Where weights and optimizer state live: the ``offload`` group. Each option turns (model, optimizer factory,
compute dtype) into the ``torch.optim.Optimizer`` the training loop steps and an LR scheduler drives; the loop never
asks which option it has (the ``Offload`` contract). With gradient accumulation (``trainer.grad_accum``) the loop
calls the option's ``before_micro_batch(optimizer, final)`` before each micro-batch: gradients accumulate on the
device until the final micro-batch's backward, whose gradients are the step's.

| option      | on the device                              | in host memory                        | optimizer step    |
|-------------|--------------------------------------------|---------------------------------------|-------------------|
| `none`      | fp32 weights, grads, optimizer state       | -                                     | device, after bwd |
| `optimizer` | fp32 weights and grads, a few state slots | optimizer state (pinned)              | device, in bwd    |
| `full`      | compute-dtype (bf16) weights only [1]      | fp32 masters, state, transfer buffers | host, in backward |

[1] and, with ``device_share``, that share's fp32 masters and state, stepped on the device in backward.

``none`` and ``optimizer`` compute in bf16 on GPU through autocast (one rank) or FSDP2's mixed-precision policy.
The implementations sit beside this module: ``optimizer.py`` (streamed optimizer state), ``full.py`` (the
in-backward host optimizer), ``chunked.py`` (the chunk split and the optimizer both are made of), ``host.py`` (host
buffers, side-stream copies), ``numa.py`` (CPU binding for ``full``).
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch
from omegaconf import DictConfig

from moe_lab.optim.offload import numa
from moe_lab.optim.offload.full import InBackwardOptimizer
from moe_lab.optim.offload.host_step import HOST_ADAMW_LACKS
from moe_lab.optim.offload.optimizer import StreamedStateOptimizer
from moe_lab.parallel.sharding import local_shard
from moe_lab.runtime.device import Target, gpu_pci_address
from moe_lab.runtime.errors import ConfigError

log = logging.getLogger(__name__)

# Optimizers whose host step full offload runs (host_step.py: both are steps of its C kernel).
HOST_OPTIMIZERS = ("torch.optim.AdamW", "moe_lab.optim.optimizers.SignSGD")


def _training_device(model: torch.nn.Module) -> torch.device:
    return local_shard(next(model.parameters())).device


def _check_chunking(chunk_mib: float, max_inflight: int) -> None:
    if not 0 < chunk_mib < math.inf:  # nan fails both comparisons
        raise ConfigError("offload.chunk_mib", f"must be a finite number > 0, got {chunk_mib}")
    if max_inflight < 1:
        raise ConfigError("offload.max_inflight", f"must be >= 1, got {max_inflight}")


def _refuse_grad_clip(cfg: DictConfig, mode: str) -> None:
    if cfg.trainer.grad_clip is not None:
        raise ConfigError(
            "trainer.grad_clip",
            f"must be null with {mode} (its chunks step in backward, before a global gradient norm exists), got {cfg.trainer.grad_clip}",
        )


@runtime_checkable
class Offload(Protocol):
    """What an ``offload`` option provides: validation calls ``validate``; the trainer ``build`` once, then each
    step ``before_micro_batch`` before every micro-batch and ``step_metrics`` after ``optimizer.step()``; the
    checkpointer asks ``state_device``."""

    def validate(self, cfg, target: Target) -> None:
        """Refuse, with a ``ConfigError`` naming the key, a composed config this mode cannot run on ``target`` (an
        optimizer it cannot step, gradient clipping it cannot honour); the default accepts every config."""

    def build(
        self, model: torch.nn.Module, make_optimizer: Callable, compute_dtype: torch.dtype
    ) -> torch.optim.Optimizer:
        """The optimizer the loop steps and the LR scheduler drives, over ``model``'s parameters (placed where this
        mode keeps them): ``make_optimizer(params)`` builds the configured one."""
        ...

    def before_micro_batch(self, optimizer: torch.optim.Optimizer, final: bool) -> None:
        """Before each micro-batch's forward; ``final``: its backward's gradients are the step's (the last)."""
        ...

    def state_device(self, training_device: torch.device) -> torch.device:
        """Where the optimizer keeps its state: a checkpoint loads it there."""
        ...

    def step_metrics(self, optimizer: torch.optim.Optimizer) -> dict:
        """What the last ``optimizer.step()`` did beyond the device's work, for the step's metrics row (the host
        step's time under offload=full); the default reports nothing."""
        return {}


class NoOffload(Offload):
    """Everything on the training device: fp32 parameters and optimizer state; compute runs in bf16 through
    autocast / FSDP2's mixed-precision policy."""

    def build(
        self, model: torch.nn.Module, make_optimizer: Callable, compute_dtype: torch.dtype
    ) -> torch.optim.Optimizer:
        return make_optimizer(model.parameters())

    def before_micro_batch(self, optimizer: torch.optim.Optimizer, final: bool) -> None:
        """Nothing to do: gradients accumulate in ``.grad`` and ``step()`` reads them after the final one."""

    def state_device(self, training_device: torch.device) -> torch.device:
        return training_device


class OptimizerOffload(Offload):
    """Optimizer state in pinned host memory, streamed through the device chunk by chunk and stepped there during
    the backward of each step's last micro-batch (``moe_lab.optim.offload.optimizer``); weights and gradients stay
    on the device in the ``none`` precision scheme. Any optimizer works; no gradient clipping (a global norm does
    not exist until backward ends, and by then the chunks have stepped).

    chunk_mib: parameter bytes (fp32) per chunk (an element-wise optimizer, such as AdamW or SignSGD, steps a larger
    parameter in pieces of a chunk); max_inflight: the device memory the state passes through, a ring of
    ``max_inflight`` times the largest chunk's state (AdamW: 8 bytes per parameter of that chunk), the memory the
    mode adds on the device.
    """

    def __init__(self, chunk_mib: float = 256.0, max_inflight: int = 12):
        self.chunk_mib, self.max_inflight = chunk_mib, max_inflight

    def validate(self, cfg: DictConfig, target: Target) -> None:
        _refuse_grad_clip(cfg, "offload=optimizer")
        _check_chunking(self.chunk_mib, self.max_inflight)

    def state_device(self, training_device: torch.device) -> torch.device:
        return torch.device("cpu")

    def build(
        self, model: torch.nn.Module, make_optimizer: Callable, compute_dtype: torch.dtype
    ) -> StreamedStateOptimizer:
        chunk_numel = int(self.chunk_mib * 2**20) // 4
        return StreamedStateOptimizer(
            list(model.parameters()), make_optimizer, _training_device(model), chunk_numel, self.max_inflight
        )

    def before_micro_batch(self, optimizer: StreamedStateOptimizer, final: bool) -> None:
        """The first micro-batch of a step starts the state's way to the device; the chunks step in the final
        micro-batch's backward only (before it, gradients accumulate on the device)."""
        optimizer.begin_step()
        optimizer.gradients_final = final


class FullOffload(Offload):
    """fp32 master weights, optimizer state and pinned transfer buffers in host RAM; the device keeps
    compute-dtype weights (bf16 on GPU) and activations. The optimizer steps on the host, inside backward
    (``moe_lab.optim.offload.full``). AdamW or SignSGD only; no gradient clipping (a global norm does not exist
    until backward ends, and by then the weights have been stepped).

    Each rank's CPU threads are bound to its GPU's NUMA node (``<sysfs_root>/bus/pci/devices/<bus>/numa_node`` and
    the node's ``cpulist``, split evenly between the node's ranks) before host memory is allocated, so that memory
    is first touched, and placed, on that node. A GPU on node -1 runs unbound, with a warning; a host without that
    sysfs topology fails validation. A CPU-only run has no GPU and so no node: it keeps the process's affinity.
    The host step runs on ``threads`` CPU threads; by default one fewer than the rank has CPUs, leaving one to the
    training thread: with every CPU in the step, each of its parallel regions waits for whichever thread the training
    thread has just displaced (``experiments/host_optimizer/host_optimizer.py``, case ``full_chunk_adamw_beside_busy_thread``).

    chunk_mib: fp32 master bytes per chunk (a chunk steps as soon as all its gradients are in); max_inflight:
    pinned transfer buffers, each one chunk; timeout_s: how long backward or step() waits for the CPU worker
    before raising; threads: CPU threads of the host step (null: the rank's CPUs less one); device_share: the share
    of the parameters (whole chunks, those backward finishes last) whose masters and optimizer state stay on the
    device and step there, shortening the host step the step's end waits for (0: all on the host).
    """

    def __init__(
        self,
        chunk_mib: float = 256.0,
        max_inflight: int = 4,
        timeout_s: float = 600.0,
        numa_bind: bool = True,
        sysfs_root: str = "/sys",
        threads: int | None = None,
        device_share: float = 0.0,
    ):
        self.chunk_mib, self.max_inflight, self.timeout_s = chunk_mib, max_inflight, timeout_s
        self.numa_bind, self.sysfs_root, self.threads = numa_bind, sysfs_root, threads
        self.device_share = device_share

    def validate(self, cfg: DictConfig, target: Target) -> None:
        optimizer = cfg.optimizer._target_
        if optimizer not in HOST_OPTIMIZERS:
            raise ConfigError(
                "optimizer._target_",
                f"offload=full steps on the host with {' or '.join(HOST_OPTIMIZERS)} only, got {optimizer}",
            )
        for flag in HOST_ADAMW_LACKS:
            if cfg.optimizer.get(flag):
                raise ConfigError(f"optimizer.{flag}", f"offload=full's host AdamW steps without {flag}; got true")
        _refuse_grad_clip(cfg, "offload=full")
        _check_chunking(self.chunk_mib, self.max_inflight)
        if not 0 < self.timeout_s <= threading.TIMEOUT_MAX:  # a longer wait overflows the lock's timeout
            raise ConfigError(
                "offload.timeout_s", f"must be > 0 and at most {threading.TIMEOUT_MAX:.0f} s, got {self.timeout_s}"
            )
        if self.threads is not None and self.threads < 1:
            raise ConfigError("offload.threads", f"must be null or >= 1, got {self.threads}")
        if not 0.0 <= self.device_share <= 1.0:
            raise ConfigError(
                "offload.device_share", f"must be in [0, 1] (a share of the parameters), got {self.device_share}"
            )
        if self.numa_bind and target.runs_on_cuda(cfg.trainer):
            try:
                for address in target.gpu_pci_addresses[: target.ranks_per_node]:
                    numa.numa_node(address, self.sysfs_root)
            except numa.NumaTopologyError as e:
                raise ConfigError(
                    "offload.numa_bind", f"{e}; set offload.numa_bind=false to run without binding"
                ) from None

    def state_device(self, training_device: torch.device) -> torch.device:
        return torch.device("cpu")

    def build(
        self, model: torch.nn.Module, make_optimizer: Callable, compute_dtype: torch.dtype
    ) -> InBackwardOptimizer:
        cpus = self._bind(_training_device(model))  # before any host state exists
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        rank_cpus = len(cpus) if cpus else max(1, len(os.sched_getaffinity(0)) // local_world)
        torch.set_num_threads(rank_cpus)
        threads = self.threads or max(1, rank_cpus - 1)
        optimizer = InBackwardOptimizer(
            list(model.parameters()),
            make_optimizer,
            compute_dtype,
            chunk_numel=int(self.chunk_mib * 2**20) // 4,
            max_inflight=self.max_inflight,
            timeout_s=self.timeout_s,
            num_threads=threads,
            device_share=self.device_share,
        )
        model.to(compute_dtype)  # the masters hold the fp32 values now
        optimizer.attach()
        return optimizer

    def step_metrics(self, optimizer: InBackwardOptimizer) -> dict:
        return optimizer.step_metrics()

    def before_micro_batch(self, optimizer: InBackwardOptimizer, final: bool) -> None:
        """The hooks take gradients to the host, and the chunks step, in the final micro-batch's backward only;
        before it, gradients accumulate on the device (in ``.grad`` in the compute dtype on one rank; FSDP2 keeps
        them as ``parallel.grad_sync`` says)."""
        optimizer.gradients_final = final

    def _bind(self, device: torch.device) -> list[int] | None:
        if not self.numa_bind:
            return None
        if device.type != "cuda":
            log.info("offload=full on CPU: no GPU, so no NUMA node to bind to; threads keep the process's affinity")
            return None
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        addresses = [gpu_pci_address(g) for g in range(local_world)]
        cpus = numa.rank_cpus(addresses[device.index], addresses, self.sysfs_root)
        if cpus is None:
            return None
        cpus = numa.bind_threads(cpus)
        log.info(
            "offload=full: rank on GPU %s bound to %d CPUs of its NUMA node", addresses[device.index], len(cpus or [])
        )
        return cpus
