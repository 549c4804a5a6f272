"""Training checkpoints on disk: which are complete, which is newest, and pruning. No torch here: validation reads it.

    <checkpoint dir>/step_00000010/           complete: .metadata and one .distcp file per rank (DCP), and
                     checkpoint.json           (step, world size, model and run config), written last
    <checkpoint dir>/.step_00000020.partial/  being written, or left by a run that was killed: never loaded

A checkpoint is written into its ``.partial`` directory; rank 0 writes ``checkpoint.json`` into it once every rank's
data is on disk and then renames the directory to ``step_<N>`` (an atomic rename): a ``step_<N>`` directory is
complete, anything else is not. Deleting renames it away first, so a half-deleted checkpoint is never complete.

    <checkpoint dir>/step_00000030.damaged/   a complete checkpoint found damaged when resuming, set aside
                                              (``trainer.resume_fallback``) for a look; never loaded, never pruned
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

MARKER = "checkpoint.json"
DCP_METADATA = ".metadata"
_COMPLETE = re.compile(r"step_(\d{8,})")  # 8 digits, more from step 10**8 on
_PARTIAL = re.compile(r"\.step_(\d{8,})\.partial")


def checkpoint_dir(directory: str | None, run_dir: str | Path) -> Path:
    """``trainer.checkpoint.dir``, or the run directory's ``checkpoints/``."""
    return Path(directory) if directory else Path(run_dir) / "checkpoints"


def complete_path(directory: Path, step: int) -> Path:
    return directory / f"step_{step:08d}"


def partial_path(directory: Path, step: int) -> Path:
    return directory / f".step_{step:08d}.partial"


def why_incomplete(path: str | Path) -> str | None:
    """None for a complete checkpoint, else why ``path`` is not one."""
    path = Path(path)
    if not path.is_dir():
        return "no such directory"
    if not _COMPLETE.fullmatch(path.name):
        if _PARTIAL.fullmatch(path.name):
            return "a checkpoint that was never completed (its writer stopped before marking it)"
        if any(complete(path)):
            return f"a directory of checkpoints, not one; the newest is {complete(path)[-1]}"
        return "not named step_<8 or more digits>"
    for name in (MARKER, DCP_METADATA):
        if not (path / name).is_file():
            return f"{name} is missing"
    return None


def complete(directory: str | Path) -> list[Path]:
    """The complete checkpoints of ``directory``, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if _COMPLETE.fullmatch(p.name) and why_incomplete(p) is None]
    return sorted(found, key=lambda p: int(_COMPLETE.fullmatch(p.name)[1]))  # by step: 9 digits follow 8


def newest(directory: str | Path) -> Path | None:
    found = complete(directory)
    return found[-1] if found else None


def read_marker(path: str | Path) -> dict:
    """A checkpoint's marker; OSError or ValueError where it cannot be read as one (a damaged checkpoint)."""
    marker = json.loads((Path(path) / MARKER).read_text())
    if not isinstance(marker, dict):
        raise ValueError(f"{MARKER} holds a JSON {type(marker).__name__}, not an object")
    return marker


def remove(path: Path) -> None:
    """Delete a checkpoint: renamed away first, so that it is no longer complete before any file goes."""
    doomed = path.with_name(f".{path.name}.deleting")
    path.rename(doomed)
    shutil.rmtree(doomed)


def set_aside(path: Path) -> Path:
    """Rename a damaged checkpoint out of the complete ones (a copy set aside earlier for the same step goes);
    returns where it went."""
    aside = path.with_name(f"{path.name}.damaged")
    if aside.exists():
        shutil.rmtree(aside)
    path.rename(aside)
    return aside


def prune(directory: Path, keep: int | None) -> None:
    """Keep the newest ``keep`` complete checkpoints (all when None)."""
    if keep is None:
        return
    for path in complete(directory)[:-keep]:
        remove(path)


def remove_leftovers(directory: Path) -> None:
    """Delete what a killed writer left: partial checkpoints, and deletions that did not finish."""
    if not directory.is_dir():
        return
    for path in directory.iterdir():
        if _PARTIAL.fullmatch(path.name) or path.name.endswith(".deleting"):
            shutil.rmtree(path, ignore_errors=True)
