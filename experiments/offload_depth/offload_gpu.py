"""Offload modes on one GPU, on a Qwen3-30B-A3B proxy (seq 4096, batch 1, balanced routing, full AC).

    python experiments/offload_depth/offload_gpu.py --phase compare --out /tmp/offload_gpu.json
    python experiments/offload_depth/offload_gpu.py --phase search --out /tmp/offload_gpu.json --budget-s 200
    bash experiments/offload_depth/run.sh          # the study's search, resumed from its latest record

``compare``: offload=none|optimizer|full side by side at ``--layers`` layers: s/step (median after the first
two steps), peak GPU memory, peak host RSS.

``search``: the largest ``model.num_layers`` that fits, per mode. Memory grows linearly with depth, so each mode's
search is a secant walk on measured points: from the two deepest fitting points of that mode (the first guess
uses the ``compare`` point and the mode's bytes per parameter) it predicts the deepest fitting proxy from GPU
memory and host memory (MemAvailable less the 5 % reserve the offload code keeps), runs it, and repeats; after a
failure it steps a quarter of the way back towards the deepest fit, until a fitting depth L and a failing L+1 are
both measured, or ``--max-points`` runs, or the time budget ends, or a point times out (unresolved; a later run
with a longer ``--point-timeout-s`` tries it again). Every point is its own ``python -m moe_lab.train`` process, so an out-of-memory point (GPU or
host) is recorded from its result.json, or as killed, and the search goes on.

Results are appended to ``--out`` after every point (JSON: environment, points, summary).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch

from moe_lab.optim.offload.host import usable_host_bytes
from moe_lab.results.record import git_state

BASE = [
    "model=qwen3_30b",
    "data.seq_len=4096",
    "data.batch_size=1",
    "model.routing=balanced",
    "ac=full",
    "trainer.device=cuda",
    "trainer.warmup_steps=1",
]
MODES = ("none", "optimizer", "full")
# GPU bytes per parameter each mode keeps for the whole step (weights, grads, state), a first guess only.
GPU_BYTES_PER_PARAM = {"none": 16, "optimizer": 8, "full": 4}  # full: the fp32 init before the bf16 cast
HOST_BYTES_PER_PARAM = {"none": 0, "optimizer": 8, "full": 12}


def params_per_layer() -> tuple[int, int]:
    """(parameters of one decoder layer, parameters outside the layers) of the 30B proxy."""
    from moe_lab.models.qwen3_moe import Qwen3MoeConfig, count_parameters

    one = count_parameters(Qwen3MoeConfig.preset("qwen3_30b", num_layers=1))[0]
    two = count_parameters(Qwen3MoeConfig.preset("qwen3_30b", num_layers=2))[0]
    return two - one, 2 * one - two


def run_point(mode: str, layers: int, steps: int, workdir: Path, timeout_s: float) -> dict:
    run_dir = workdir / f"{mode}_L{layers}_s{steps}"
    cmd = [
        sys.executable,
        "-m",
        "moe_lab.train",
        *BASE,
        f"offload={mode}",
        f"model.num_layers={layers}",
        f"trainer.steps={steps}",
        f"trainer.timing_skip={min(2, steps - 1)}",
        f"hydra.run.dir={run_dir}",
    ]
    start = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        returncode, tail = proc.returncode, (proc.stdout + proc.stderr)[-1500:]
    except subprocess.TimeoutExpired as e:
        returncode, tail = "timeout", str(e)[-500:]
    result_file = run_dir / "result.json"
    result = json.loads(result_file.read_text()) if result_file.exists() else {}
    metrics = result.get("metrics") or {}
    if returncode == "timeout":
        status = "timeout"  # neither fits nor fails: unresolved
    else:
        status = result.get("status") or ("killed" if returncode < 0 else "error")
    point = {
        "mode": mode,
        "num_layers": layers,
        "steps": steps,
        "status": status,
        "s_per_step": metrics.get("s_per_step"),
        "peak_gpu_mem_gib": metrics.get("peak_gpu_mem_gib"),
        "peak_host_rss_gib": metrics.get("peak_host_rss_gib"),
        "tokens_per_s_per_gpu": metrics.get("tokens_per_s_per_gpu"),
        "mfu": metrics.get("mfu"),
        "final_loss": metrics.get("final_loss"),
        "wall_s": round(time.time() - start, 1),
        "returncode": returncode,
        "error": None if status == "ok" else ((result.get("error") or {}).get("message") or tail)[:600],
        "command": "python -m moe_lab.train " + " ".join(cmd[3:-1]),
    }
    print(
        json.dumps(
            {
                k: point[k]
                for k in (
                    "mode",
                    "num_layers",
                    "status",
                    "s_per_step",
                    "peak_gpu_mem_gib",
                    "peak_host_rss_gib",
                    "wall_s",
                )
            }
        ),
        flush=True,
    )
    return point


def predict(mode: str, points: list[dict], per_layer: int, gpu_gib: float, host_gib: float) -> int:
    """Deepest proxy predicted to fit, from the two deepest fitting points of this mode (GPU peak and host RSS
    linear in depth), or from one point and the mode's bytes per parameter."""
    ok = sorted((p for p in points if p["mode"] == mode and p["status"] == "ok"), key=lambda p: p["num_layers"])
    last = ok[-1]
    limits = []
    for key, capacity, guess in (
        ("peak_gpu_mem_gib", gpu_gib, GPU_BYTES_PER_PARAM[mode]),
        ("peak_host_rss_gib", host_gib, HOST_BYTES_PER_PARAM[mode]),
    ):
        if len(ok) >= 2 and ok[-1]["num_layers"] > ok[-2]["num_layers"]:
            slope = (ok[-1][key] - ok[-2][key]) / (ok[-1]["num_layers"] - ok[-2]["num_layers"])
        else:
            slope = guess * per_layer / 2**30
        if slope > 0.05:
            limits.append(last["num_layers"] + math.floor((capacity - last[key]) / slope))
    return max(1, min(limits)) if limits else last["num_layers"] * 2


def outcome(point: dict) -> bool | None:
    """True: fits; False: out of memory (GPU or host) or killed; None: unresolved (timed out, other error)."""
    if point["status"] == "ok":
        return True
    if point["status"] in ("oom", "killed"):
        return False
    return None


def summarize(mode: str, points: list[dict]) -> dict:
    tried = [(p["num_layers"], outcome(p)) for p in points if p["mode"] == mode]
    fits = [l for l, ok in tried if ok]
    best = max(fits, default=None)
    first_fail = min((l for l, ok in tried if ok is False and l > (best or 0)), default=None)
    return {
        "largest_fitting_num_layers": best,
        "smallest_failing_num_layers": first_fail,
        "unresolved_num_layers": sorted(l for l, ok in tried if ok is None),
        "exact": best is not None and first_fail == best + 1,
    }


def search(mode: str, points: list[dict], per_layer: int, args, workdir: Path, deadline: float, save) -> dict:
    # Unresolved points of an earlier run (timed out) count as not tried: a longer --point-timeout-s may decide them.
    tried = {p["num_layers"]: outcome(p) for p in points if p["mode"] == mode and outcome(p) is not None}
    layers = predict(mode, points, per_layer, args.gpu_gib, args.host_gib)
    for _ in range(args.max_points):
        fits = [l for l, ok in tried.items() if ok]
        fails = [l for l, ok in tried.items() if ok is False]
        best, first_fail = max(fits, default=0), min(fails, default=None)
        if first_fail is not None and first_fail == best + 1:
            break
        if time.time() > deadline or None in tried.values():
            break  # out of time, or a point too slow to decide within --point-timeout-s
        layers = min(max(layers, best + 1), first_fail - 1) if first_fail is not None else max(layers, best + 1)
        point = run_point(mode, layers, args.search_steps, workdir, args.point_timeout_s)
        points.append(point)
        save()
        tried[layers] = outcome(point)
        if point["status"] == "ok":
            layers = predict(mode, points, per_layer, args.gpu_gib, args.host_gib)
        else:  # a quarter of the way back to the deepest fit: failures are cheap, fits cost a full run
            layers -= max(1, (layers - max(fits, default=0)) // 4)
    return summarize(mode, points)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--phase",
        choices=["compare", "search", "both", "summarize"],
        default="both",
        help="summarize: recompute each mode's search summary from the points already in --out",
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=4, help="depth of the side-by-side comparison")
    parser.add_argument("--compare-steps", type=int, default=4)
    parser.add_argument(
        "--search-steps", type=int, default=2, help="two steps: the optimizer state exists from step 1 on"
    )
    parser.add_argument("--max-points", type=int, default=4, help="runs per mode in the search")
    parser.add_argument("--budget-s", type=float, default=240.0, help="no new search point starts after this")
    parser.add_argument("--point-timeout-s", type=float, default=240.0)
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args()
    if args.phase == "summarize":
        record = json.loads(args.out.read_text())
        record["search"] = {mode: summarize(mode, record["points"]) for mode in record["search"]}
        args.out.write_text(json.dumps(record, indent=2) + "\n")
        print(json.dumps(record["search"], indent=2))
        return
    start = time.time()
    free, total = torch.cuda.mem_get_info(0)
    args.gpu_gib = total / 2**30
    args.host_gib = usable_host_bytes() / 2**30
    per_layer, outside = params_per_layer()

    record = json.loads(args.out.read_text()) if args.out.exists() else {"points": [], "search": {}, "environment": {}}
    record["environment"][args.phase] = {
        "gpu": torch.cuda.get_device_name(0),
        "gpu_total_gib": args.gpu_gib,
        "host_mem_available_gib": args.host_gib,
        "host_mem_total_gib": psutil.virtual_memory().total / 2**30,
        "cpus": len(os.sched_getaffinity(0)),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **git_state(),
        "command": "python experiments/offload_depth/offload_gpu.py " + " ".join(sys.argv[1:]),
        "base_overrides": BASE,
        "params_per_layer": per_layer,
        "params_outside_layers": outside,
    }
    points = record["points"]

    def save():
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2) + "\n")

    workdir = Path(tempfile.mkdtemp(prefix="offload_gpu_"))
    modes = args.modes.split(",")
    if args.phase in ("compare", "both"):
        for mode in modes:
            points.append(run_point(mode, args.layers, args.compare_steps, workdir, args.point_timeout_s))
            save()
    if args.phase in ("search", "both"):
        deadline = start + args.budget_s
        for mode in modes:
            record["search"][mode] = search(mode, points, per_layer, args, workdir, deadline, save)
            save()
            print(mode, record["search"][mode], flush=True)


if __name__ == "__main__":
    main()
