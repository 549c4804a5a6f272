"""The lifecycle of one job (a single run or one sweep point): it ends with exactly one result.json, written by rank 0.

- A point whose directory already holds an ok record of the same configuration is skipped (a resumed sweep); a
  directory holding the record, or the newest checkpoint, of another configuration is not written to unless the
  command says what becomes of that run: ``trainer.resume=<a checkpoint>`` continues from it (a finished run
  trained longer: its record is replaced by one that holds its steps too), ``trainer.resume=never`` starts the
  directory afresh. An ``invalid`` record (nothing ran) never stands in the way. A point that was interrupted or
  failed after a checkpoint continues from it (``trainer.resume=auto``).
- A job holds its directory's lock for its life (``OutputDirGuard``): a second run or sweep into it is refused.
- An invalid configuration is recorded as ``invalid`` before anything is built; a failure as ``oom`` / ``error``
  (when a rank it started died, naming that rank and how, before rank 0's symptom); either way the console gets
  one line naming the record. In a sweep the failed point is returned so Hydra's launcher goes on, and the sweep
  ends naming its directory and its points by status (exit 1 when none is ok); a single run exits 1. A record that
  cannot be read is not done.
- SIGTERM / SIGINT stop every rank at the same step: the point is recorded as ``interrupted`` (after a checkpoint
  with ``trainer.checkpoint.on_signal``) and the job exits with 128 + the signal's number, a sweep included.
- The job starts its ranks itself (``trainer.nproc_per_node``) or runs as one rank of an outer torchrun / srun.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import gc
import json
import logging
import os
import socket
import sys
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.distributed as dist
from hydra.core.utils import JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from moe_lab import config
from moe_lab.checkpoint import directory as checkpoint_directory
from moe_lab.checkpoint.checkpointer import optimizer_mismatch
from moe_lab.config import Options
from moe_lab.config.validate import job_target
from moe_lab.job.interrupt import Interrupted, StopRequest
from moe_lab.job.launcher import (
    RanksFailed,
    adopt_slurm_environment,
    launch_local,
    raised_alike,
    shared_run_dir,
    spawns_ranks,
    started_by_outer_launcher,
)
from moe_lab.job.trainer import (
    check_cpu_memory_of_ranks,
    peak_memory,
    reset_peak_host_rss,
    summary_line,
    train,
)
from moe_lab.metrics.logger import NoLogger
from moe_lab.metrics.trace import StepProfiler
from moe_lab.optim.offload.host import share_host
from moe_lab.parallel.emulate import emulated_layout, enter_world
from moe_lab.plan.emulated import emulated_metrics
from moe_lab.results.record import (
    REPLACED,
    RESULT,
    Record,
    environment,
    point_config,
    read_result,
    write_json_atomic,
)
from moe_lab.runtime.determinism import set_determinism
from moe_lab.runtime.device import runs_on_cuda
from moe_lab.runtime.errors import ConfigError

log = logging.getLogger("moe_lab")

# Keys that say how a point is run, not what it computes: a record made with another value is still this point's
# (a key here covers the keys under it).
NOT_PART_OF_THE_POINT = ("trainer.skip_done", "trainer.checkpoint", "trainer.resume", "trainer.resume_fallback")


# What a CPU run out of host memory says besides (the README's 30B proxy on a laptop, say).
CPU_TOO_SMALL = (
    ". This configuration wants a GPU (trainer.device=auto takes one where there is one); on this CPU machine shrink "
    "its weights, which with their gradients must fit: model=tiny, or fewer model.num_layers"
)


class OutputDirGuard(Callback):
    """Refuses a job into a directory another job is running in: a single run into a ``hydra.run.dir``, a sweep
    into a ``hydra.sweep.dir`` (a lock held for the job's life, taken before Hydra writes its ``.hydra/`` files or
    multirun.yaml there, or any point a record). A sweep is also refused where the directory holds another sweep
    (other task overrides) that left a point's record or checkpoint; the same sweep again, once the first has ended,
    is a resume. Another sweep that left neither (refused as Hydra composed it, or failed before its first point
    recorded) is taken over: its overrides may never run, and nothing of it would be lost."""

    LOCK = ".moe_lab.lock"

    def __init__(self):
        self.lock = None
        # Points of this sweep that left no record of their own (the directory holds another configuration's): a
        # job that returns None. Seen where the launcher runs jobs in this process (not SLURM's).
        self.not_run: set[Path] = set()
        self.dry_runs = 0  # points that only counted their parameters (trainer.dry_run): nothing to record

    def on_job_end(self, config: DictConfig, job_return, **kwargs) -> None:
        if job_return.status != JobStatus.COMPLETED:
            return
        if job_return.return_value is None:
            self.not_run.add(Path(config.hydra.runtime.output_dir).resolve())
        elif OmegaConf.select(config, "trainer.dry_run") and "status" not in job_return.return_value:  # not refused
            self.dry_runs += 1

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        self._take(Path(config.hydra.run.dir), "hydra.run.dir", "job")

    def on_run_end(self, config: DictConfig, **kwargs) -> None:
        self._release()

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if not self._take(sweep_dir, "hydra.sweep.dir", "sweep"):
            return
        saved = sweep_dir / "multirun.yaml"
        if not saved.exists():
            return
        before = _point_overrides(OmegaConf.load(saved).hydra.overrides.task)
        now = _point_overrides(config.hydra.overrides.task)
        if before == now:
            return
        other = f"another sweep ({' '.join(before) or 'no overrides'})"
        if not _holds_points(sweep_dir):
            print(
                f"hydra.sweep.dir={config.hydra.sweep.dir} held {other} that recorded no point: this sweep takes it over",
                file=sys.stderr,
            )
            return
        raise OutputDirInUse(
            f"hydra.sweep.dir={config.hydra.sweep.dir} holds {other}; "
            f"this one ({' '.join(now) or 'no overrides'}) would overwrite its points. Choose another "
            "hydra.sweep.dir, or run the same overrides again to resume that sweep."
        )

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        if self.lock is None:  # a rank other than 0 of an outer launcher
            return
        self._release()
        points = {path.parent.resolve() for path in Path(config.hydra.sweep.dir).rglob(RESULT)} | self.not_run
        statuses = [
            "not run (another configuration's record or checkpoint there)"
            if point in self.not_run
            else (read_result(point) or {}).get("status", "unreadable")
            for point in sorted(points)
        ] + ["dry run (counted, nothing recorded)"] * self.dry_runs
        counts = ", ".join(f"{n} {status}" for status, n in Counter(statuses).most_common())
        print(f"sweep {config.hydra.sweep.dir}: {len(statuses)} points: {counts or 'none recorded'}")
        if "ok" not in statuses and not self.dry_runs:
            raise SweepFailed(f"sweep {config.hydra.sweep.dir}: no point ended ok")

    def _take(self, directory: Path, key: str, job: str) -> bool:
        """Lock ``directory`` for this job, naming this process in the lock file; False on ranks other than 0 of
        an outer launcher (they run in a scratch directory of their own)."""
        if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) != "0":
            return False
        directory.mkdir(parents=True, exist_ok=True)
        self.lock = open(directory / self.LOCK, "a+")
        try:
            fcntl.flock(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.lock.seek(0)
            holder = self.lock.read().strip()  # the holder's own words: a run may hold a sweep's directory
            holder = holder if holder.startswith("a running ") else f"another process ({holder or 'unnamed'})"
            self._release()
            raise OutputDirInUse(
                f"{key}={directory} is in use by {holder}; wait for it to end or choose another {key}."
            ) from None
        self.lock.truncate(0)
        self.lock.write(f"a running {job} ({socket.gethostname()} pid {os.getpid()})\n")
        self.lock.flush()
        return True

    def _release(self) -> None:
        if self.lock is not None:
            self.lock.close()  # releases the lock; the file stays, so a waiting job never locks a stale copy
            self.lock = None


class OutputDirInUse(SystemExit):
    """Stops the job with its message (Hydra turns a callback's Exception into a warning and goes on)."""


class SweepFailed(SystemExit):
    """A sweep none of whose points ended ok exits 1 with this message, so that a script can tell."""


def _holds_points(sweep_dir: Path) -> bool:
    """Whether a sweep left anything of its points here: a record of any status (readable or not), or a checkpoint
    (a point killed before recording leaves one, which the same sweep again continues from)."""
    left = (RESULT, checkpoint_directory.MARKER)
    return any(path.name in left for path in sweep_dir.rglob("*"))


def _point_overrides(overrides) -> list[str]:
    def part_of_the_point(key: str) -> bool:
        return not any(key == k or key.startswith(k + ".") for k in NOT_PART_OF_THE_POINT)

    return [o for o in overrides if part_of_the_point(o.lstrip("+~").partition("=")[0])]


def _comparable(point: dict) -> dict:
    point = json.loads(json.dumps(point))
    for dotted in NOT_PART_OF_THE_POINT:
        section, _, key = dotted.partition(".")
        point.get(section, {}).pop(key, None)
    return point


def same_point(record: dict, cfg: DictConfig) -> bool:
    return _comparable(record.get("config") or {}) == _comparable(point_config(cfg))


def run_job(cfg: DictConfig, run_dir: Path, meta: dict, multirun: bool = False) -> dict | None:
    adopt_slurm_environment()
    meta = {**meta, "started_utc": datetime.now(UTC).isoformat(timespec="seconds")}
    outer = started_by_outer_launcher()
    # SIGTERM / SIGINT from here on stop the point at a step boundary (ranks this job starts note them themselves:
    # the launcher forwards them). A single process escalates on a second one.
    with StopRequest(escalate=not outer and not spawns_ranks(cfg)) as stop:
        result = _run_point(cfg, run_dir, meta, multirun, outer, stop)
    if result is not None and result.get("status") == "interrupted":
        # A single run exits non-zero; a sweep stops here, its later points not run (re-running it resumes).
        log.warning(
            "%s; recorded in %s. %s", result["error"]["message"], run_dir / RESULT, how_to_go_on(run_dir, cfg, multirun)
        )
        raise SystemExit(result["error"]["exit_code"])
    return result


def how_to_go_on(run_dir: Path, cfg: DictConfig, multirun: bool) -> str:
    """What running the same command again does after a signal stopped this point: continue from the newest
    checkpoint ``trainer.resume=auto`` would take, or start over where there is none."""
    again = "Running the same sweep again runs the rest; this point" if multirun else "The same command again"
    resumable = resumable_checkpoint(run_dir, cfg)
    if resumable is None:
        return (
            f"No checkpoint was saved: {again.lower()} starts from step 0 (trainer.checkpoint.on_signal=true saves "
            "one when a signal stops the run, trainer.checkpoint.every=N every N steps)."
        )
    if cfg.trainer.resume == "auto":
        return f"{again} continues from {resumable}."
    return f"{again} with trainer.resume=auto (not {cfg.trainer.resume}) continues from {resumable}."


def resumable_checkpoint(run_dir: Path, cfg: DictConfig) -> Path | None:
    """The newest complete checkpoint of this point in its checkpoint directory (what ``trainer.resume=auto``
    continues from), or None."""
    newest, marker = newest_readable_checkpoint(run_dir, cfg)
    return newest if newest is not None and same_point(marker, cfg) else None


def newest_readable_checkpoint(run_dir: Path, cfg: DictConfig) -> tuple[Path | None, dict | None]:
    """The newest complete checkpoint of the point's checkpoint directory whose marker reads, and the marker; a
    damaged one is passed over (restoring it says so, and falls back past it with trainer.resume_fallback)."""
    directory = checkpoint_directory.checkpoint_dir(cfg.trainer.checkpoint.dir, run_dir)
    for newest in reversed(checkpoint_directory.complete(directory)):
        with contextlib.suppress(OSError, ValueError):
            return newest, checkpoint_directory.read_marker(newest)
    return None, None


def _run_point(
    cfg: DictConfig, run_dir: Path, meta: dict, multirun: bool, outer: bool, stop: StopRequest
) -> dict | None:
    rank0 = os.environ.get("RANK", "0") == "0"
    if not outer:  # under an outer launcher only rank 0 knows the run directory: the ranks decide in worker()
        try:
            earlier = earlier_record(run_dir, cfg, multirun)
        except RunDirInUse as e:
            if not multirun:
                sys.exit(str(e))
            log.error("point not run: %s", e)
            return None
        if earlier is not None:
            return earlier
    try:
        options = config.validate(cfg, job_target(cfg))
        check_resume_step(cfg)
    except Exception as e:  # a ConfigError, or a check that failed in an unexpected way: a config this job cannot run
        return _record_invalid(cfg, run_dir, meta, multirun, rank0, e)
    if cfg.trainer.dry_run:
        return dry_run(cfg, options)
    if not outer:
        clear_earlier(run_dir)
    resolved = OmegaConf.to_yaml(cfg, resolve=True)
    try:
        if spawns_ranks(cfg) and not outer:
            if not runs_on_cuda(cfg.trainer):
                check_cpu_memory_of_ranks(options.model, cfg.trainer.nproc_per_node, cfg.parallel.dp_replicate)
            # Fresh processes build their own options from the resolved config.
            return launch_local(
                cfg.trainer.nproc_per_node, worker, resolved, str(run_dir), meta, cuda=runs_on_cuda(cfg.trainer)
            )
        return worker(resolved, str(run_dir), meta, options, stop)
    except Exception as e:
        # The ranks this job started exit on a signal (SystemExit) once rank 0 has recorded it; when the launcher got
        # the signal, it forwarded it to them and waited for them to exit.
        record = read_result(run_dir) if rank0 else None
        if record is not None and record["status"] == "interrupted":
            return record
        if isinstance(e, SignalException):  # no rank got as far as recording it
            return Record.point(meta, cfg).interrupted(e.sigval.name, None, None).write(run_dir)
        rank0_error = record["error"] if record is not None and record["status"] != "ok" else None
        # Which rank failed first, and how, before what rank 0 saw of it; unless every rank raised what rank 0
        # recorded, whose record then stands with its fields (the damaged checkpoint, the memory advice).
        raised = rank0_error and f"{rank0_error['type']}: {rank0_error['message'].removesuffix(CPU_TOO_SMALL)}"
        if isinstance(e, ChildFailedError) and not (raised and raised_alike(e, raised)):
            e = RanksFailed(e, rank0_error)
        # Rank 0 records its own failure; when another rank failed first, the record tells that rank's story.
        if rank0 and (record is None or isinstance(e, RanksFailed) and record["status"] != "ok"):
            device = torch.device("cuda" if runs_on_cuda(cfg.trainer) else "cpu")
            base = Record(record) if record is not None else point_record(meta, cfg, device, cfg.trainer.nproc_per_node)
            # this process's memory only for its own failure on CPU (the host check before the ranks start): it is
            # not the ranks', and it never touched CUDA
            own = not isinstance(e, RanksFailed) and device.type == "cpu"
            metrics = base.get("metrics") or (peak_memory(device) if own else None)
            failure_with_advice(base, e, metrics, device).write(run_dir)
        record = read_result(run_dir)
        error = (record or {}).get("error") or {"type": type(e).__name__, "message": str(e)}
        where = f"recorded in {run_dir / RESULT}" if rank0 else f"rank 0 records it in {run_dir / RESULT}"
        log.error("%s failed, %s: %s: %s", "point" if multirun else "run", where, error["type"], error["message"])
        if not multirun:  # one line, as a sweep's point: the traceback is in the record (error.traceback)
            raise SystemExit(1) from None
        return record
    finally:
        _free_point_memory()


def earlier_record(run_dir: Path, cfg: DictConfig, multirun: bool) -> dict | None:
    """The record to return instead of running: this point's own ok record when resuming a sweep. A record of
    another configuration is not overwritten unless ``trainer.resume`` says what becomes of its run (a checkpoint
    to continue from, or never: start afresh), and then only by this point's own record once it has one (an
    invalid config leaves it alone, ``_record_invalid``); else the job stops naming it. An ``invalid`` record (the
    config was refused, nothing ran) is replaced."""
    check_checkpoints(run_dir, cfg)
    record = read_result(run_dir)
    rank0 = os.environ.get("RANK", "0") == "0"
    if record is None:
        if (run_dir / RESULT).exists() and rank0:
            log.warning("%s is no readable record: the point runs again", run_dir / RESULT)
            (run_dir / RESULT).unlink()
        return None
    if not same_point(record, cfg) and record.get("status") != "invalid":
        if cfg.trainer.resume == "auto":
            raise RunDirInUse(
                f"{run_dir / RESULT} holds the record of another configuration; a new one would overwrite it. Use "
                "another hydra.run.dir / hydra.sweep.dir, trainer.resume=<a checkpoint> to continue that run (its "
                "record is then replaced by the longer run's), or trainer.resume=never to start this directory afresh."
            )
        log.warning(
            "%s holds the record of another configuration; this run's record replaces it if its config is valid "
            "(trainer.resume=%s)",
            run_dir / RESULT,
            cfg.trainer.resume,
        )
        return None
    if multirun and cfg.trainer.skip_done and record.get("status") == "ok":
        log.info("point already done, skipped: %s", run_dir)
        return record
    if record.get("status") == "ok" and ran_to_the_end(run_dir, cfg):
        # the same command again would resume at the last step and record a run of no step over the measured one
        log.info(
            "run already done (its last checkpoint is at trainer.steps=%d): its record is kept; trainer.resume=never "
            "runs it again",
            cfg.trainer.steps,
        )
        return record
    return None  # this point's failed earlier attempt, or a deliberate re-run: replaced once valid (clear_earlier)


def ran_to_the_end(run_dir: Path, cfg: DictConfig) -> bool:
    """Whether ``trainer.resume=auto`` would continue from a checkpoint at the last step: nothing left to run."""
    if cfg.trainer.resume != "auto":
        return False
    newest, marker = newest_readable_checkpoint(run_dir, cfg)
    return newest is not None and same_point(marker, cfg) and marker["step"] >= cfg.trainer.steps


def clear_earlier(run_dir: Path) -> None:
    """The record this point's run replaces (its earlier attempt, or another run's ``trainer.resume`` let through),
    cleared once the config is valid, before anything runs: a failure before the run's own record would otherwise
    be read as that one's. A measured (ok) record is moved to ``REPLACED``, not deleted: a re-run that dies
    unrecorded (killed, out of host memory) loses no measurement."""
    if os.environ.get("RANK", "0") != "0":
        return
    record = read_result(run_dir)
    if record is not None and record.get("status") == "ok":
        (run_dir / RESULT).replace(run_dir / REPLACED)
        log.info("the earlier ok record is kept as %s", run_dir / REPLACED)
    else:
        (run_dir / RESULT).unlink(missing_ok=True)


def check_resume_step(cfg: DictConfig) -> None:
    """A checkpoint named by ``trainer.resume`` must leave steps to run (one at trainer.steps or later would end the
    run at once: an ok record of nothing new) and hold the state of this run's optimizer."""
    if cfg.trainer.resume in ("auto", "never"):
        return
    marker = checkpoint_directory.read_marker(cfg.trainer.resume)  # validation found it complete
    if why := optimizer_mismatch(marker, OmegaConf.to_container(cfg, resolve=True)):
        raise ConfigError("optimizer", f"trainer.resume={cfg.trainer.resume}: {why}")
    step = marker["step"]
    if step >= cfg.trainer.steps:
        raise ConfigError(
            "trainer.steps",
            f"is {cfg.trainer.steps}, but trainer.resume={cfg.trainer.resume} is at step {step}: no step would run. "
            f"Set trainer.steps above {step} to train on from it.",
        )


def check_checkpoints(run_dir: Path, cfg: DictConfig) -> None:
    """``trainer.resume=auto`` continues from the newest checkpoint of the checkpoint directory: refuse when that is
    a checkpoint of another configuration (the record it would overwrite may be gone: a killed run leaves none). A
    point interrupted or failed after a checkpoint resumes from it."""
    if cfg.trainer.resume != "auto":
        return
    newest, marker = newest_readable_checkpoint(run_dir, cfg)
    if newest is not None and not same_point(marker, cfg):
        raise RunDirInUse(
            f"{newest} is a checkpoint of another configuration; trainer.resume=auto would continue from it. Use "
            "another hydra.run.dir / hydra.sweep.dir or trainer.checkpoint.dir, trainer.resume=never to start afresh "
            "(the checkpoints there are removed as it starts), or trainer.resume=<that checkpoint> to continue from it on purpose (a "
            "finished run trained longer: its record is replaced by the longer run's)."
        )


class RunDirInUse(RuntimeError):
    pass


def _record_invalid(cfg, run_dir: Path, meta: dict, multirun: bool, rank0: bool, e: Exception) -> dict | None:
    """Record the refused config, unless the directory holds the record of a run (another run's that
    ``earlier_record`` let a ``trainer.resume`` of it through, or this point's own, refused now for a
    ``trainer.resume`` that is not there): a config that never ran does not replace a run. In a sweep, the record
    written, or None where the directory's record is not this point's."""
    record = Record.point(meta, cfg).invalid(e)
    earlier = read_result(run_dir) if rank0 else None
    keep = earlier is not None and earlier.get("status") != "invalid"
    where = f"not recorded: {run_dir / RESULT} of the run before is kept" if keep else f"recorded in {run_dir / RESULT}"
    if rank0 and not keep:
        record.write(run_dir)
    if multirun:
        log.error("invalid config, point not run: %s (%s)", record["error"]["message"], where)
        return None if keep else record
    sys.exit(f"invalid config: {record['error']['message']} ({where})")


def count(n: float, billion: str = "B") -> str:
    """``n`` with its prefix: 30.53B, 1.20M, 512.00K (a tiny model's 0.00B said nothing); ``billion="G"`` for FLOP."""
    for scale, prefix in ((1e9, billion), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}{prefix}"
    return f"{n:.0f}"


def dry_run(cfg: DictConfig, options: Options) -> dict:
    from moe_lab.metrics.flops import flops_per_token
    from moe_lab.models.qwen3_moe import count_parameters

    model = options.model
    total, active = count_parameters(model)
    fpt = flops_per_token(model, cfg.data.seq_len)
    print(
        f"{model.name} ({model.num_layers} layers): {count(total)} total, {count(active)} active parameters; "
        f"{count(fpt['shared'], 'G')} FLOP/token at seq {cfg.data.seq_len}"
    )
    return {"total_params": total, "active_params": active, "flops_per_token": fpt["shared"]}


def worker(
    resolved_yaml: str, run_dir: str, meta: dict, options: Options | None = None, stop: StopRequest | None = None
) -> dict:
    """One rank of a job. Rank 0 writes metrics.jsonl and result.json; every failure is recorded before it is
    re-raised. A rank the job started itself notes signals on its own (``stop``: the job's)."""
    started_here = stop is None
    with StopRequest() if started_here else contextlib.nullcontext(stop) as stop:
        result = _worker(resolved_yaml, run_dir, meta, options, stop)
    if started_here and result["status"] == "interrupted":
        # Exit rather than return: after a signal the launcher reads no return value, it waits for its ranks to exit
        # (a rank that returned would wait for its value to be read until the launcher killed it).
        raise SystemExit(result["error"]["exit_code"])
    return result


def _worker(resolved_yaml: str, run_dir: str, meta: dict, options: Options | None, stop: StopRequest) -> dict:
    cfg = OmegaConf.create(resolved_yaml)
    emulated = emulated_layout(cfg)
    enter_world(emulated)
    share_host(emulated["mesh"]["gpus_per_node"] if emulated is not None else 1)  # a sweep's next point resets it
    if emulated is not None:  # one process as one rank of the layout: it writes the point's files
        rank, world, writer = emulated["rank"], emulated["world"], True
        log.warning(emulated["note"])
    else:
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        writer = rank == 0
    set_determinism(cfg.trainer.deterministic, cfg.trainer.seed)  # before CUDA work: cuBLAS reads its setting then
    device = _device(cfg, int(os.environ.get("LOCAL_RANK", 0)))
    if writer:
        _log_to_run_files(meta.get("log_file"))
    if world > 1 and not dist.is_initialized():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", device_id=device if device.type == "cuda" else None
        )
        # One process group per process: the points of a sweep under torchrun share it, because initialising the
        # default group again on the launcher's store races (a rank can pick up the previous group's keys and hang).
        atexit.register(dist.destroy_process_group)
    run_dir = Path(shared_run_dir(run_dir))
    if started_by_outer_launcher():  # every rank reads rank 0's run directory, so all ranks agree
        earlier = earlier_record(run_dir, cfg, bool(meta.get("sweep")))
        if earlier is not None:
            return earlier
        clear_earlier(run_dir)  # validated before the ranks started (_run_point)
    options = options or config.build_options(cfg)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # a sweep runs its points in one process
        torch.cuda.reset_accumulated_memory_stats(device)  # the allocator's retry count is per point too
    reset_peak_host_rss()
    record = point_record(meta, cfg, device, world)
    if emulated is not None:
        record["emulated"] = emulated
    logger = options.logger if writer else NoLogger()
    logger.start(run_dir, record)
    result = {**record, "status": "error"}  # until the run says otherwise
    try:
        with StepProfiler(cfg.profile, run_dir, rank) as profiler:
            metrics = train(cfg, options, run_dir, device, rank, world, logger, profiler, stop)
        if writer:
            metrics["trace_breakdown"] = profiler.breakdown()
        if emulated is not None:
            metrics |= emulated_metrics(cfg, metrics)
        result = record.ok(metrics)
    except Interrupted as e:  # every rank stopped at the same step
        result = record.interrupted(e.signal_name, e.step, e.checkpoint, e.metrics)
    except Exception as e:
        result = failure_with_advice(record, e, peak_memory(device), device)
        if emulated is not None:  # what the plan expected of the rank that failed (an OOM's planned memory)
            result["metrics"] |= emulated_metrics(cfg, result["metrics"])
        if writer:
            write_json_atomic(run_dir / RESULT, result)
        raise
    finally:
        logger.finish(result)
    if writer:
        write_json_atomic(run_dir / RESULT, result)
        if result["status"] == "ok":
            log.info(summary_line(result["metrics"]))
        for line in [f"run directory: {run_dir}", *profiler.where(), *logger.where()]:
            log.info(line)
    if dist.is_initialized():
        # Ranks leave together: a gloo rank that exits (and tears its group down) while a peer still talks to it
        # can abort ("terminate called without an active exception"). Only successful jobs meet here; a failing rank
        # exits at once and its launcher stops the others.
        dist.barrier()
    return result


def failure_with_advice(record: Record, e: BaseException, metrics: dict | None, device: torch.device) -> Record:
    """``record.failure``, with what to do where a CPU run ran out of host memory (a host check refuses it before
    allocating: shrink it)."""
    result = record.failure(e, metrics)
    if result["status"] == "oom" and device.type == "cpu":
        result["error"]["message"] += CPU_TOO_SMALL
    return result


def point_record(meta: dict, cfg: DictConfig, device: torch.device, world: int) -> Record:
    """What every record of a point holds before its outcome: the job's meta, world size, config and environment."""
    return Record.point(meta, cfg, world_size=world, environment=environment(device, world))


def _device(cfg: DictConfig, local_rank: int) -> torch.device:
    if runs_on_cuda(cfg.trainer):  # validation has rejected trainer.device=cuda without CUDA
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _log_to_run_files(log_file: str | None) -> None:
    """A rank the job started itself has no Hydra logging: send moe_lab's log to the console and to the run's
    log file (Hydra's train.log, opened by the job's own process), as Hydra does in that process."""
    if logging.getLogger().handlers or not log_file:
        return
    formatter = logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    for handler in (logging.StreamHandler(sys.stdout), logging.FileHandler(log_file)):
        handler.setFormatter(formatter)
        logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(logging.INFO)


def _free_point_memory() -> None:
    """The next point of a sweep runs in this process: free this one's model and host state (offload's reference
    cycles, and a failed point's traceback) before it builds its own."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        # Offload's pinned host buffers go back to PyTorch's pinned-block cache, which keeps them (tens of GiB)
        # for reuse; a next point with other sizes would pin beside them. (torch 2.13 made this public.)
        empty_host_cache = getattr(torch.accelerator, "empty_host_cache", None) or torch._C._host_emptyCache
        empty_host_cache()
