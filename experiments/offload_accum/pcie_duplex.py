"""The PCIe bound of offload=optimizer's state traffic: host -> device alone, device -> host alone, and both at once on
two streams (the ring's loads and the new state going home overlap in backward), pinned host memory, as JSON.
Device -> host both by the copy engine and by the copy kernel offload=optimizer sends its state home with
(``moe_lab.optim.offload.host_write``, at several grid sizes), and how long a 4-byte read (``.item()``, as the
trainer's loss read) issued right after a copy home takes with each: behind the copy engine's, it waits for it.

    python experiments/offload_accum/pcie_duplex.py --gib 2 --out records/<machine>_1gpu/<UTC>_pcie.json
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from moe_lab.optim.offload.host_write import CTAS, copy_to_host


def seconds(fn, repeats: int) -> float:
    """Best of ``repeats`` timed calls after a warm-up."""
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=2.0, help="bytes per direction, GiB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    nbytes = int(args.gib * 2**30)
    host_in, host_out = (torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2))
    device_in, device_out = (torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(2))
    up, down = torch.cuda.Stream(), torch.cuda.Stream()

    def h2d():
        with torch.cuda.stream(up):
            device_in.copy_(host_in, non_blocking=True)

    def d2h():
        with torch.cuda.stream(down):
            host_out.copy_(device_out, non_blocking=True)

    def d2h_kernel(ctas: int = CTAS):
        with torch.cuda.stream(down):
            copy_to_host(host_out, device_out, ctas)

    def both():
        h2d()
        d2h()

    def both_kernel_home():
        h2d()
        d2h_kernel()

    def read_behind(copy_home) -> float:
        """Seconds a 4-byte ``.item()`` on the current stream takes, issued right after ``copy_home``."""
        torch.cuda.synchronize()
        copy_home()
        start = time.perf_counter()
        torch.ones(1, device="cuda").item()
        elapsed = time.perf_counter() - start
        torch.cuda.synchronize()
        return elapsed

    gbps = {
        "h2d_alone": nbytes / seconds(h2d, args.repeats) / 1e9,
        "d2h_alone": nbytes / seconds(d2h, args.repeats) / 1e9,
    }
    both_s = seconds(both, args.repeats)
    gbps["each_direction_duplex"] = nbytes / both_s / 1e9
    for ctas in (4, 8, 16, 32):
        gbps[f"d2h_kernel_{ctas}_ctas"] = nbytes / seconds(lambda: d2h_kernel(ctas), args.repeats) / 1e9
    gbps["each_direction_duplex_kernel_home"] = nbytes / seconds(both_kernel_home, args.repeats) / 1e9
    read_ms = {name: 1e3 * min(read_behind(fn) for _ in range(args.repeats)) for name, fn in (("copy_engine", d2h), ("kernel", d2h_kernel))}
    record = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "bytes_per_direction": nbytes,
        "gbps": {k: round(v, 1) for k, v in gbps.items()},
        "duplex_over_one_direction": round(gbps["each_direction_duplex"] / min(gbps["h2d_alone"], gbps["d2h_alone"]), 3),
        "kernel_ctas": CTAS,  # what offload=optimizer uses
        "item_ms_after_a_copy_home": {k: round(v, 3) for k, v in read_ms.items()},
    }
    text = json.dumps(record, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
