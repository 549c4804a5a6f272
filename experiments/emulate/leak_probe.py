"""What an emulated rank holds at its peak, tensor by tensor (issue 43: the torch dispatcher under compiled full AC at
EP > 1 held 18 GiB more than planned on reference_30b's rank 0 of 8).

One training job (``python -m moe_lab.train`` in this process, its record in RUN_DIR) under the CUDA caching
allocator's history (``torch.cuda.memory._record_memory_history``); then the allocations live at the peak, largest
first, each with the Python frames that made it (an Inductor kernel's line of generated code included), beside the
job's measured and planned peak. ``--ac plain`` wraps each block in plain ``torch.utils.checkpoint`` as ac=full did
before the fix (on torch 2.11 it kept every block's routed rows); ``--ac option`` runs ac=full as it is now.

    python experiments/emulate/leak_probe.py --ac plain|option RUN_DIR [key=value ...]

Writes RUN_DIR/leak_probe.json (and the job's own result.json, metrics.jsonl and train.log there).
"""

from __future__ import annotations

import argparse
import collections
import json
import linecache
import sys
from pathlib import Path

import torch

TOP = 24  # allocations listed at the peak
FRAMES = 8  # frames kept per allocation: moe_lab's, torch's autograd and checkpoint code, Inductor's generated code
KEPT_FRAMES = ("moe_lab", "torchinductor", "checkpoint", "autograd", "_functorch", "_inductor")


def plain_full_checkpoint(self, model, saved_ops=None) -> None:
    """ac=full before issue 43's fix: plain non-reentrant checkpoint of each block, no policy."""
    from moe_lab.parallel import ac

    for layer in ac._layers(model):
        ac._wrap(layer)


def frames_of(frames: list[dict]) -> list[str]:
    """The frames that say where an allocation comes from, innermost first, each ``file:line name``, with the source
    line of generated (Inductor) code."""
    out = []
    for f in frames:
        name = f.get("filename", "")
        if not any(k in name for k in KEPT_FRAMES):
            continue
        where = f"{name}:{f.get('line')} {f.get('name')}"
        if "torchinductor" in name:
            where += " | " + linecache.getline(name, f.get("line", 0)).strip()
        out.append(where)
        if len(out) == FRAMES:
            break
    return out


def live_at_peak(snapshot: dict, device: int = 0) -> tuple[int, list[dict], int]:
    """The most bytes allocated at once over the recorded history, the allocations live then (size and the frames of
    the allocation), and how many events the history holds. Walks the trace backwards from the allocator's state at
    the snapshot, so a history whose oldest events were dropped (``max_entries``) still gives the state at every
    event it kept."""
    live, frames = {}, {}
    for segment in snapshot["segments"]:
        if segment["device"] != device:
            continue
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                live[block["address"]] = block["size"]
                frames[block["address"]] = block.get("frames", [])
    trace = snapshot["device_traces"][device]
    total = sum(live.values())
    peak, peak_at = total, len(trace)  # the state before event peak_at
    for i in range(len(trace) - 1, -1, -1):
        e = trace[i]
        if e["action"] == "alloc":
            total -= e["size"]
        elif e["action"] == "free_completed":
            total += e["size"]
        if total > peak:
            peak, peak_at = total, i
    for e in reversed(trace[peak_at:]):  # back to the state at the peak
        if e["action"] == "alloc":
            live.pop(e["addr"], None)
        elif e["action"] == "free_completed":
            live[e["addr"]] = e["size"]
    for e in trace[:peak_at]:  # where each allocation live at the peak was made: its latest alloc before it
        if e["action"] == "alloc":
            frames[e["addr"]] = e.get("frames", [])
    blocks = [{"size": size, "frames": frames.get(addr, [])} for addr, size in live.items()]
    return peak, sorted(blocks, key=lambda b: -b["size"]), len(trace)


def run_job(run_dir: Path, overrides: list[str]) -> dict | None:
    """The training job in this process (as ``python -m moe_lab.train``); its record, or None if it left none."""
    from moe_lab import train

    sys.argv = ["moe_lab.train", f"hydra.run.dir={run_dir}", *overrides]
    try:
        train.main()
    except SystemExit as e:  # a failed point (out of memory, say) still leaves its record and its history
        print(f"the job exited with {e.code}", file=sys.stderr)
    result = run_dir / "result.json"
    return json.loads(result.read_text()) if result.exists() else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ac", choices=("plain", "option"), required=True)
    parser.add_argument("--max-entries", type=int, default=2_000_000)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.ac == "plain":
        from moe_lab.parallel.ac import FullCheckpoint

        FullCheckpoint.apply = plain_full_checkpoint
    torch.cuda.memory._record_memory_history(
        enabled="all", context="alloc", stacks="python", max_entries=args.max_entries
    )
    record = run_job(args.run_dir, args.overrides)
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)

    peak, live, events = live_at_peak(snapshot)
    metrics = (record or {}).get("metrics", {})
    measured, planned = metrics.get("peak_gpu_mem_gib"), metrics.get("planned_peak_gpu_mem_gib")
    sizes = collections.Counter(b["size"] for b in live)
    out = {
        "ac": args.ac,
        "overrides": args.overrides,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
        "status": (record or {}).get("status"),
        "s_per_step": metrics.get("s_per_step"),
        "planned_compute_s": metrics.get("planned_compute_s"),
        "peak_gpu_mem_gib": measured,
        "planned_peak_gpu_mem_gib": planned,
        "measured_over_planned": measured / planned - 1 if measured and planned else None,
        "history": {"events": events, "max_entries": args.max_entries, "peak_gib": peak / 2**30},
        # Same-sized allocations live at the peak, most bytes first: one per layer stands out as a count of layers.
        "live_at_peak_by_size": [
            {"size_mib": size / 2**20, "count": n, "gib": size * n / 2**30}
            for size, n in sorted(sizes.items(), key=lambda kv: -kv[0] * kv[1])[:TOP]
        ],
        "largest_live_at_peak": [{"size_mib": b["size"] / 2**20, "frames": frames_of(b["frames"])} for b in live[:TOP]],
    }
    path = args.run_dir / "leak_probe.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(
        f"leak_probe --ac {args.ac}: peak {measured} GiB measured, {planned} GiB planned, {out['s_per_step']} s/step; "
        f"history peak {peak / 2**30:.2f} GiB; {path}"
    )
    for row in out["live_at_peak_by_size"][:8]:
        print(f"  {row['count']:4d} x {row['size_mib']:10.1f} MiB = {row['gib']:6.2f} GiB")


if __name__ == "__main__":
    main()
