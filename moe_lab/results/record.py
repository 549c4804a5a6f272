"""What a run leaves behind: ``metrics.jsonl`` (one row per step, written as it goes) and ``result.json``
(written once, atomically, at the end, whatever the outcome)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

METRICS = "metrics.jsonl"
RESULT = "result.json"


def write_json_atomic(path: str | Path, obj) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=2, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class MetricsLog:
    """Appends one JSON line per step; a crash loses at most the line being written."""

    def __init__(self, run_dir: str | Path):
        self.file = open(Path(run_dir) / METRICS, "a")

    def write(self, row: dict) -> None:
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()
