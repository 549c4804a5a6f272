#!/usr/bin/env bash
# offload_accum's measurement, one device call (nvidia-h200, about 7-9 minutes; README.md says what it answers):
#   bash experiments/offload_accum/run.sh
# Twelve points, offload none / optimizer / full x trainer.grad_accum 8, 1, 4, 2, each a directory with result.json
# and metrics.jsonl under records/<machine>_1gpu/<UTC start>/; then the summary (summary.py) of what is there.
source "$(dirname "$0")/../common.sh"
dir=$(record 1gpu)
timeout 560 python3 -m moe_lab.train -m +experiment=offload_accum hydra.sweep.dir="$dir"
python3 "experiments/$STUDY/summary.py" "$dir" | tee "$dir/summary.md"
pack "$dir"
