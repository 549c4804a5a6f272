"""Small device -> host reads (a loss, a few sizes) that do not wait behind the bulk copies on the copy engine.

On the H200 machines a copy between host and device queues behind every copy in its direction issued before it,
whatever its stream. While offload=optimizer's state goes home (gigabytes a step, on a side stream, running on
into the next step) a ``.item()`` waited for all of it: 36.7 ms behind a 2 GiB copy home, 0.08 ms alone. A kernel
storing the values into pinned host memory is not in that queue: 0.36 ms behind the same copy
(experiments/offload_accum/README.md, "Fourth measurement"). The training loop's host reads go through ``to_host``.
"""

from __future__ import annotations

import torch


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``t.cpu()``, after the current stream's work queued so far; on CUDA by a one-program kernel storing into
    pinned memory (``host_read_kernel``, which imports Triton: only a CUDA run needs it), not by the copy engine."""
    if not t.is_cuda:
        return t.cpu()
    from moe_lab.host_read_kernel import store_bytes

    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    store_bytes(out.data_ptr(), t)
    # The host allocator does not see a kernel's use of ``out``: it is safe to hand out once the kernel has run.
    torch.cuda.current_stream(t.device).synchronize()
    return out
