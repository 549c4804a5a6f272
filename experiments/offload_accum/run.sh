#!/usr/bin/env bash
# offload_accum's measurement, one device call (nvidia-h200, about 7-9 minutes; README.md says what it answers):
#   bash experiments/offload_accum/run.sh              a new sweep, into records/<machine>_1gpu/<UTC start>/
#   bash experiments/offload_accum/run.sh DIR          resume the sweep in DIR (its finished points are skipped)
#   bash experiments/offload_accum/run.sh device_share offload=full's device share: its GPU tests, then
#                                                      offload.device_share 0.3 and 0.5 beside none at 8 micro-batches,
#                                                      into records/<machine>_1gpu/<UTC start>_device_share/ (about 4 minutes)
# Twelve points, trainer.grad_accum 8, 1, 4, 2 x offload none / optimizer / full, each a directory with result.json
# and metrics.jsonl; then summary.md there (summary.py: the table and the targets, met or not).
source "$(dirname "$0")/../common.sh"
if [ "${1:-}" = device_share ]; then
  dir=$(record 1gpu)_device_share
  mkdir -p "$dir"
  timeout 200 python3 -m pytest -m gpu tests/test_offload.py -q -p no:cacheprovider 2>&1 | tail -5 | tee "$dir/gpu_tests.log"
  timeout 240 python3 -m moe_lab.train -m +experiment=offload_accum trainer.grad_accum=8 offload=full \
    offload.device_share=0.3,0.5 hydra.sweep.dir="$dir"
  timeout 90 python3 -m moe_lab.train +experiment=offload_accum trainer.grad_accum=8 offload=none hydra.run.dir="$dir/none"
  pack "$dir"
  exit
fi
dir=${1:-$(record 1gpu)}
timeout 560 python3 -m moe_lab.train -m +experiment=offload_accum hydra.sweep.dir="$dir"
python3 "experiments/$STUDY/summary.py" "$dir" | tee "$dir/summary.md"
pack "$dir"
