"""The training loop's console progress: tqdm's bar on a terminal; anywhere else (a file, a pipe, a scheduler's log)
a plain line after the first step, every ``every_s`` seconds and after the last, since a bar's carriage-return
frames pile up there as one unreadable line."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from tqdm import tqdm


class StepProgress:
    def __init__(self, first: int, total: int, enabled: bool, stream: TextIO | None = None, every_s: float = 30.0):
        self.stream = stream or sys.stdout
        self.total, self.every_s, self.enabled = total, every_s, enabled
        self.bar = (
            tqdm(desc="train", initial=first, total=total, dynamic_ncols=True, file=self.stream)
            if enabled and self.stream.isatty()
            else None
        )
        self.last_line = None  # when the last plain line was written (None: none yet)

    def step(self, step: int, loss: float, elapsed: float) -> None:
        """``step`` (0-based) is done, its loss and wall seconds known."""
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", s_step=f"{elapsed:.3f}", refresh=False)
            self.bar.update(1)
            return
        now = time.monotonic()
        last = step + 1 == self.total
        if self.enabled and (self.last_line is None or now - self.last_line >= self.every_s or last):
            print(f"train: step {step + 1}/{self.total}, loss {loss:.4f}, {elapsed:.3f} s/step", file=self.stream)
            self.stream.flush()
            self.last_line = now

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
