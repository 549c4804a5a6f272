"""``python -m moe_lab.train ARGS`` as a process of its own, forked from a server that imported moe_lab.train once
(``multiprocessing``'s forkserver, shared with tests/distributed.py) rather than a fresh interpreter importing torch
and the package again (seconds a command on a shared CPU). The process runs the module's ``__main__`` block with the
caller's arguments, environment (OMP_NUM_THREADS included: the thread count it names) and directory; its exit status
and output are what the command's would be (an uncaught exception or ``sys.exit(message)`` prints to stderr and
exits 1, a signal that kills it is a negative status). The ranks a job starts fork from a forkserver of its own,
as moe_lab.job.launcher starts CPU ranks; on a machine with CUDA the command and its ranks are fresh processes."""

from __future__ import annotations

import atexit
import gc
import os
import runpy
import subprocess
import sys
import tempfile

import torch

from tests.distributed import forkserver


def _main(args: list[str], environ: dict, cwd: str, stdout: str, stderr: str, new_session: bool, cpus, script) -> None:
    if new_session:
        os.setsid()
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    tempfile.tempdir = None  # TMPDIR is read again
    if "OMP_NUM_THREADS" in environ:  # read as torch starts, which the server did before this environment was known
        torch.set_num_threads(int(environ["OMP_NUM_THREADS"]))
    for fd, path in ((1, stdout), (2, stderr)):  # at the descriptors: what the job's ranks write goes there too
        with open(path, "a") as f:
            os.dup2(f.fileno(), fd)
    try:
        if script is None:
            sys.argv = ["moe_lab.train", *args]
            sys.modules.pop("moe_lab.train", None)  # the server's import: run afresh as __main__, as -m does
            runpy.run_module("moe_lab.train", run_name="__main__", alter_sys=True)
        else:
            sys.argv = [script, *args]
            runpy.run_path(script, run_name="__main__")
    finally:
        atexit._run_exitfuncs()  # as an interpreter's exit does (a forked process ends with os._exit)


class ForkedProcess:
    """The command forked from the forkserver: what the tests use of ``subprocess.Popen`` (pid, poll, wait,
    send_signal, returncode)."""

    def __init__(self, args, cwd, stdout: str, stderr: str, environ: dict, new_session: bool, cpus, script):
        self.args = [script or "moe_lab.train", *args]
        self._process = forkserver().Process(
            target=_main, args=(list(args), environ, str(cwd), stdout, stderr, new_session, cpus, script)
        )
        self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)


def start_train(
    args, cwd, stdout: str, stderr: str, env: dict | None = None, new_session=False, cpus=None, script=None
) -> subprocess.Popen | ForkedProcess:
    """``subprocess.Popen([python, "-m", "moe_lab.train", *args], cwd=cwd, env=env, stdout=stdout, stderr=stderr,
    start_new_session=new_session)`` with its affinity set to ``cpus`` (``[python, script, *args]`` for a
    ``script``: tests/sweep.py); stdout and stderr are files, appended to (one path for both merges them). Forked
    (``ForkedProcess``) where there is no CUDA; on a GPU machine the Popen itself, a fresh interpreter as before: a
    job's CUDA must not depend on what the forkserver's imports did to the driver (only NVML's device check is
    fork-safe)."""
    environ = dict(os.environ if env is None else env)
    if not torch.cuda.is_available():
        return ForkedProcess(args, cwd, stdout, stderr, environ, new_session, cpus, script)
    # The job is a process of its own on the same GPU: the memory this test process's allocator still caches from
    # earlier tests would be the job's missing room (on an 80 GiB card it was: 71.7 GiB held, the job out of memory).
    gc.collect()
    torch.cuda.empty_cache()
    command = [sys.executable, script] if script else [sys.executable, "-m", "moe_lab.train"]
    with open(stdout, "a") as out, open(stderr, "a") as err:
        return subprocess.Popen(
            [*command, *args],
            cwd=cwd,
            env=environ,
            stdout=out,
            stderr=err,
            start_new_session=new_session,
            preexec_fn=None if cpus is None else (lambda: os.sched_setaffinity(0, cpus)),
        )


def train_cli(
    *args: str, cwd, env: dict | None = None, timeout: float = 300, script=None
) -> subprocess.CompletedProcess:
    """``subprocess.run([python, "-m", "moe_lab.train", *args], cwd=cwd, env=env, capture_output=True, text=True)``
    (``[python, script, *args]`` for a ``script``)."""
    with tempfile.TemporaryDirectory() as out:
        stdout, stderr = os.path.join(out, "stdout"), os.path.join(out, "stderr")
        proc = start_train(args, cwd, stdout, stderr, env, script=script)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, 9)
            proc.wait()
            raise
        with open(stdout) as out_file, open(stderr) as err_file:
            return subprocess.CompletedProcess(proc.args, proc.returncode, out_file.read(), err_file.read())
