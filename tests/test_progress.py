"""The training loop's console progress (moe_lab.metrics.progress): a bar on a terminal, plain lines anywhere else."""

from __future__ import annotations

import io

from moe_lab.metrics import progress
from moe_lab.metrics.progress import StepProgress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_lines_after_the_first_step_every_interval_and_the_last(monkeypatch):
    clock = iter([0.0, 10.0, 31.0, 40.0, 45.0])  # seconds at steps 3..7 of a run resumed at step 3
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    log = io.StringIO()
    console = StepProgress(first=3, total=8, enabled=True, stream=log, every_s=30.0)
    for step in range(3, 8):
        console.step(step, loss=1.0 / (step + 1), elapsed=0.5)
    console.close()
    assert log.getvalue().splitlines() == [
        "train: step 4/8, loss 0.2500, 0.500 s/step",  # the first step done
        "train: step 6/8, loss 0.1667, 0.500 s/step",  # 31 s after the first line
        "train: step 8/8, loss 0.1250, 0.500 s/step",  # the last
    ]


def test_a_terminal_gets_a_bar_and_a_disabled_console_nothing():
    terminal = Terminal()
    console = StepProgress(first=0, total=2, enabled=True, stream=terminal)
    console.step(0, loss=2.0, elapsed=0.25)
    console.step(1, loss=1.5, elapsed=0.25)
    console.close()
    assert "\r" in terminal.getvalue() and "2/2" in terminal.getvalue() and "loss=1.5000" in terminal.getvalue()

    for stream in (Terminal(), io.StringIO()):  # ranks other than the writer
        silent = StepProgress(first=0, total=2, enabled=False, stream=stream)
        silent.step(0, loss=2.0, elapsed=0.25)
        silent.close()
        assert stream.getvalue() == ""
