"""SIGTERM and SIGINT (a SLURM time limit, a preemption, Ctrl-C) as a request to stop at the next step boundary.

The handler only notes the signal; the training loop asks ``StopRequest.agreed()`` at the start of every step, and
with several ranks the answer is all-reduced, so every rank stops at the same step even when the signal reached
them at different moments (or reached only the launcher, which forwards it). The loop then saves a checkpoint when
``trainer.checkpoint.on_signal`` is set and raises ``Interrupted``; the job records the point as ``interrupted``.
"""

from __future__ import annotations

import logging
import signal
import threading

import torch
import torch.distributed as dist

from moe_lab.runtime.host_read import to_host

log = logging.getLogger("moe_lab")

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Interrupted(Exception):
    """Every rank stopped on a signal after ``step`` steps; ``checkpoint``: where they saved (or None);
    ``metrics``: those of the steps done."""

    def __init__(self, signal_name: str, step: int, checkpoint: str | None, metrics: dict):
        super().__init__(f"{signal_name} received: stopped after step {step}")
        self.signal_name, self.step, self.checkpoint, self.metrics = signal_name, step, checkpoint, metrics


class StopRequest:
    """Notes SIGTERM / SIGINT while entered (main thread only; elsewhere signals keep their handlers).

    ``escalate``: a second signal takes its usual effect at once (Ctrl-C twice aborts a single-process run). Ranks
    started by a launcher do not escalate: a terminal's Ctrl-C reaches them and the launcher forwards it again.
    """

    def __init__(self, escalate: bool = False):
        self.escalate = escalate
        self.signum: int | None = None
        self._previous: dict = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._note)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _note(self, signum: int, frame) -> None:
        if self.signum is not None and self.escalate:
            signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))
            signal.raise_signal(signum)
            return
        self.signum = self.signum or signum
        log.warning(
            "%s received: stopping at the end of this step%s",
            signal.Signals(signum).name,
            " (again to stop at once)" if self.escalate else "",
        )

    def agreed(self, device: torch.device) -> str | None:
        """The name of the signal any rank received, or None; every rank must call this at the same step, and all
        get the same answer."""
        signum = self.signum or 0
        if dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([signum], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            signum = int(to_host(flag).item())
        return signal.Signals(signum).name if signum else None
