"""How a job's ranks start: by themselves through torch's elastic launcher (``trainer.nproc_per_node=N``), or
already started by an outer ``torchrun`` / SLURM ``srun`` (detected from the environment; ``hydra/launcher=slurm``
submits each sweep point as such an srun job)."""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.forkserver
import os
import select
import signal
import tempfile
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from moe_lab.parallel.emulate import is_emulated

# The environment this module was imported with. In a rank (forked from the forkserver, see launch_local) that is the
# server's: the module came with the server's preload, or was imported as the rank unpickled its entrypoint, before
# elastic set the rank's variables.
_IMPORT_ENVIRON = dict(os.environ)


def _in_slurm_step() -> bool:
    return "SLURM_PROCID" in os.environ and "SLURM_NTASKS" in os.environ


def spawns_ranks(cfg) -> bool:
    """The job starts ``trainer.nproc_per_node`` processes itself (one process emulates the layout with
    ``parallel.emulate``)."""
    return cfg.trainer.nproc_per_node > 1 and not cfg.parallel.emulate


def started_by_outer_launcher() -> bool:
    return "WORLD_SIZE" in os.environ or _in_slurm_step()


def adopt_slurm_environment() -> None:
    """Map SLURM's task variables onto torch.distributed's, so ``srun python -m moe_lab.train`` just works. The
    first host of the job's node list (parsed by submitit, from the ``slurm`` extra) is the rendezvous host."""
    if "WORLD_SIZE" in os.environ or not _in_slurm_step():
        return
    from submitit.slurm.slurm import SlurmJobEnvironment

    job = SlurmJobEnvironment()
    os.environ["RANK"] = str(job.global_rank)
    os.environ["WORLD_SIZE"] = str(job.num_tasks)
    os.environ["LOCAL_RANK"] = str(job.local_rank)
    os.environ["LOCAL_WORLD_SIZE"] = str(job.num_tasks // job.num_nodes)
    os.environ.setdefault("MASTER_ADDR", job.hostnames[0])
    os.environ.setdefault("MASTER_PORT", str(20000 + int(job.job_id) % 40000))  # one port per job, same on all tasks


def rank_hydra_overrides() -> list[str]:
    """Extra Hydra overrides for this process. Under an outer launcher every rank runs the Hydra app; ranks other
    than 0 then leave no files in the job's directories: no ``.hydra/`` copy of the config, no log file, and their
    own Hydra directory (where a sweep still writes its multirun.yaml) is a fixed scratch directory per rank under
    the system's temporary directory. The job's run directory is rank 0's, see ``shared_run_dir``."""
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
    if rank == "0":
        return []
    scratch = Path(tempfile.gettempdir()) / f"moe_lab_hydra_rank{rank}"
    return [
        "hydra.output_subdir=null",
        "hydra/job_logging=disabled",
        "hydra/hydra_logging=disabled",
        f"hydra.run.dir={scratch}",
        f"hydra.sweep.dir={scratch}",
        "hydra.sweep.subdir=.",
    ]


def shared_run_dir(run_dir: str) -> str:
    """Rank 0's run directory, on every rank (each rank's own Hydra may have named another); an emulated rank is
    the job's one process."""
    if not dist.is_initialized() or is_emulated():
        return run_dir
    holder = [run_dir]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def launch_local(nproc: int, entrypoint: Callable, *args, cuda: bool):
    """Run ``entrypoint(*args)`` on ``nproc`` new processes of this host; returns rank 0's return value.
    A failing rank stops all of them and raises ``torch.distributed.elastic.multiprocessing.errors.ChildFailedError``
    (``RanksFailed`` tells its story).

    CPU ranks fork from multiprocessing's forkserver, a process that imported the entrypoint's module (torch and the
    package with it) once, instead of each importing them again (seconds a rank); the server initialized no process
    group, so each rank still starts clean, in this process's environment and directory. ``cuda`` ranks start as
    fresh interpreters: a fork keeps whatever an import did to the CUDA driver."""
    if not cuda:
        _start_forkserver([entrypoint.__module__])
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=uuid.uuid4().hex,
        rdzv_backend="c10d",
        # The rendezvous store is this process's, bound to a port the system gives it (port 0), not one picked free
        # first and bound later (another process could take it in between); elastic binds the ranks' store so too.
        rdzv_endpoint="127.0.0.1:0",
        rdzv_configs={"is_host": True},
        max_restarts=0,
        # Elastic names one failed rank: the first it sees dead. A rank killed outright (a signal) must be seen before
        # a peer that then fails on it exits, and a forked rank exits within milliseconds of failing: poll often.
        monitor_interval=0.01,
        start_method="spawn" if cuda else "forkserver",
    )
    return elastic_launch(config, _as_launched)(os.getpid(), dict(os.environ), os.getcwd(), entrypoint, *args)[0]


def _start_forkserver(preload: list[str]) -> None:
    """Start multiprocessing's forkserver (if not running) with ``preload`` imported and SIGTERM blocked in it (it
    ignores SIGINT itself): a signal to the job's whole process group (a scheduler's, ``timeout``'s) must not end
    the server while the ranks it forked finish their step and record it, for the launcher waits on the ranks
    through it. Blocked, not ignored, in this thread while the server starts (it inherits the mask): a SIGTERM
    meanwhile is delivered here once it is unblocked, not lost."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(preload)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _as_launched(job: int, environ: dict, cwd: str, entrypoint: Callable, *args):
    """A rank: ``entrypoint(*args)`` in the launcher's environment and directory (a forked rank has the server's,
    which may be older) with elastic's variables for this rank (what it set differs from the server's; a spawned
    rank imported this module in the launcher's environment, so there it changes nothing), ending with the job's
    process ``job``."""
    _end_with(job)
    rank_variables = {k: v for k, v in os.environ.items() if _IMPORT_ENVIRON.get(k) != v}
    os.environ.clear()
    os.environ.update({**environ, **rank_variables})
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # a forked rank inherits the server's mask
    os.chdir(cwd)
    tempfile.tempdir = None  # TMPDIR is read again
    try:
        return entrypoint(*args)
    finally:
        atexit._run_exitfuncs()  # as an interpreter's exit does (a forked rank ends with os._exit): logs flushed


def _end_with(job: int) -> None:
    """End this rank the moment the job's process ``job`` ends. A job killed outright (SIGKILL, the OOM killer) stops
    nothing itself: its ranks (children of the forkserver, or of the job) would go on training into its run directory
    unlocked (the job held the lock), racing the same command run again for its checkpoints and its record. Killed
    too, as the job was: the job's process group is gone, so nothing could record what a rank would say."""
    try:
        watched = os.pidfd_open(job)
    except AttributeError:  # not Linux: the ranks end with the job's process group only
        return
    except ProcessLookupError:  # it ended already
        os.kill(os.getpid(), signal.SIGKILL)

    def watch() -> None:
        select.select([watched], [], [])  # readable once the process has ended
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="moe_lab-job-watch", daemon=True).start()


class RanksFailed(RuntimeError):
    """Ranks this job started that failed (elastic's ``ChildFailedError``), told for a record: each failed rank and
    how it ended (a signal, an exit code, its exception), the first to fail first; then rank 0's own error
    (``rank0_error``, from its record) where rank 0 did not fail itself but saw a peer's failure as its symptom (a
    closed connection) before the launcher stopped it. ``details``: the same as fields; ``traceback``: the first
    failed rank's, else rank 0's."""

    def __init__(self, error: ChildFailedError, rank0_error: dict | None = None):
        # Seconds resolve the order; within one, a rank that left no exception (a signal) explains the others.
        failed = sorted(error.failures.items(), key=lambda kv: (kv[1].timestamp, _exception(kv[1]) is not None, kv[0]))
        ranks = [_rank_failure(rank, failure) for rank, failure in failed]
        parts = [rank["message"] for rank in ranks]
        symptom = None
        if rank0_error and 0 not in error.failures:
            symptom = {"type": rank0_error.get("type"), "message": rank0_error.get("message")}
            parts.append(f"rank 0 then failed: {symptom['type']}: {symptom['message']}")
        super().__init__("; ".join(parts))
        first = ranks[0]
        self.details = {
            "rank": first["rank"],
            "signal": first["signal"],
            "exit_code": first["exit_code"],
            "ranks": ranks,
            "rank0_error": symptom,
        }
        self.traceback = _callstack(failed[0][1]) or (rank0_error or {}).get("traceback")


def raised_alike(error: ChildFailedError, exception: str) -> bool:
    """Whether every failed rank raised ``exception`` ("Type: message", rank 0's): each found the same fault by itself
    (a damaged checkpoint, a config its state does not fit), which rank 0's own record tells best. A rank's other
    failure, or a peer's symptom of it, is ``RanksFailed``'s story."""
    return all(_exception(f) == exception for f in error.failures.values())


def _rank_failure(rank: int, failure: ProcessFailure) -> dict:
    signal_name = failure.signal_name() if failure.exitcode < 0 else None
    exit_code = failure.exitcode if failure.exitcode >= 0 else None
    how = f"died of signal {signal_name}" if signal_name else f"exited with code {exit_code}"
    if signal_name == "SIGKILL":
        how += " (sent by kill -9, or by the kernel's out-of-memory killer)"
    exception = _exception(failure)
    message = f"rank {rank} (pid {failure.pid}) {how}" + (f": {exception}" if exception else "")
    return {
        "rank": rank,
        "pid": failure.pid,
        "signal": signal_name,
        "exit_code": exit_code,
        "exception": exception,
        "message": message,
    }


def _exception(failure: ProcessFailure) -> str | None:
    """The exception a failed rank recorded in its error file ("Type: message"), or None (a signal leaves none;
    elastic then holds a placeholder string)."""
    message = failure.error_file_data.get("message")
    return message.get("message") or None if isinstance(message, dict) else None


def _callstack(failure: ProcessFailure) -> str | None:
    message = failure.error_file_data.get("message")
    return message.get("extraInfo", {}).get("py_callstack") if isinstance(message, dict) else None
