"""Host-memory pieces the offload modes share: host buffers sized against the RAM available, and copies on a side
stream. (offload=full's host optimizer step is ``host_step.py``.)

On a CPU-only run "host" and "device" are the same memory: buffers are not pinned and copies are synchronous, but
every code path is the one a GPU run takes.
"""

from __future__ import annotations

import contextlib

import psutil
import torch

HOST_RESERVE = 0.05  # of the host's RAM, kept free of offload's buffers (the planner plans with the same share)


# Processes whose host buffers this host holds, this one included, when each asks as this one does: an emulated rank
# (parallel.emulate) stands for its node's ranks, each of which would take what it takes.
_ranks_on_host = 1


def share_host(ranks: int) -> None:
    """This process stands for ``ranks`` ranks of one node (1: itself only): host checks ask for that many times
    what they allocate."""
    global _ranks_on_host
    _ranks_on_host = ranks


def usable_host_bytes() -> int:
    """The host memory offload may take now: what is available less ``HOST_RESERVE`` of the total."""
    memory = psutil.virtual_memory()
    return memory.available - int(memory.total * HOST_RESERVE)


def check_host_memory(nbytes: int, what: str) -> None:
    """Fail with ``torch.OutOfMemoryError`` (recorded as an ``oom`` point) when the host has not ``nbytes`` (times
    the ranks ``share_host`` set) available, less ``HOST_RESERVE`` of its RAM, instead of leaving the kernel's OOM
    killer (or a crawl through reclaim at the very edge) to end the run later."""
    usable = usable_host_bytes()
    if nbytes * _ranks_on_host > usable:
        each = f" x {_ranks_on_host} ranks of the emulated node" if _ranks_on_host > 1 else ""
        raise torch.OutOfMemoryError(
            f"host memory: {what} needs {nbytes / 2**30:.1f} GiB{each}, {usable / 2**30:.1f} GiB available "
            f"(keeping {HOST_RESERVE:.0%} of {psutil.virtual_memory().total / 2**30:.0f} GiB in reserve)"
        )


def host_empty(numel: int, dtype: torch.dtype, pinned: bool, what: str) -> torch.Tensor:
    """A flat host buffer, after checking the host has the memory."""
    check_host_memory(numel * dtype.itemsize, what)
    return torch.empty(numel, dtype=dtype, pin_memory=pinned)


class SideStream:
    """A CUDA stream of its own for copies or steps that overlap compute, and the orderings between it and the
    others. On CPU there is no stream: a copy is done at once, and every ordering holds already."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after_current: bool = True) -> None:
        """``dst.copy_(src)`` on the side stream, ordered after the work queued so far on the calling thread's
        current stream when ``after_current``. Both tensors are kept alive until the copy has run."""
        if self.stream is None:
            dst.copy_(src)
            return
        if after_current:
            self.after_current()
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
        for t in (dst, src):
            self.keep_for(t)

    def record(self) -> torch.cuda.Event | None:
        """An event after the work queued so far; None on CPU, where it is done already."""
        return self.stream.record_event() if self.stream is not None else None

    def wait(self, event: torch.cuda.Event | None) -> None:
        """Order the work queued from now on after ``event`` (on the GPU: the calling thread does not wait)."""
        if self.stream is not None and event is not None:
            self.stream.wait_event(event)

    def wait_stream_of(self, other: SideStream) -> None:
        """Order the work queued from now on after the work queued so far on ``other``."""
        if self.stream is not None:
            self.stream.wait_stream(other.stream)

    def after_current(self) -> None:
        """Order the work queued from now on after the work queued so far on the calling thread's current stream."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))

    def then_current(self) -> None:
        """Order the calling thread's current stream after the work queued so far on this one."""
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)

    def use(self):
        """Context in which the calling thread queues its work on this stream."""
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def keep_for(self, t: torch.Tensor) -> None:
        """Keep device tensor ``t``'s memory from reuse, once it is freed, until this stream's work queued by then
        has run."""
        if self.stream is not None and t.is_cuda:
            t.record_stream(self.stream)

    def synchronize(self) -> None:
        """Block the calling CPU thread until this stream's queued work has run."""
        if self.stream is not None:
            self.stream.synchronize()


def synchronize(event: torch.cuda.Event | None) -> None:
    """Block the calling CPU thread until ``event`` (from ``SideStream.record``) has passed."""
    if event is not None:
        event.synchronize()
