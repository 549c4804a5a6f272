"""Facts about where a config runs that validation and building both need: the job's world size, its device, its
compute precision."""

from __future__ import annotations

import os

import torch


def world_size(cfg) -> int:
    """Ranks of this job: the emulated layout's (``parallel.emulate``), an outer launcher's WORLD_SIZE, else the
    ranks the job starts itself."""
    if cfg.parallel.get("emulate"):
        return cfg.trainer.nproc_per_node * cfg.parallel.emulate_nodes
    return int(os.environ.get("WORLD_SIZE", cfg.trainer.nproc_per_node))


def ranks_per_node(cfg) -> int:
    """Ranks of this job on each node: an outer launcher's LOCAL_WORLD_SIZE, else every rank of the job on one."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size(cfg)))


def runs_on_cuda(trainer) -> bool:
    """The job's device is a GPU: ``trainer.device`` cuda, or auto on a machine with CUDA."""
    return trainer.device != "cpu" and torch.cuda.is_available()


def computes_in_bf16(trainer) -> bool:
    """bf16 compute: ``trainer.precision`` bf16, or auto on a GPU (fp32 on CPU)."""
    return trainer.precision == "bf16" or (trainer.precision == "auto" and runs_on_cuda(trainer))
