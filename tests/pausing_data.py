"""Synthetic batches that can hold a run at a chosen step, so that a test can signal or kill it there.

With ``MOE_LAB_TEST_PAUSE=<step>:<directory>`` in the environment, each rank, before taking the batch of ``step``,
writes ``<directory>/paused_rank<r>`` (holding its process id) and waits (polling; signal handlers run meanwhile) until
``<directory>/release`` exists. Without it the batches are SyntheticData's. The variable is no part of the config,
so a paused run, a killed one and the run resuming it are the same point.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from moe_lab.data.synthetic import SyntheticData

PAUSE = "MOE_LAB_TEST_PAUSE"


class PausingData(SyntheticData):
    def batch(self, step: int, dp_rank: int, *args, **kwargs):
        pause = os.environ.get(PAUSE)
        if pause:
            at, _, directory = pause.partition(":")
            if step == int(at):
                Path(directory).mkdir(parents=True, exist_ok=True)
                (Path(directory) / f"paused_rank{dp_rank}").write_text(str(os.getpid()))  # a test may kill this rank
                deadline = time.monotonic() + 300
                while not (Path(directory) / "release").exists() and time.monotonic() < deadline:
                    time.sleep(0.02)
        return super().batch(step, dp_rank, *args, **kwargs)
