"""Host optimizer step (full offload's CPU work) against the host's memory bandwidth.

    python benchmarks/host_optimizer.py                     # writes experiments/host_optimizer/records/<host>/<UTC time>.json
    python benchmarks/host_optimizer.py --numel 16777216 --out /tmp/x.json

For each thread count (1, half, all of this process's CPUs) it times:
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
- ``full_chunk``: the whole per-chunk host work of full offload: widen the bf16 gradient into fp32, fused AdamW,
  narrow the new weights to bf16 (28 + 6 + 6 = 40 bytes per parameter).
Each figure is the best of ``--repeats`` timed runs after one warm-up (STREAM's convention, which also keeps
other processes' load on a shared machine out of the figures as far as it can).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time
from pathlib import Path

import torch

from moe_lab.optim import numa
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


def full_chunk(numel: int):
    master = torch.nn.Parameter(torch.randn(numel))
    grad = torch.empty(numel)
    transfer = torch.randn(numel).bfloat16()
    opt = torch.optim.AdamW([master], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)

    def step():
        grad.copy_(transfer)
        master.grad = grad
        opt.step()
        transfer.copy_(master.detach())

    return step


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
    threads = [int(t) for t in args.threads.split(",")] if args.threads else sorted({1, max(1, cpus // 2), cpus})
    n = args.numel
    cases = {
        "adamw_fused": (lambda: adamw(n, fused=True), 28),
        "adamw_foreach": (lambda: adamw(n, foreach=True), 28),
        "adamw_forloop": (lambda: adamw(n, foreach=False), 28),
        "signsgd": (lambda: signsgd(n), 12),
        "full_chunk": (lambda: full_chunk(n), 40),
    }
    rows = []
    for t in threads:
        torch.set_num_threads(t)
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
        for name, (make, bytes_per_param) in cases.items():
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
        for r in rows[-len(cases) - len(bandwidth) :]:
            params = f"{r['params_per_s'] / 1e9:6.2f} Gparam/s" if "params_per_s" in r else " " * 15
            print(f"threads {t:3d}  {r['case']:14s} {params}  {r['bytes_per_s'] / 1e9:7.1f} GB/s  {100 * r['fraction_of_ceiling']:5.1f}% of ceiling")

    host = platform.node()
    record = {
        "command": "python benchmarks/host_optimizer.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **git_state(),
        "host": host,
        "cpu": cpu_model(),
        "cpus_in_affinity": cpus,
        "loadavg_1_5_15": os.getloadavg(),  # other processes competing for the same cores and memory
        "torch": torch.__version__,
        "numel": n,
        "rows": rows,
    }
    records = Path(__file__).resolve().parents[1] / "experiments" / "host_optimizer" / "records"
    out = args.out or records / re.sub(r"[^A-Za-z0-9_.-]", "_", host) / time.strftime("%Y-%m-%d_%H-%M.json", time.gmtime())
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
