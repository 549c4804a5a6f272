"""Host optimizer step (full offload's CPU work) against the host's memory bandwidth.

    python experiments/host_optimizer/host_optimizer.py                     # writes experiments/host_optimizer/records/<host>/<UTC time>.json
    python experiments/host_optimizer/host_optimizer.py --numel 16777216 --out /tmp/x.json

For each thread count (1, half, all but one, all of this process's CPUs) it times:
- the bandwidth ceiling: the best of two in-place streaming kernels over large fp32 tensors, ``a.mul_(s)``
  (8 bytes per element) and ``a.add_(b)`` (12 bytes per element). In-place, like the optimizer: a kernel that
  writes a fresh output also reads each output line before writing it (write-allocate), traffic its byte count
  would not show, so a plain copy understates the ceiling (``copy`` is listed, at 8 bytes per element, for
  reference);
- ``adamw_fused`` / ``adamw_foreach`` / ``adamw_forloop``: one torch AdamW step on a flat fp32 tensor (fused is the
  kernel full offload uses). Traffic: read param, grad, exp_avg, exp_avg_sq; write param, exp_avg, exp_avg_sq =
  28 bytes per parameter for the fused kernel (the unfused ones make more passes, but are charged the same bytes,
  so their bytes/s is what the useful traffic achieves);
- ``signsgd``: this project's SignSGD, 12 bytes per parameter (read param, grad; write param);
- ``full_chunk_adamw`` / ``full_chunk_signsgd``: the whole per-chunk host work of full offload as it runs
  (``moe_lab.optim.offload.host_step``: one call of its C kernel, ``host_kernel.c``, which reads the bf16 gradient,
  steps the fp32 master and state and writes the bf16 weights in one pass, with the GIL released). Charged the
  traffic the work cannot avoid: the optimizer's own plus reading the bf16 gradient and writing the bf16 weights
  (AdamW 32, SignSGD 16 bytes per parameter);
- ``full_chunk_adamw_beside_busy_thread``: ``full_chunk_adamw`` while another thread of the process keeps a CPU busy
  the way the training thread does during backward (small torch ops, Python in between). In a training step the
  host step shares the rank's CPUs with that thread: with as many host threads as CPUs, each of the step's
  parallel regions waits for the thread that lost its CPU to the training thread, so compare this row at ``all``
  threads with ``all - 1`` (offload=full's default leaves one CPU to the training thread);
- ``full_chunk_adamw_beside_python_thread``: the same beside a thread that runs pure Python, holding the GIL, which
  the host step needs only to start and to return (the kernel's call releases it); at the switch interval
  offload=full's worker sets while it steps (``host_step.prompt_gil_handover``), and ``..._default_switch`` at
  Python's default (5 ms).
Each figure is the best of ``--repeats`` timed runs after one warm-up (STREAM's convention, which also keeps
other processes' load on a shared machine out of the figures as far as it can).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import re
import sys
import threading
import time
from pathlib import Path

import torch

from moe_lab.optim.offload import host_kernel, numa
from moe_lab.optim.offload.host_step import host_optimizer, prompt_gil_handover
from moe_lab.optim.optimizers import SignSGD
from moe_lab.results.record import git_state


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
        return re.search(r"model name\s*:\s*(.*)", text).group(1).strip()
    except (OSError, AttributeError):
        return platform.processor()


def adamw(numel: int, **kwargs):
    p = torch.nn.Parameter(torch.randn(numel))
    p.grad = torch.randn(numel)
    opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, **kwargs)
    return opt.step


def signsgd(numel: int):
    p = torch.nn.Parameter(torch.randn(numel))
    p.grad = torch.randn(numel)
    return SignSGD([p], lr=1e-4, weight_decay=0.1).step


def full_chunk(numel: int, make_optimizer):
    """offload=full's host work on one chunk of ``numel`` parameters (bf16 gradient in, bf16 weights out)."""
    optimizer = host_optimizer(make_optimizer, [torch.nn.Parameter(torch.randn(numel))])
    transfer = torch.randn(numel).bfloat16()
    return lambda: optimizer.step(transfer=transfer)


ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)


class BusyThread:
    """Context manager: a thread that keeps one CPU busy as a training thread does while backward runs (small torch
    ops, Python in between), or with ``python_only`` in Python alone, holding the GIL but for Python's switches."""

    def __init__(self, python_only: bool = False):
        self.python_only = python_only

    def __enter__(self):
        self.stop = threading.Event()

        def loop():
            x = torch.zeros(16)
            while not self.stop.is_set():
                if not self.python_only:
                    x.add_(1.0)
                sum(range(100))

        self.thread = threading.Thread(target=loop, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=64 * 2**20, help="parameters per step (default 64Mi)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--threads", default=None, help="comma-separated thread counts (default: 1, half, all CPUs)")
    parser.add_argument("--gpu-node", action="store_true", help="bind to GPU 0's NUMA node first, as offload=full does")
    args = parser.parse_args()
    if args.gpu_node:
        address = numa.pci_address(0)
        cpus = numa.rank_cpus(address, [address])
        if cpus:
            numa.bind_threads(cpus)

    cpus = len(os.sched_getaffinity(0))
    # all - 1: offload=full's default (one CPU left to the training thread)
    threads = (
        [int(t) for t in args.threads.split(",")]
        if args.threads
        else sorted({1, max(1, cpus // 2), max(1, cpus - 1), cpus})
    )
    n = args.numel
    rows = []
    for t in threads:
        torch.set_num_threads(t)
        cases = {
            "adamw_fused": (lambda: adamw(n, fused=True), 28),
            "adamw_foreach": (lambda: adamw(n, foreach=True), 28),
            "adamw_forloop": (lambda: adamw(n, foreach=False), 28),
            "signsgd": (lambda: signsgd(n), 12),
            "full_chunk_adamw": (lambda: full_chunk(n, ADAMW), 32),
            "full_chunk_signsgd": (lambda: full_chunk(n, functools.partial(SignSGD, lr=1e-4, weight_decay=0.1)), 16),
        }
        chunk = lambda: full_chunk(n, ADAMW)  # noqa: E731
        beside = {  # name: (make, bytes per parameter, the other thread, switch interval while it runs)
            "full_chunk_adamw_beside_busy_thread": (chunk, 32, BusyThread, prompt_gil_handover),
            "full_chunk_adamw_beside_python_thread": (
                chunk,
                32,
                functools.partial(BusyThread, python_only=True),
                prompt_gil_handover,
            ),
            "full_chunk_adamw_beside_python_thread_default_switch": (
                chunk,
                32,
                functools.partial(BusyThread, python_only=True),
                contextlib.nullcontext,
            ),
        }
        a, b, c = torch.randn(n), torch.randn(n), torch.zeros(n)
        bandwidth = {
            "scale_inplace": 8 * n / timed(lambda: a.mul_(1.0000001), args.repeats),
            "add_inplace": 12 * n / timed(lambda: a.add_(b, alpha=1e-7), args.repeats),
            "copy": 8 * n / timed(lambda: c.copy_(b), args.repeats),
        }
        del a, b, c
        ceiling = max(bandwidth["scale_inplace"], bandwidth["add_inplace"])
        for name, rate in bandwidth.items():
            rows.append({"threads": t, "case": name, "bytes_per_s": rate, "fraction_of_ceiling": rate / ceiling})
        for name, (make, bytes_per_param, *beside_what) in (cases | beside).items():
            other, switch = beside_what or (contextlib.nullcontext, contextlib.nullcontext)
            with other(), switch():
                seconds = timed(make(), args.repeats)
            rate = bytes_per_param * n / seconds
            rows.append(
                {
                    "threads": t,
                    "case": name,
                    "seconds": seconds,
                    "params_per_s": n / seconds,
                    "bytes_per_param": bytes_per_param,
                    "bytes_per_s": rate,
                    "fraction_of_ceiling": rate / ceiling,
                }
            )
        for r in rows[-len(cases) - len(beside) - len(bandwidth) :]:
            params = f"{r['params_per_s'] / 1e9:6.2f} Gparam/s" if "params_per_s" in r else " " * 15
            print(
                f"threads {t:3d}  {r['case']:36s} {params}  {r['bytes_per_s'] / 1e9:7.1f} GB/s  {100 * r['fraction_of_ceiling']:5.1f}% of ceiling"
            )

    host = platform.node()
    record = {
        "command": "python experiments/host_optimizer/host_optimizer.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **git_state(),
        "host": host,
        "cpu": cpu_model(),
        "cpus_in_affinity": cpus,
        "loadavg_1_5_15": os.getloadavg(),  # other processes competing for the same cores and memory
        "torch": torch.__version__,
        "numel": n,
        "host_kernel": host_kernel.build_info(),
        "rows": rows,
    }
    records = Path(__file__).resolve().parents[1] / "experiments" / "host_optimizer" / "records"
    out = args.out or records / re.sub(r"[^A-Za-z0-9_.-]", "_", host) / time.strftime(
        "%Y-%m-%d_%H-%M.json", time.gmtime()
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
