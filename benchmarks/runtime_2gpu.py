"""The distributed runtime on two GPUs (issue 3, acceptance 4): a Qwen3-30B-A3B proxy (4 layers, seq 8192, batch 1
per GPU, forced balanced routing) as dp_shard 2 x ep 2 (dense weights sharded over both GPUs, experts split between
them), compile off and on, ac full and selective, as one Hydra multirun; each point a 2-rank job.

    python benchmarks/runtime_2gpu.py --steps 10 --out results/runtime_2gpu.json

Writes one JSON file: the command, date, hardware, and per point its status, s/step (median after
``trainer.timing_skip``), tokens/s/GPU, MFU (shared formula, and executed-FLOPs), peak GPU memory and losses, read
from the points' result.json files. ``--points`` narrows the sweep (a smoke run).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

from moe_lab.results.table import load

ROOT = Path(__file__).resolve().parents[1]
PROXY = [
    "model=qwen3_30b",
    "model.num_layers=4",
    "data.seq_len=8192",
    "data.batch_size=1",
    "model.routing=balanced",
    "trainer.nproc_per_node=2",
    "parallel.ep=2",
]
COLUMNS = ["trainer.compile", "ac", "status", "s_per_step", "tokens_per_s_per_gpu", "mfu", "mfu_executed", "peak_gpu_mem_gib", "first_loss", "final_loss", "error_type", "error_message"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--timing-skip", type=int, default=3, help="steps left out of s/step (compile, allocator warm-up)")
    parser.add_argument("--points", default="trainer.compile=false,true ac=full,selective", help="the swept axes")
    parser.add_argument("--sweep-dir", default="multirun/runtime_2gpu")
    parser.add_argument("--out", default="results/runtime_2gpu.json")
    args = parser.parse_args()

    command = [
        sys.executable, "-m", "moe_lab.train", "-m", *PROXY, *shlex.split(args.points),
        f"trainer.steps={args.steps}", "trainer.warmup_steps=2", f"trainer.timing_skip={args.timing_skip}",
        "trainer.skip_done=false", f"hydra.sweep.dir={args.sweep_dir}",
    ]  # fmt: skip
    started = datetime.now(timezone.utc)
    proc = subprocess.run(command, cwd=ROOT)
    table = load(ROOT / args.sweep_dir)
    records = [json.loads((Path(d) / "result.json").read_text()) for d in table["run_dir"]]
    points = table.reindex(columns=COLUMNS).astype(object).where(table.reindex(columns=COLUMNS).notna(), None)
    points = points.to_dict("records")
    for point, record in zip(points, records):
        point["losses"] = (record.get("metrics") or {}).get("losses")
    environment = next((r["environment"] for r in records if r.get("environment")), {})
    out = {
        "command": shlex.join(["python", "-m", "moe_lab.train", *command[3:]]),
        "date": started.isoformat(timespec="seconds"),
        "hardware": {k: environment.get(k) for k in ("gpu", "gpu_count", "host", "torch", "cuda")},
        "git_commit": environment.get("git_commit"),
        "sweep_exit_code": proc.returncode,
        "points": points,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2, default=str) + "\n")
    print(table.reindex(columns=COLUMNS[:8]).to_string())


if __name__ == "__main__":
    main()
