"""Console progress of long work (training steps, a tune's points): tqdm's bar on a terminal; anywhere else (a file,
a pipe, a scheduler's log) a plain line after the first update, every ``every_s`` seconds and at the end, since a
bar's carriage-return frames pile up there as one unreadable line."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from tqdm import tqdm


class ConsoleProgress:
    def __init__(
        self,
        desc: str,
        total: int,
        enabled: bool = True,
        first: int = 0,
        unit: str = "it",
        stream: TextIO | None = None,
        every_s: float = 30.0,
    ):
        self.stream = stream or sys.stderr
        self.desc, self.total, self.done, self.unit = desc, total, first, unit
        self.enabled, self.every_s = enabled, every_s
        self.bar = None
        if enabled and self.stream.isatty():
            self.bar = tqdm(desc=desc, initial=first, total=total, unit=unit, dynamic_ncols=True, file=self.stream)
        self.last_line = None  # when the last plain line was written (None: none yet)
        self.shown = None  # the count it showed

    def advance(self, n: int = 1, note: str = "") -> None:
        """``n`` more done; ``note`` (the last step's loss, say) goes beside the count."""
        self.done += n
        if self.bar is not None:
            self.bar.set_postfix_str(note, refresh=False)
            self.bar.update(n)
            return
        now = time.monotonic()
        at_end = self.done >= self.total and self.done != self.shown  # once: a poll that moved nothing adds no line
        if self.enabled and (self.last_line is None or now - self.last_line >= self.every_s or at_end):
            line = f"{self.desc}: {self.done}/{self.total} {self.unit}" + (f", {note}" if note else "")
            print(line, file=self.stream)
            self.stream.flush()
            self.last_line, self.shown = now, self.done

    def grow(self, n: int) -> None:
        """``n`` more to do than first said (a tune's replacement candidates)."""
        self.total += n
        if self.bar is not None:
            self.bar.total = self.total
            self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def __enter__(self) -> ConsoleProgress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
