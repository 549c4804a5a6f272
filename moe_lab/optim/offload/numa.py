"""Bind a rank's CPU threads to the NUMA node of its GPU, read from sysfs.

The GPU's PCI address gives ``<sysfs>/bus/pci/devices/<address>/numa_node``; the node gives
``<sysfs>/devices/system/node/node<N>/cpulist``. The sysfs root is a parameter so tests can use a fake tree.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


class NumaTopologyError(RuntimeError):
    """The host does not expose the sysfs files NUMA binding needs."""


def parse_cpulist(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11] (the kernel's cpulist format)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.extend(range(int(first), int(last or first) + 1))
    return cpus


def numa_node(address: str, sysfs_root: str | Path = "/sys") -> int:
    """NUMA node of a PCI device; -1 where the platform reports none. Raises NumaTopologyError without sysfs."""
    path = Path(sysfs_root) / "bus" / "pci" / "devices" / address / "numa_node"
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError) as e:
        raise NumaTopologyError(f"cannot read the NUMA node of PCI device {address} from {path}: {e}") from None


def node_cpus(node: int, sysfs_root: str | Path = "/sys") -> list[int]:
    path = Path(sysfs_root) / "devices" / "system" / "node" / f"node{node}" / "cpulist"
    try:
        return parse_cpulist(path.read_text())
    except (OSError, ValueError) as e:
        raise NumaTopologyError(f"cannot read the CPUs of NUMA node {node} from {path}: {e}") from None


def rank_cpus(address: str, local_addresses: list[str], sysfs_root: str | Path = "/sys") -> list[int] | None:
    """This rank's share of the NUMA node of its GPU (PCI ``address``): the node's CPUs split evenly between the
    local ranks whose GPUs (``local_addresses``, in local-rank order) sit on the same node. None when the GPU
    reports no node (-1): the caller then leaves its threads unbound."""
    nodes = [numa_node(a, sysfs_root) for a in local_addresses]
    node = nodes[local_addresses.index(address)]
    if node < 0:
        log.warning("GPU %s reports no NUMA node (-1): CPU threads are left unbound", address)
        return None
    cpus = node_cpus(node, sysfs_root)
    peers = [a for a, n in zip(local_addresses, nodes) if n == node]
    share = max(1, len(cpus) // len(peers))
    start = peers.index(address) * share
    return cpus[start : start + share] or cpus


def bind_threads(cpus: list[int]) -> list[int] | None:
    """Pin every existing thread of this process (and so the threads they start later) to ``cpus``, less any CPU
    the process may not use (a container's cpuset)."""
    allowed = os.sched_getaffinity(0)
    cpus = [c for c in cpus if c in allowed]
    if not cpus:
        log.warning("none of the NUMA node's CPUs is in this process's affinity: threads are left unbound")
        return None
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, PermissionError):
            pass  # a thread that ended meanwhile, or one the kernel does not let us move
    return cpus
