"""Small device -> host reads (a loss, a few sizes) that do not wait behind the bulk copies on the copy engine.

On the H200 machines a copy between host and device queues behind every copy in its direction issued before it,
whatever its stream. While offload=optimizer's state goes home (gigabytes a step, on a side stream, running on
into the next step) a ``.item()`` waited for all of it: 38.9 ms behind a 2 GiB copy home. A kernel storing the
values into pinned host memory is not in that queue: 0.33 ms behind the same copy (``pcie_duplex.py``,
experiments/offload_accum/README.md, "Fourth measurement"). The training loop's host reads go through ``to_host``.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

_staging: dict[torch.device, torch.Tensor] = {}  # a pinned buffer per device, grown as needed, never freed in use
_staging_lock = threading.Lock()


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``t.cpu()``, after the current stream's work queued so far; on CUDA by a one-program kernel storing into a
    pinned buffer (``host_read_kernel``, which imports Triton: only a CUDA run needs it), not by the copy engine."""
    # Inside a compiled graph (the torch dispatcher's row counts at EP > 1) the read is the graph's own ``.cpu()``:
    # dynamo traces no lock, pinned buffer or data pointer.
    if not t.is_cuda or torch.compiler.is_compiling():
        return t.cpu()
    from moe_lab.runtime.host_read_kernel import store_bytes

    nbytes = t.numel() * t.element_size()
    with _staging_lock, torch.cuda.device(t.device):  # Triton launches on the current device
        staging = _staging.get(t.device)
        if staging is None or staging.numel() < nbytes:
            staging = _staging[t.device] = torch.empty(max(nbytes, 1 << 16), dtype=torch.uint8, pin_memory=True)
        store_bytes(staging.data_ptr(), t)
        torch.cuda.current_stream(t.device).synchronize()
        return staging[:nbytes].view(t.dtype).reshape(t.shape).clone()


def summed_over_ranks(t: torch.Tensor) -> torch.Tensor:
    """``t`` (each rank's share) summed over every rank of the default group, on the host (``to_host``). A
    collective: every rank calls it at the same point."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        t = t.detach().clone()
        dist.all_reduce(t)
    return to_host(t)
