"""Device -> host copies done by a few SMs instead of the copy engine.

On the H200 machines a copy between host and device queues behind every copy in the same direction issued before
it, whatever its stream (the copy engine's order; experiments/offload_accum/README.md, "Second measurement"): while
offload=optimizer's state went home through the copy engine (gigabytes a step), the trainer's 4-byte loss read at
the step's end, and every host sync in a forward, waited for all of it. A kernel that stores into the pinned host
buffer leaves the copy engine's queue to those small copies.

CUDA: "All host memory allocated through all devices using cudaMallocHost() and cudaHostAlloc() is always directly
accessible from all devices that support unified addressing [...] The pointer value through which allocated host
memory may be accessed in kernels on all devices that support unified addressing is the same as the pointer value
through which that memory is accessed on the host" (CUDA Runtime API, Unified Addressing, "Automatic Mapping of Host
Allocated Host Memory": https://docs.nvidia.com/cuda/cuda-runtime-api/group__CUDART__UNIFIED.html; unified
addressing is on in every 64-bit process). torch's pinned memory comes from cudaHostAlloc (its CachingHostAllocator),
unless PYTORCH_CUDA_ALLOC_CONF sets pinned_use_cuda_host_register, where the host pointer holds on devices whose
canUseHostPointerForRegisteredMem attribute is set. So a pinned tensor's ``data_ptr()`` is the address the kernel
stores to.

Imports Triton: only the CUDA path of ``SideStream.copy_home`` loads this module.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# A persistent grid of this many programs: the copy is bound by PCIe (about 50 GB/s), which a few SMs' stores fill,
# while the backward it runs beside needs the others; a grid the copy's size would hold most SMs for its whole length.
CTAS = 16
WORDS = 4096  # int32 words a program moves per iteration (16 KiB): 4-word (16-byte) vectors, 8 per thread at 4 warps
VECTOR = 16  # bytes: where both addresses are multiples of it, whole tiles move as 16-byte vectors
BYTES = 1024  # bytes a program moves per iteration of the rest (the tail past the last whole tile)


@triton.jit
def copy_to_host_kernel(src_ptr, dst_address, tile_bytes, nbytes, WORDS: tl.constexpr, BYTES: tl.constexpr, VECTOR: tl.constexpr):
    """Bytes ``[0, nbytes)`` of ``src_ptr`` (uint8) to the address ``dst_address`` (an int): ``[0, tile_bytes)`` in
    whole tiles of ``WORDS`` int32 words, unmasked, as 16-byte vectors (both addresses are multiples of 16 where
    ``tile_bytes`` > 0), the rest byte by byte; each program takes every ``num_programs``-th tile, then every
    ``num_programs``-th block of the rest."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    dst_address = dst_address.to(tl.int64)
    src_words, dst_words = src_ptr.to(tl.pointer_type(tl.int32)), dst_address.to(tl.pointer_type(tl.int32))
    dst_bytes = dst_address.to(tl.pointer_type(tl.uint8))
    # ``while``, not ``range``: Triton's interpreter (the CPU tests) cannot take a loop bound computed at run time
    # (with NumPy 2.4 it fails to turn a scalar it holds as a one-element array into an int).
    tile = pid.to(tl.int64)
    while tile < tile_bytes // (4 * WORDS):
        offsets = tile * WORDS + tl.arange(0, WORDS)
        # Triton 3.6 knows a pointer argument is a multiple of 16 (it specialises on that) but loses an int's
        # alignment through the int -> pointer cast: without saying so here, the stores compile to 4-byte ones.
        tl.store(tl.multiple_of(dst_words + offsets, VECTOR), tl.load(src_words + offsets))
        tile += programs
    block = pid.to(tl.int64)
    while block < tl.cdiv(nbytes - tile_bytes, BYTES):
        offsets = tile_bytes + block * BYTES + tl.arange(0, BYTES)
        mask = offsets < nbytes
        tl.store(dst_bytes + offsets, tl.load(src_ptr + offsets, mask=mask), mask=mask)
        block += programs


def copy_to_host(dst: torch.Tensor, src: torch.Tensor, ctas: int = CTAS) -> None:
    """``dst.copy_(src, non_blocking=True)`` for a device tensor ``src`` and a contiguous pinned host tensor ``dst``
    of the same dtype and shape, by a kernel of ``ctas`` programs on the current stream. The caller keeps both
    alive until it has run (the host allocator does not see the kernel's use of ``dst``). On CPU tensors (Triton's
    interpreter) ``dst`` need not be pinned."""
    if dst.dtype != src.dtype or dst.shape != src.shape or not dst.is_contiguous():
        raise ValueError(f"copy_to_host: tensors of one dtype and shape, dst contiguous; got {dst.dtype} {tuple(dst.shape)} <- {src.dtype} {tuple(src.shape)}")
    if src.is_cuda and not dst.is_pinned():
        raise ValueError("copy_to_host: dst must be pinned host memory (a kernel can store only to that)")
    src = src.contiguous()
    nbytes = src.numel() * src.element_size()
    if nbytes == 0:
        return
    aligned = dst.data_ptr() % VECTOR == 0 and src.data_ptr() % VECTOR == 0
    tile_bytes = nbytes // (4 * WORDS) * (4 * WORDS) if aligned else 0
    programs = max(1, min(ctas, tile_bytes // (4 * WORDS) + triton.cdiv(nbytes - tile_bytes, BYTES)))
    copy_to_host_kernel[(programs,)](src.view(-1).view(torch.uint8), dst.data_ptr(), tile_bytes, nbytes, WORDS=WORDS, BYTES=BYTES, VECTOR=VECTOR)
