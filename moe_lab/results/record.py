"""What a run leaves behind: ``metrics.jsonl`` (one row per step, written as it goes) and ``result.json``
(written once, atomically, at the end, whatever the outcome: a ``Record``), plus the pieces of a record that
describe where and from which code it ran."""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import tempfile
import traceback
from pathlib import Path

import torch
from hydra.types import RunMode
from omegaconf import OmegaConf

from moe_lab.runtime.errors import ConfigError
from moe_lab.runtime.files import give_plain_file_mode

METRICS = "metrics.jsonl"
RESULT = "result.json"
# Where a re-run keeps the ok record it replaces (the measurement before it; the next re-run's replaces this one).
REPLACED = "result.replaced.json"
SOURCE_DIR = Path(__file__).resolve().parents[1]  # the moe_lab package


def write_json_atomic(path: str | Path, obj) -> None:
    """Write ``obj`` to ``path`` whole or not at all (temp file + rename); a failed write leaves no temp file. The
    record is readable by the group and others, as a plain file write would be (mkstemp makes it owner-only)."""
    write_text_atomic(path, json.dumps(obj, indent=2, default=str))


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all, as ``write_json_atomic``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        give_plain_file_mode(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def job_meta(hc) -> dict:
    """What a record says of the Hydra job it came from (``hc``: ``HydraConfig.get()``): group choices, command-line
    overrides, and the sweep directory of a multirun (None for a single run)."""
    return {
        "choices": {k: v for k, v in hc.runtime.choices.items() if not k.startswith("hydra")},
        "overrides": list(hc.overrides.task),
        "sweep": hc.sweep.dir if hc.mode == RunMode.MULTIRUN else None,
    }


def point_config(cfg) -> dict:
    """The resolved configuration that identifies a point (what it computes), as its record and its checkpoints
    store it: plain JSON values, without Hydra's own node."""
    try:
        resolved = OmegaConf.to_container(cfg, resolve=True)
    except Exception:  # an invalid config may hold an interpolation that does not resolve
        resolved = OmegaConf.to_container(cfg)
    resolved.pop("hydra", None)
    return json.loads(json.dumps(resolved, default=str))


class Record(dict):
    """One point's ``result.json``: the JSON object itself (a dict, so ``write_json_atomic`` writes it and
    ``moe_lab.results.load`` and the notebook read it as they always have). ``Record.point`` makes what every record
    of a point holds before its outcome; each outcome is a constructor that returns a new record with it:

    - ``ok(metrics, **more)``: status ok, no error, the run's (or plan's) metrics and any further sections (``plan``);
    - ``invalid(e)``: a config the job refused before building anything (``error.key``: the key a ConfigError names);
    - ``failure(e, metrics)``: ``oom`` when it ran out of GPU or host memory, else ``error``, with the traceback;
    - ``interrupted(signal, step, checkpoint, metrics)``: a signal stopped it (``error.exit_code``: the job's).

    A plan's record (``python -m moe_lab.plan``) is ``Record.plan``, then ``ok`` or ``invalid`` like a run's.
    """

    @classmethod
    def point(cls, meta: dict, cfg, **fields) -> Record:
        """The job's meta (``job_meta``: choices, overrides, sweep; its start), ``fields`` (``world_size``,
        ``environment``) and the resolved ``config``."""
        return cls({**meta, **fields, "config": point_config(cfg)})

    @classmethod
    def plan(cls, meta: dict, cfg, started_utc: str) -> Record:
        """A plan's record before its outcome: ``kind: plan``, so tables tell it from a run's."""
        return cls({**meta, "kind": "plan", "started_utc": started_utc, "config": point_config(cfg)})

    def ok(self, metrics: dict, **sections) -> Record:
        return Record({**self, "status": "ok", "error": None, "metrics": metrics, **sections})

    def invalid(self, e: BaseException) -> Record:
        """A ConfigError names its key; any other exception out of validation is a check that failed unexpectedly
        (no key), still a config this job cannot run."""
        if isinstance(e, ConfigError):
            error = {"type": "ConfigError", "key": e.key, "message": str(e)}
        else:
            error = {"type": type(e).__name__, "key": None, "message": f"validation failed: {e}"}
        return Record({"environment": software(), **self, "status": "invalid", "error": error})

    def failure(self, e: BaseException, metrics: dict | None = None) -> Record:
        """``failure(e)``, with the fields an exception of this code carries for its record (``details``: the
        damaged checkpoint and its file, the rank that died and how) and its own ``traceback`` where it has a better
        one."""
        fields = failure(e)
        fields["error"].update(getattr(e, "details", {}))
        if getattr(e, "traceback", None):
            fields["error"]["traceback"] = e.traceback
        return Record({**self, **fields, **_metrics(metrics)})

    def interrupted(
        self, signal_name: str, step: int | None, checkpoint: str | None, metrics: dict | None = None
    ) -> Record:
        """A signal stopped the point after ``step`` steps (None: before its ranks started), with ``checkpoint``
        saved there (None: none)."""
        when = "before training started" if step is None else f"after step {step}"
        saved = f"; checkpoint {checkpoint}" if checkpoint else ""
        error = {
            "type": "Interrupted",
            "signal": signal_name,
            "step": step,
            "checkpoint": checkpoint,
            "exit_code": 128 + signal.Signals[signal_name].value,  # as the shell reports a process the signal ended
            "message": f"{signal_name} received: stopped {when}{saved}",
        }
        return Record({**self, "status": "interrupted", "error": error, **_metrics(metrics)})

    def write(self, run_dir: str | Path) -> Record:
        """Write it as ``run_dir``'s result.json, atomically."""
        write_json_atomic(Path(run_dir) / RESULT, self)
        return self


def _metrics(metrics: dict | None) -> dict:
    return {} if metrics is None else {"metrics": metrics}


def read_result(run_dir: str | Path) -> dict | None:
    """The run directory's record, or None where there is none or it cannot be read as one: not JSON, or JSON but
    not an object holding a status and a config (every record this code writes has both)."""
    path = Path(run_dir) / RESULT
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if isinstance(record, dict) and isinstance(record.get("status"), str) and isinstance(record.get("config"), dict):
        return record
    return None


class MetricsLog:
    """One JSON line per step; a crash loses at most the line being written. A run starts the file afresh; one that
    resumes at step ``first_step`` keeps the rows of the steps before it and goes on (rows an interrupted attempt
    wrote after its last checkpoint are dropped, as is a line cut short). ``kept_step_times``: the kept rows' step
    times, in step order."""

    def __init__(self, run_dir: str | Path, first_step: int = 0):
        path = Path(run_dir) / METRICS
        kept, self.kept_step_times = [], []
        if first_step > 0 and path.exists():
            for line in path.read_text().splitlines():
                try:
                    row = json.loads(line)
                    if row["step"] < first_step:
                        kept.append(line + "\n")
                        self.kept_step_times.append(row["s_per_step"])
                except (ValueError, KeyError, TypeError):
                    continue
        write_text_atomic(path, "".join(kept))
        self.file = open(path, "a")

    def write(self, row: dict) -> None:
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


# How running out of memory reads when it arrives as another exception: an OOM in a child rank comes wrapped in
# elastic's ChildFailedError; PyTorch's CPU allocator raises a plain RuntimeError.
OOM_MESSAGES = (
    "OutOfMemoryError",
    "DefaultCPUAllocator: can't allocate memory",
    "DefaultCPUAllocator: not enough memory",
)


def failure(e: BaseException) -> dict:
    """Status and error fields of a failed run: ``oom`` when it ran out of GPU or host memory, else ``error``."""
    oom = isinstance(e, (torch.OutOfMemoryError, MemoryError)) or any(m in str(e) for m in OOM_MESSAGES)
    tb = "".join(traceback.format_exception(e)[-8:])
    return {
        "status": "oom" if oom else "error",
        "error": {"type": type(e).__name__, "message": str(e), "traceback": tb},
    }


def software() -> dict:
    """What ran the job, whatever its device and ranks: the host, Python, torch, CUDA and the moe_lab commit (an
    ``invalid`` record's environment: the code that refused the config)."""
    return {
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    } | git_state()


def environment(device: torch.device, world: int) -> dict:
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return {
        **software(),
        "device": device.type,
        "world_size": world,
        "nodes": max(1, world // local_world),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "gpu_count": world if device.type == "cuda" else 0,
    }


def git_state(source_dir: Path = SOURCE_DIR) -> dict:
    """Commit of the moe_lab source tree and whether it had uncommitted changes; nulls outside a git checkout.
    ``MOE_LAB_GIT_COMMIT`` (and ``MOE_LAB_GIT_DIRTY=0|1``) name them where the tree was copied without its own git
    history (a machine that received a working tree but kept an older .git)."""
    if os.environ.get("MOE_LAB_GIT_COMMIT"):
        dirty = os.environ.get("MOE_LAB_GIT_DIRTY")
        return {"git_commit": os.environ["MOE_LAB_GIT_COMMIT"], "git_dirty": None if dirty is None else dirty == "1"}

    def git(*args):
        return subprocess.run(["git", "-C", str(source_dir), *args], capture_output=True, text=True, timeout=10)

    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return {"git_commit": None, "git_dirty": None}
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".").stdout.strip() != ""
        return {"git_commit": head.stdout.strip(), "git_dirty": dirty}
    except (OSError, subprocess.SubprocessError):
        return {"git_commit": None, "git_dirty": None}
