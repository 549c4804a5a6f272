"""How a job's ranks start: by themselves through torch's elastic launcher (``trainer.nproc_per_node=N``), or
already started by an outer ``torchrun`` / SLURM ``srun`` (detected from the environment)."""

from __future__ import annotations

import os
import socket
import uuid
from typing import Callable

from torch.distributed.launcher.api import LaunchConfig, elastic_launch


def started_by_outer_launcher() -> bool:
    return "WORLD_SIZE" in os.environ or "SLURM_PROCID" in os.environ and "SLURM_NTASKS" in os.environ


def adopt_slurm_environment() -> None:
    """Map SLURM's task variables onto torch.distributed's, so ``srun python -m moe_lab.train`` just works."""
    if "WORLD_SIZE" in os.environ or "SLURM_PROCID" not in os.environ:
        return
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
    os.environ.setdefault("MASTER_PORT", "29500")
    if "MASTER_ADDR" not in os.environ:
        nodelist = os.environ.get("SLURM_JOB_NODELIST", "localhost")
        os.environ["MASTER_ADDR"] = nodelist.split(",")[0].split("[")[0] + _first_node_suffix(nodelist)


def _first_node_suffix(nodelist: str) -> str:
    # "node[03-05,07]" -> "03"; a plain "node03" needs no suffix.
    if "[" not in nodelist.split(",")[0]:
        return ""
    return nodelist.split("[", 1)[1].split("]")[0].split(",")[0].split("-")[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_local(nproc: int, entrypoint: Callable, *args):
    """Run ``entrypoint(*args)`` on ``nproc`` fresh processes of this host; returns rank 0's return value.
    A failing rank stops all of them and raises ``torch.distributed.elastic.multiprocessing.errors.ChildFailedError``."""
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=uuid.uuid4().hex,
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{_free_port()}",
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
    )
    return elastic_launch(config, entrypoint)(*args)[0]
