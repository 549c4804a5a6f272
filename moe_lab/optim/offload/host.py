"""Pieces the offload modes share: local shards of (FSDP2 / DTensor) parameters, host buffers, side-stream copies,
and the split of parameters into chunks that move and step together.

On a CPU-only run "host" and "device" are the same memory: buffers are not pinned and copies are synchronous, but
every code path is the one a GPU run takes.
"""

from __future__ import annotations

import inspect
from typing import Callable, Iterable

import psutil
import torch
from torch.distributed.tensor import DTensor


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local shard (same storage), else the tensor itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def check_host_memory(nbytes: int, what: str) -> None:
    """Fail with ``torch.OutOfMemoryError`` (recorded as an ``oom`` point) when the host has not ``nbytes``
    available, less a reserve of 5 % of its RAM, instead of leaving the kernel's OOM killer (or a crawl through
    reclaim at the very edge) to end the run later."""
    memory = psutil.virtual_memory()
    usable = memory.available - memory.total // 20
    if nbytes > usable:
        raise torch.OutOfMemoryError(
            f"host memory: {what} needs {nbytes / 2**30:.1f} GiB, {usable / 2**30:.1f} GiB available "
            f"(keeping 5 % of {memory.total / 2**30:.0f} GiB in reserve)"
        )


def host_empty(numel: int, dtype: torch.dtype, pinned: bool, what: str) -> torch.Tensor:
    """A flat host buffer, after checking the host has the memory."""
    check_host_memory(numel * dtype.itemsize, what)
    return torch.empty(numel, dtype=dtype, pin_memory=pinned)


class SideStream:
    """Copies on their own CUDA stream, so transfers overlap compute. On CPU a copy is done at once."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after_current: bool = True) -> None:
        """``dst.copy_(src)`` on the side stream, ordered after the work queued so far on the calling thread's
        current stream when ``after_current``. Both tensors are kept alive until the copy has run."""
        if self.stream is None:
            dst.copy_(src)
            return
        if after_current:
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
        for t in (dst, src):
            if t.is_cuda:
                t.record_stream(self.stream)

    def fetch(self, src: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A copy of host tensor ``src`` on ``device``, allocated and filled on the side stream; ``src`` itself
        where host and device memory are the same."""
        if self.stream is None:
            return src
        with torch.cuda.stream(self.stream):
            return src.to(device, non_blocking=True)

    def record(self) -> torch.cuda.Event | None:
        return self.stream.record_event() if self.stream is not None else None


def wait(event: torch.cuda.Event | None) -> None:
    if event is not None:
        event.synchronize()


def chunked(params: Iterable[torch.Tensor], max_numel: int) -> list[list[torch.Tensor]]:
    """Consecutive runs of parameters of at most ``max_numel`` local elements (a larger one gets a run of its own)."""
    chunks: list[list[torch.Tensor]] = [[]]
    size = 0
    for p in params:
        n = local(p).numel()
        if chunks[-1] and size + n > max_numel:
            chunks.append([])
            size = 0
        chunks[-1].append(p)
        size += n
    return [c for c in chunks if c]


def make_fused(make_optimizer: Callable, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """The optimizer over host tensors, with its fused (vectorised, multi-threaded) CPU kernel where it has one."""
    cls = getattr(make_optimizer, "func", make_optimizer)
    fused = "fused" in inspect.signature(cls).parameters
    return make_optimizer(params, fused=True) if fused else make_optimizer(params)
