#!/usr/bin/env bash
# The planner's committed plans (python -m moe_lab.plan: no GPU, a few seconds a point), one record per point:
#   bash experiments/plan/run.sh grid        grid_30b's presets on one and two H200s (what the GPU sittings measure)
#   bash experiments/plan/run.sh reference   the published Qwen3-235B-A22B layout: 4 nodes x 8 B300, FSDP 32 x EP 8
# Records: records/<hardware>_<gpus>gpu/<UTC start>/ (kind: plan; moe_lab.results.load and the notebook read them).
set -euo pipefail
cd "$(dirname "$0")/../.."
STAMP=$(date -u +%Y-%m-%d_%H-%M)
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
*) echo "usage: $0 grid|reference" >&2; exit 2 ;;
esac
