"""The PCIe bound of offload=optimizer's state traffic: host -> device alone, device -> host alone, and both at once on
two streams (the ring's loads and the new state going home overlap in backward), pinned host memory; and how long a
4-byte read to the host takes issued right after a copy home on another stream, by the copy engine (``.item()``)
and by ``moe_lab.runtime.host_read.to_host``'s kernel, as JSON.

    python experiments/offload_accum/pcie_duplex.py --gib 2 --out records/<machine>_1gpu/<UTC>_pcie.json
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from moe_lab.runtime.host_read import to_host


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

    def both():
        h2d()
        d2h()

    gbps = {
        "h2d_alone": nbytes / seconds(h2d, args.repeats) / 1e9,
        "d2h_alone": nbytes / seconds(d2h, args.repeats) / 1e9,
    }
    both_s = seconds(both, args.repeats)
    gbps["each_direction_duplex"] = nbytes / both_s / 1e9

    def read_behind_copy_home(read) -> float:
        """Seconds ``read`` of a 4-byte device tensor takes, issued right after a copy home starts."""
        value = torch.ones(1, device="cuda")
        torch.cuda.synchronize()
        d2h()
        start = time.perf_counter()
        read(value)
        elapsed = time.perf_counter() - start
        torch.cuda.synchronize()
        return elapsed

    readers = {"copy_engine": lambda t: t.item(), "to_host": lambda t: to_host(t).item()}
    for read in readers.values():
        read(torch.ones(1, device="cuda"))  # to_host's kernel compiles at its first call
    read_ms = {
        name: 1e3 * sorted(read_behind_copy_home(read) for _ in range(args.repeats))[args.repeats // 2]
        for name, read in readers.items()
    }
    record = {
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%MZ"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "bytes_per_direction": nbytes,
        "gbps": {k: round(v, 1) for k, v in gbps.items()},
        "duplex_over_one_direction": round(
            gbps["each_direction_duplex"] / min(gbps["h2d_alone"], gbps["d2h_alone"]), 3
        ),
        "read_ms_behind_a_copy_home": {name: round(ms, 3) for name, ms in read_ms.items()},  # median
    }
    text = json.dumps(record, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
