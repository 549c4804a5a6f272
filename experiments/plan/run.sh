#!/usr/bin/env bash
# The planner's committed plans (python -m moe_lab.plan: no GPU, a few seconds a point), one record per point, and
# the calibration of a GPU machine's rates:
#   bash experiments/plan/run.sh grid        grid_30b's presets on one and two H200s (what the GPU sittings measure)
#   bash experiments/plan/run.sh reference   the published Qwen3-235B-A22B layout: 4 nodes x 8 B300, FSDP 32 x EP 8
#   bash experiments/plan/run.sh calibrate   on a GPU machine: python -m moe_lab.plan.calibrate (under torchrun on
#                                            every GPU when there are several: the all-to-all too)
# Records: records/<hardware>_<gpus>gpu/<UTC start>/ (kind: plan; moe_lab.results.load and the notebook read them);
# a calibration: records/<machine>_<gpus>gpu/<UTC start>_profile.yaml (plan with hardware=<that file>).
source "$(dirname "$0")/../common.sh"
set -e
plan() {  # plan LABEL OVERRIDES...
  python3 -m moe_lab.plan -m hydra.sweep.dir="experiments/plan/records/$1/$STAMP" "${@:2}"
}
case "${1:-}" in
grid)
  plan h200_1gpu +experiment=grid_30b
  plan h200_2gpu +experiment=grid_30b/two_gpu ;;
reference)
  plan b300_32gpu +experiment=reference_235b hardware=b300 hardware.nodes=4 hardware.gpus_per_node=8 \
    dispatcher=torch,fused ac=full,selective ;;
calibrate)
  gpus=$(nvidia-smi -L | wc -l)
  profile=$(record "${gpus}gpu")_profile.yaml
  if [ "$gpus" -gt 1 ]; then
    timeout 300 torchrun --standalone --nproc-per-node "$gpus" -m moe_lab.plan.calibrate --out "$profile"
  else
    timeout 300 python3 -m moe_lab.plan.calibrate --out "$profile"
  fi
  pack "$profile" ;;
*) echo "usage: $0 grid|reference|calibrate" >&2; exit 2 ;;
esac
