"""Run a function on N gloo ranks (CPU processes), or N NCCL ranks on N GPUs, and collect what each returns."""

from __future__ import annotations

import os
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world: int, port: int, backend: str, fn, args, queue, environ: dict, cwd: str) -> None:
    # A forkserver child starts from the server's environment and directory: take the caller's, as spawn would.
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        store = dist.TCPStore("127.0.0.1", port, is_master=False)  # the caller's, already listening
        dist.init_process_group(backend, store=store, rank=rank, world_size=world)
        queue.put((rank, "ok", fn(*args)))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def forkserver():
    """The multiprocessing context whose processes fork from one server that imported torch and moe_lab.train once
    (``set_forkserver_preload``) rather than each importing them again (seconds a process on a shared CPU). The server
    has initialized nothing (no process group, no thread pool), so each process still starts clean; it starts from the
    server's environment and directory, so callers pass on their own."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__, "moe_lab.train"])
    return ctx


def run_world(world: int, fn, *args, timeout: float = 300.0, backend: str = "gloo") -> list:
    """``fn(*args)`` on ``world`` gloo ranks (or NCCL ranks, one GPU each); returns the per-rank results in rank order. ``fn`` must be importable
    (module level) and its results picklable without shared memory — numpy arrays or plain values, not tensors (a
    tensor's shared-memory segment disappears when its rank exits); a rank's exception is re-raised here with its
    traceback."""
    # NCCL ranks start as fresh processes: nothing of CUDA may come through a fork.
    ctx = mp.get_context("spawn") if backend == "nccl" else forkserver()
    queue = ctx.Queue()
    # The world's store listens before any rank starts, on a port the system gave it (port 0): no port is chosen
    # first and bound later, which another process could take in between. It lives here until the ranks are done.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = store.port
    environ, cwd = dict(os.environ), os.getcwd()
    procs = [
        ctx.Process(target=_entry, args=(r, world, port, backend, fn, args, queue, environ, cwd)) for r in range(world)
    ]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(world):
            rank, status, value = queue.get(timeout=timeout)
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    return [results[r] for r in range(world)]
