#!/usr/bin/env bash
# offload_accum's measurement, one device call (nvidia-h200, about 7-9 minutes; README.md says what it answers):
#   bash experiments/offload_accum/run.sh              a new sweep, into records/<machine>_1gpu/<UTC start>/
#   bash experiments/offload_accum/run.sh DIR          resume the sweep in DIR (its finished points are skipped)
# Twelve points, trainer.grad_accum 8, 1, 4, 2 x offload none / optimizer / full, each a directory with result.json
# and metrics.jsonl; then summary.md there (summary.py: the table and the targets, met or not).
source "$(dirname "$0")/../common.sh"
dir=${1:-$(record 1gpu)}
timeout 560 python3 -m moe_lab.train -m +experiment=offload_accum hydra.sweep.dir="$dir"
python3 "experiments/$STUDY/summary.py" "$dir" | tee "$dir/summary.md"
pack "$dir"
