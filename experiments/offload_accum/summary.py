"""offload_accum's points as a markdown table, the issue's targets against them, and the crossover.

    python experiments/offload_accum/summary.py experiments/offload_accum/records/<machine>_1gpu/<UTC start>

One row per point (trainer.grad_accum x offload): status, s/step, its ratio to offload=none at the same
accumulation, tokens/s/GPU and MFU (both counting every micro-batch), the profiled step's exposed host step and
exposed PCIe traffic (``host_step`` / ``pcie`` of the trace breakdown: compute-stream time spent waiting on them),
offload=full's host step inside the training step (median over the timed steps of metrics.jsonl: its rate, and how
long ``step()`` waited for it after backward), peak GPU and host memory.

The crossover: an offload mode costs about a fixed time per optimizer step over offload=none (its state traffic or
host step), so its ratio to none falls as 1 + extra / (A x none's time per micro-batch). For each mode: its extra
seconds per step at each accumulation, the fewest micro-batches measured that meet the target, and the fewest the
fixed-cost model predicts from the point with the most micro-batches. The standard library only, so it runs
wherever the sweep ran.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

TARGETS = {"full": 1.25, "optimizer": 1.15}  # at 8 micro-batches, s/step over offload=none's
MODES = ["none", "optimizer", "full"]


def point_metrics_rows(point_dir: Path, skip: int) -> list[dict]:
    """The timed steps' rows of a point's metrics.jsonl (none where it has no file)."""
    path = point_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("step", 0) >= skip]


def points(sweep_dir: Path) -> dict[tuple[int, str], dict]:
    out = {}
    for path in sorted(sweep_dir.glob("*/result.json")):
        result = json.loads(path.read_text())
        config = result["config"]
        mode = config["offload"]["_target_"].rsplit(".", 1)[-1].removesuffix("Offload").lower()
        mode = {"no": "none"}.get(mode, mode)
        rows = point_metrics_rows(path.parent, config["trainer"].get("timing_skip", 0))
        out[(config["trainer"]["grad_accum"], mode)] = result | {"path": str(path), "rows": rows}
    return out


def median_of(rows: list[dict], key: str):
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def ms(x) -> str:
    return "" if x is None else f"{1e3 * x:.1f}"


def s_per_step(found: dict, accum: int, mode: str):
    r = found.get((accum, mode))
    return (r.get("metrics") or {}).get("s_per_step") if r and r["status"] == "ok" else None


def main() -> None:
    found = points(Path(sys.argv[1]))
    header = [
        "grad_accum",
        "offload",
        "status",
        "s/step",
        "vs none",
        "tokens/s/GPU",
        "MFU",
        "exposed host step ms",
        "exposed PCIe ms",
        "host step G params/s",
        "host wait ms",
        "peak GPU GiB",
        "peak host GiB",
    ]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    ratios = {}
    for (accum, mode), r in sorted(found.items(), key=lambda kv: (kv[0][0], MODES.index(kv[0][1]))):
        m = r.get("metrics") or {}
        seconds = ((m.get("trace_breakdown") or {}).get("seconds")) or {}
        base = s_per_step(found, accum, "none")
        ratio = m["s_per_step"] / base if r["status"] == "ok" and base else None
        ratios[(accum, mode)] = ratio
        rate = median_of(r["rows"], "host_step_gparams_per_s")
        row = [
            accum,
            mode,
            r["status"],
            f"{m['s_per_step']:.3f}" if "s_per_step" in m else "",
            f"{ratio:.2f}x" if ratio else "",
            f"{m['tokens_per_s_per_gpu']:,.0f}" if "tokens_per_s_per_gpu" in m else "",
            f"{100 * m['mfu']:.1f} %" if m.get("mfu") else "",
            ms(seconds.get("host_step")),
            ms(seconds.get("pcie")),
            f"{rate:.2f}" if rate else "",
            ms(median_of(r["rows"], "host_wait_s")),
            f"{m['peak_gpu_mem_gib']:.1f}" if m.get("peak_gpu_mem_gib") else "",
            f"{m['peak_host_rss_gib']:.1f}" if m.get("peak_host_rss_gib") else "",
        ]
        print("| " + " | ".join(str(c) for c in row) + " |")
    print()
    for mode, target in TARGETS.items():
        ratio = ratios.get((8, mode))
        verdict = "not measured" if ratio is None else f"{ratio:.2f}x: {'met' if ratio <= target else 'not met'}"
        print(f"- offload={mode} at 8 micro-batches, target <= {target}x none: {verdict}")
    print()
    for mode, target in TARGETS.items():
        print(f"- offload={mode}: {crossover(found, ratios, mode, target)}")
    print()
    for mode in TARGETS:
        print(f"- offload={mode}: {loss_agreement(found, mode)}")


def loss_agreement(found: dict, mode: str) -> str:
    """The largest difference of its per-step losses from offload=none's at each accumulation. offload=optimizer
    does none's arithmetic (bf16 compute, fp32 AdamW), so only kernel nondeterminism separates them; a state or
    weight read before its copy or step finished shows as a loss curve that leaves none's."""
    parts = []
    for accum in sorted(a for (a, m) in found if m == mode):
        mine = (found[(accum, mode)].get("metrics") or {}).get("losses")
        none = (found.get((accum, "none"), {}).get("metrics") or {}).get("losses")
        if mine and none:
            steps = min(len(mine), len(none))
            parts.append(
                f"{max(abs(a - b) for a, b in zip(mine[:steps], none[:steps])):.4f} at {accum} ({steps} steps)"
            )
    return (
        "largest |loss - none's| " + ", ".join(parts) if parts else "losses not comparable (none's or its own missing)"
    )


def crossover(found: dict, ratios: dict, mode: str, target: float) -> str:
    """Its extra seconds per step over none at each accumulation, and where it meets ``target``: measured, and by
    the fixed-cost model from the point with the most micro-batches."""
    accums = sorted(a for (a, m) in found if m == mode and s_per_step(found, a, mode) and s_per_step(found, a, "none"))
    if not accums:
        return "not measured"
    extra = {a: s_per_step(found, a, mode) - s_per_step(found, a, "none") for a in accums}
    text = "extra s/step over none " + ", ".join(f"{extra[a]:.3f} at {a}" for a in accums)
    met = [a for a in accums if ratios[(a, mode)] <= target]
    text += (
        f"; meets <= {target}x from {met[0]} micro-batches on (measured)"
        if met
        else f"; no measured point meets <= {target}x"
    )
    most = accums[-1]
    per_micro_batch = s_per_step(found, most, "none") / most
    needed = extra[most] / ((target - 1) * per_micro_batch)
    return text + (
        f"; the fixed-cost model ({extra[most]:.3f} s per step, none's {per_micro_batch:.3f} s per micro-batch) needs "
        f"{max(1, math.ceil(needed))} micro-batches"
    )


if __name__ == "__main__":
    main()
