"""offload_accum's points as a markdown table, and the issue's targets against them.

    python experiments/offload_accum/summary.py experiments/offload_accum/records/<machine>_1gpu/<UTC start>

One row per point (trainer.grad_accum x offload): status, s/step, its ratio to offload=none at the same
accumulation, tokens/s/GPU and MFU (both counting every micro-batch), the profiled step's exposed host step and
exposed PCIe traffic (``host_step`` / ``pcie`` of the trace breakdown: compute-stream time spent waiting on them),
peak GPU and host memory. The standard library only, so it runs wherever the sweep ran.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TARGETS = {"full": 1.25, "optimizer": 1.15}  # at 8 micro-batches, s/step over offload=none's


def points(sweep_dir: Path) -> dict[tuple[int, str], dict]:
    out = {}
    for path in sorted(sweep_dir.glob("*/result.json")):
        result = json.loads(path.read_text())
        config = result["config"]
        mode = config["offload"]["_target_"].rsplit(".", 1)[-1].removesuffix("Offload").lower()
        mode = {"no": "none"}.get(mode, mode)
        out[(config["trainer"]["grad_accum"], mode)] = result | {"path": str(path)}
    return out


def ms(x) -> str:
    return "" if x is None else f"{1e3 * x:.1f}"


def main() -> None:
    found = points(Path(sys.argv[1]))
    header = ["grad_accum", "offload", "status", "s/step", "vs none", "tokens/s/GPU", "MFU", "exposed host step ms",
              "exposed PCIe ms", "peak GPU GiB", "peak host GiB"]  # fmt: skip
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    ratios = {}
    for (accum, mode), r in sorted(found.items(), key=lambda kv: (kv[0][0], ["none", "optimizer", "full"].index(kv[0][1]))):
        m = r.get("metrics") or {}
        seconds = ((m.get("trace_breakdown") or {}).get("seconds")) or {}
        base = (found.get((accum, "none"), {}).get("metrics") or {}).get("s_per_step")
        ratio = m["s_per_step"] / base if r["status"] == "ok" and base else None
        ratios[(accum, mode)] = ratio
        row = [accum, mode, r["status"], f"{m['s_per_step']:.3f}" if "s_per_step" in m else "",
               f"{ratio:.2f}x" if ratio else "", f"{m['tokens_per_s_per_gpu']:,.0f}" if "tokens_per_s_per_gpu" in m else "",
               f"{100 * m['mfu']:.1f} %" if m.get("mfu") else "", ms(seconds.get("host_step")), ms(seconds.get("pcie")),
               f"{m['peak_gpu_mem_gib']:.1f}" if m.get("peak_gpu_mem_gib") else "",
               f"{m['peak_host_rss_gib']:.1f}" if m.get("peak_host_rss_gib") else ""]  # fmt: skip
        print("| " + " | ".join(str(c) for c in row) + " |")
    print()
    for mode, target in TARGETS.items():
        ratio = ratios.get((8, mode))
        verdict = "not measured" if ratio is None else f"{ratio:.2f}x: {'met' if ratio <= target else 'not met'}"
        print(f"- offload={mode} at 8 micro-batches, target <= {target}x none: {verdict}")


if __name__ == "__main__":
    main()
