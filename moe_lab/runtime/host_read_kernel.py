"""The kernel behind ``moe_lab.runtime.host_read.to_host``: a tensor's bytes stored at a host address.

CUDA maps memory from cudaHostAlloc (torch's pinned memory) into every device's address space at the host's
address in a process with unified addressing, as every 64-bit one has (CUDA Runtime API, "Unified Addressing":
https://docs.nvidia.com/cuda/cuda-runtime-api/group__CUDART__UNIFIED.html), so a kernel stores to a pinned tensor's
``data_ptr()``. Triton takes that address as an int: it refuses a host tensor as a pointer argument.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # bytes an iteration moves: the reads are a few bytes to a few KB


@triton.jit
def store_bytes_kernel(src_ptr, dst_address, nbytes, BLOCK: tl.constexpr):
    """Bytes ``[0, nbytes)`` of ``src_ptr`` (uint8) to the address ``dst_address``, ``BLOCK`` at a time, by one
    program."""
    dst = dst_address.to(tl.int64).to(tl.pointer_type(tl.uint8))
    # ``while``, not ``range``: Triton's interpreter (the CPU tests) cannot take a loop bound computed at run time.
    start = tl.zeros((), dtype=tl.int64)
    while start < nbytes:
        offsets = start + tl.arange(0, BLOCK)
        mask = offsets < nbytes
        tl.store(dst + offsets, tl.load(src_ptr + offsets, mask=mask), mask=mask)
        start += BLOCK


def store_bytes(address: int, t: torch.Tensor) -> None:
    """Store ``t``'s bytes, in its contiguous order, at host address ``address`` (pinned memory, or on CPU tensors
    under Triton's interpreter any memory) by a kernel on the current stream."""
    src = t.contiguous()
    # flat by strides of 1: a contiguous tensor's size-1 dimensions may keep any stride (a column of one row), which
    # a reshape keeps and a view as bytes refuses
    src = src.as_strided((src.numel(),), (1,)).view(torch.uint8)
    if src.numel():
        store_bytes_kernel[(1,)](src, address, src.numel(), BLOCK=BLOCK)
