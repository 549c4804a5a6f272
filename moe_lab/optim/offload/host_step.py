"""offload=full's host optimizer step: torch's AdamW and this project's SignSGD over one flat fp32 master in host
memory, stepping with a gradient in the compute dtype and writing the new weights back in it, block by block.

Per block (``block_numel`` elements, a cache-sized piece of the master) three passes: widen the gradient into an
fp32 scratch block, step the block, narrow its new weights into the transfer buffer. Each pass after the first
reads what the one before left in the cache, so the memory traffic is the optimizer kernel's own plus the
compute-dtype gradient and weights (AdamW with bf16: 32 bytes per parameter). Widening and narrowing the whole
master in passes of their own (before issue 18) added 14 bytes of traffic per parameter and left the kernel waiting
on memory for them.

The results are the unblocked optimizer's, bit for bit: AdamW steps each block with torch's fused CPU kernel
(``torch._fused_adamw_``, what ``AdamW(fused=True)`` calls) and keeps its state as torch does (``step``,
``exp_avg``, ``exp_avg_sq`` of the whole master); blocks start at multiples of ``block_numel``, a multiple of the
kernel's vector width, so it vectorises the same elements as over the whole master. SignSGD's ops are elementwise.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from typing import Callable

import torch

from moe_lab.optim.optimizers import SignSGD

# Elements of a block per CPU thread: 1 MiB of fp32 per thread and tensor, so that a block's gradient and new weights
# stay in the cores' L2 caches (2 MiB each on current Xeons), or else in L3, from one pass over the block to the next,
# while each pass is long enough (about a millisecond) that its start-up and Python's share stay small.
BLOCK_NUMEL_PER_THREAD = 2**18


# How soon Python hands its GIL to a thread that waits for it (its default is 5 ms). The host step comes back to
# Python after each of its ops (three per block of about a millisecond) and needs the GIL to go on; beside a thread
# that runs Python (in backward the compiled blocks' wrappers and the hooks) each of those returns may wait the
# whole interval, up to 15 ms per millisecond-long block. ``benchmarks/host_optimizer.py``'s
# ``full_chunk_adamw_beside_python_thread`` rows measure it at this interval and at the default.
HOST_STEP_SWITCH_INTERVAL_S = 1e-4


_handover = {"holders": 0, "previous": None}
_handover_lock = threading.Lock()


@contextlib.contextmanager
def prompt_gil_handover(seconds: float = HOST_STEP_SWITCH_INTERVAL_S):
    """While a host step runs, Python's switch interval at most ``seconds`` (process-wide: restored when the last
    host step running, of any optimizer, ends)."""
    with _handover_lock:
        if _handover["holders"] == 0:
            _handover["previous"] = sys.getswitchinterval()
            sys.setswitchinterval(min(_handover["previous"], seconds))
        _handover["holders"] += 1
    try:
        yield
    finally:
        with _handover_lock:
            _handover["holders"] -= 1
            if _handover["holders"] == 0:
                sys.setswitchinterval(_handover["previous"])


def cache_block_numel(num_threads: int) -> int:
    """Elements of a block stepped by ``num_threads`` threads."""
    return max(1, num_threads) * BLOCK_NUMEL_PER_THREAD


def _blocks(numel: int, block_numel: int):
    return ((start, min(numel, start + block_numel)) for start in range(0, numel, block_numel))


class HostAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` (no amsgrad, no maximize) over flat fp32 masters on the host, stepped from a gradient
    in the compute dtype (``step(transfer=..., scratch=...)``, see the module's docstring)."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        if any(group["amsgrad"] or group["maximize"] for group in self.param_groups):
            raise ValueError("HostAdamW steps without amsgrad and maximize")

    @torch.no_grad()
    def step(self, closure: Callable | None = None, *, transfer: torch.Tensor, scratch: torch.Tensor) -> None:
        """Step each master (a flat fp32 tensor) with its gradient in ``transfer`` (the masters' elements, one after
        the other, in the compute dtype) and leave its new weights there; ``scratch``: fp32 of a block's size."""
        offset = 0
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for master in group["params"]:
                state = self.state[master]
                if not state:  # as torch's fused AdamW creates it
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(master, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)
                state["step"] += 1
                p, m, v = master.detach(), state["exp_avg"], state["exp_avg_sq"]
                for start, end in _blocks(p.numel(), scratch.numel()):
                    grad = scratch[: end - start]
                    piece = transfer[offset + start : offset + end]
                    grad.copy_(piece)
                    torch._fused_adamw_(
                        [p[start:end]], [grad], [m[start:end]], [v[start:end]], [], [state["step"]],
                        lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"],
                        eps=group["eps"], amsgrad=False, maximize=False,
                    )  # fmt: skip
                    piece.copy_(p[start:end])
                offset += p.numel()


class HostSignSGD(SignSGD):
    """``SignSGD`` over flat fp32 masters on the host, stepped from a gradient in the compute dtype
    (``step(transfer=..., scratch=...)``, see the module's docstring)."""

    @torch.no_grad()
    def step(self, closure: Callable | None = None, *, transfer: torch.Tensor, scratch: torch.Tensor) -> None:
        offset = 0
        for group in self.param_groups:
            for master in group["params"]:
                p = master.detach()
                for start, end in _blocks(p.numel(), scratch.numel()):
                    sign = scratch[: end - start]
                    piece = transfer[offset + start : offset + end]
                    sign.copy_(piece).sign_()
                    block = p[start:end]
                    if group["weight_decay"]:
                        block.mul_(1.0 - group["lr"] * group["weight_decay"])
                    block.add_(sign, alpha=-group["lr"])
                    piece.copy_(block)
                offset += p.numel()


HOST_STEPS = {torch.optim.AdamW: HostAdamW, SignSGD: HostSignSGD}


def host_optimizer(make_optimizer: Callable, params: list[torch.Tensor]) -> HostAdamW | HostSignSGD:
    """The host step of the configured optimizer (``make_optimizer``: its class, or a partial of it with its
    hyperparameters), over ``params``. A host-step class (or a subclass of one) is used as it is."""
    cls, keywords = (make_optimizer.func, make_optimizer.keywords) if isinstance(make_optimizer, functools.partial) else (make_optimizer, {})
    if issubclass(cls, tuple(HOST_STEPS.values())):
        return make_optimizer(params)
    if cls not in HOST_STEPS:
        raise TypeError(f"offload=full steps on the host with {' or '.join(c.__name__ for c in HOST_STEPS)} only, got {cls.__name__}")
    return HOST_STEPS[cls](params, **keywords)
