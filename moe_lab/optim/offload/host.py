"""Host-memory pieces the offload modes share: host buffers sized against the RAM available, and copies on a side
stream (device -> host ones for offload=optimizer's state by a kernel, ``host_write.py``). (offload=full's host
optimizer step is ``host_step.py``.)

On a CPU-only run "host" and "device" are the same memory: buffers are not pinned and copies are synchronous, but
every code path is the one a GPU run takes.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import deque

import psutil
import torch


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
    """A CUDA stream of its own for copies or steps that overlap compute, and the orderings between it and the
    others. On CPU there is no stream: a copy is done at once, and every ordering holds already."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.writing_home: deque[tuple[torch.cuda.Event, torch.Tensor]] = deque()  # ``copy_home``'s destinations in use
        # Collected (an optimizer that is gone): its kernels' destinations must not go back to the allocator first.
        weakref.finalize(self, _wait_for_writes, self.writing_home)

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

    def copy_home(self, dst: torch.Tensor, src: torch.Tensor, after_current: bool = True) -> None:
        """``copy`` from the device into pinned host memory, done by a kernel on a few SMs (``host_write``) instead
        of the copy engine, whose queue it leaves to the small copies of others (a host sync waits for every copy
        in its direction issued before it). ``dst`` stays referenced here until the kernel has run: the host
        allocator, which orders the reuse of pinned memory after the copies it has seen, does not see a kernel's."""
        if self.stream is None:
            dst.copy_(src)
            return
        from moe_lab.optim.offload.host_write import copy_to_host  # Triton: only with a GPU

        while self.writing_home and self.writing_home[0][0].query():
            self.writing_home.popleft()
        if after_current:
            self.after_current()
        with torch.cuda.stream(self.stream):
            copy_to_host(dst, src)
        self.keep_for(src)
        self.writing_home.append((self.stream.record_event(), dst))

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
            self.writing_home.clear()


def _wait_for_writes(writing_home: deque[tuple[torch.cuda.Event, torch.Tensor]]) -> None:
    for event, _ in writing_home:
        event.synchronize()


def synchronize(event: torch.cuda.Event | None) -> None:
    """Block the calling CPU thread until ``event`` (from ``SideStream.record``) has passed."""
    if event is not None:
        event.synchronize()
