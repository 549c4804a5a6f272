"""Console progress (moe_lab.metrics.progress): a bar on a terminal, plain lines anywhere else."""

from __future__ import annotations

import io

from moe_lab.metrics import progress
from moe_lab.metrics.progress import ConsoleProgress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_lines_after_the_first_update_every_interval_and_the_last(monkeypatch):
    clock = iter([0.0, 10.0, 31.0, 40.0, 45.0])  # seconds at steps 3..7 of a run resumed at step 3
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    log = io.StringIO()
    console = ConsoleProgress("train", 8, first=3, unit="steps", stream=log, every_s=30.0)
    for step in range(3, 8):
        console.advance(note=f"loss {1.0 / (step + 1):.4f}")
    console.close()
    assert log.getvalue().splitlines() == [
        "train: 4/8 steps, loss 0.2500",  # the first update
        "train: 6/8 steps, loss 0.1667",  # 31 s after the first line
        "train: 8/8 steps, loss 0.1250",  # the last
    ]


def test_a_total_grown_is_the_one_counted_to():
    log = io.StringIO()
    console = ConsoleProgress("candidates measured", 2, unit="points", stream=log, every_s=1e9)
    console.advance(2)  # the first round done, and out of memory: a replacement to measure
    console.advance(0)  # the measuring loop polls the finished count: nothing more to say
    console.grow(1)
    console.advance(1)
    console.advance(0)
    assert log.getvalue().splitlines() == ["candidates measured: 2/2 points", "candidates measured: 3/3 points"]


def test_a_terminal_gets_a_bar_and_a_disabled_console_nothing():
    terminal = Terminal()
    console = ConsoleProgress("train", 2, unit="steps", stream=terminal)
    console.advance(note="loss 2.0000")
    console.advance(note="loss 1.5000")
    console.close()
    assert "\r" in terminal.getvalue() and "2/2" in terminal.getvalue() and "loss 1.5000" in terminal.getvalue()

    for stream in (Terminal(), io.StringIO()):  # ranks other than the writer, a tune told not to show progress
        silent = ConsoleProgress("train", 2, enabled=False, stream=stream)
        silent.advance()
        silent.close()
        assert stream.getvalue() == ""


def test_a_resumed_runs_bar_counts_on_from_its_first_step():
    terminal = Terminal()
    console = ConsoleProgress("train", 8, first=3, unit="steps", stream=terminal)
    console.advance(note="loss 2.0000")
    console.close()
    assert "4/8" in terminal.getvalue() and "1/8" not in terminal.getvalue()
