"""offload=full's host optimizer step: torch's AdamW and this project's SignSGD over one flat fp32 master in host
memory, stepping with a gradient in the compute dtype and writing the new weights back in it.

Each master steps in one call of a C kernel (``host_kernel.c``, built at first use by ``host_kernel.py``): one
pass over memory on the calling thread's torch thread count (``torch.get_num_threads()``; offload=full's worker sets
it to ``offload.threads``), reading each gradient in the compute dtype, widening it in registers, stepping the
master and moments, and narrowing the new weight into the transfer buffer. The memory traffic is the optimizer's
own plus the compute-dtype gradient and weights (AdamW with bf16: 32 bytes per parameter), and the call holds no
GIL: the host step no longer returns to Python between pieces of the master, where, beside a training thread
running Python, each return waited for the GIL (issue 18: a blocked step of three torch ops per cache-sized block
ran at half its rate beside a Python thread).

The results are AdamW's (torch's fused CPU kernel's order of operations, in fp32, within rounding of the fused
kernel where a compiler contracts differently) and SignSGD's; the state is torch's (``step``, ``exp_avg``,
``exp_avg_sq`` of the whole master, as ``AdamW(fused=True)`` keeps it), so checkpoints and ``state_dict`` do not
change.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Callable

import torch

from moe_lab.optim.offload import host_kernel
from moe_lab.optim.optimizers import SignSGD

# How soon Python hands its GIL to a thread that waits for it (its default is 5 ms). The worker comes back to Python
# after each master's kernel call and then queues the new weights' copies, a few small calls per parameter, each of
# which needs the GIL; beside a thread that runs Python (in backward the compiled blocks' wrappers and the hooks)
# each may wait the whole interval. ``experiments/host_optimizer/host_optimizer.py``'s ``full_chunk_adamw_beside_python_thread``
# rows measure the host step beside such a thread at this interval and at the default.
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


HOST_ADAMW_LACKS = ("amsgrad", "maximize")  # torch.optim.AdamW's flags the host step kernel has no path for


class HostAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` (no amsgrad, no maximize) over flat fp32 masters on the host, stepped from a gradient
    in the compute dtype (``step(transfer=...)``, see the module's docstring)."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        if any(group[flag] for group in self.param_groups for flag in HOST_ADAMW_LACKS):
            raise ValueError(f"HostAdamW steps without {' and '.join(HOST_ADAMW_LACKS)}")

    @torch.no_grad()
    def step(self, closure: Callable | None = None, *, transfer: torch.Tensor) -> None:
        """Step each master (a flat fp32 tensor) with its gradient in ``transfer`` (the masters' elements, one after
        the other, in the compute dtype) and leave its new weights there."""
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
                host_kernel.adamw_step(
                    master.detach(),
                    state["exp_avg"],
                    state["exp_avg_sq"],
                    transfer[offset : offset + master.numel()],
                    step=state["step"].item(),
                    lr=group["lr"],
                    beta1=beta1,
                    beta2=beta2,
                    weight_decay=group["weight_decay"],
                    eps=group["eps"],
                    threads=torch.get_num_threads(),
                )
                offset += master.numel()


class HostSignSGD(SignSGD):
    """``SignSGD`` over flat fp32 masters on the host, stepped from a gradient in the compute dtype
    (``step(transfer=...)``, see the module's docstring)."""

    @torch.no_grad()
    def step(self, closure: Callable | None = None, *, transfer: torch.Tensor) -> None:
        offset = 0
        for group in self.param_groups:
            for master in group["params"]:
                host_kernel.signsgd_step(
                    master.detach(),
                    transfer[offset : offset + master.numel()],
                    lr=group["lr"],
                    weight_decay=group["weight_decay"],
                    threads=torch.get_num_threads(),
                )
                offset += master.numel()


HOST_STEPS = {torch.optim.AdamW: HostAdamW, SignSGD: HostSignSGD}


def host_optimizer(make_optimizer: Callable, params: list[torch.Tensor]) -> HostAdamW | HostSignSGD:
    """The host step of the configured optimizer (``make_optimizer``: its class, or a partial of it with its
    hyperparameters), over ``params``. A host-step class (or a subclass of one) is used as it is."""
    cls, keywords = (
        (make_optimizer.func, make_optimizer.keywords)
        if isinstance(make_optimizer, functools.partial)
        else (make_optimizer, {})
    )
    if issubclass(cls, tuple(HOST_STEPS.values())):
        return make_optimizer(params)
    if cls not in HOST_STEPS:
        raise TypeError(
            f"offload=full steps on the host with {' or '.join(c.__name__ for c in HOST_STEPS)} only, got {cls.__name__}"
        )
    return HOST_STEPS[cls](params, **keywords)
