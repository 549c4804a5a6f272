"""``hydra/sweeper=candidates``: Hydra's basic sweeper over a list of points instead of a cartesian product.

``python -m moe_lab.tune`` picks its candidates (a few points of its space, no product of axes) and measures them as
one ordinary ``python -m moe_lab.train -m`` sweep: the command line's point(s) once per candidate, the candidate's
overrides after them, each job in its own numbered subdir of ``hydra.sweep.dir`` with the launcher configured. So a
measured candidate is a normal record, and the same command resumes the sweep (``trainer.skip_done``).
"""

from __future__ import annotations

from pathlib import Path

import yaml
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper


class CandidateSweeper(BasicSweeper):
    def __init__(self, candidates: str, max_batch_size: int | None = None, params: dict | None = None) -> None:
        super().__init__(max_batch_size=max_batch_size, params=params)
        self.candidates = [[str(o) for o in point] for point in yaml.safe_load(Path(candidates).read_text())]

    def split_arguments(self, overrides, max_batch_size):  # BasicSweeper.sweep's batches of jobs
        points = BasicSweeper.split_arguments(overrides, None)[0]
        jobs = [point + candidate for point in points for candidate in self.candidates]
        return list(self.split_overrides_to_chunks(jobs, max_batch_size))
