#!/usr/bin/env bash
# grid_30b's runs, one part per call (each fits a 10-minute device call; README.md says what they answer):
#   bash experiments/grid_30b/run.sh one_gpu   the whole grid, dispatcher x ac x offload, on one GPU
#   bash experiments/grid_30b/run.sh two_gpu   dispatcher x ac (none too) at offload=none on 2 GPUs (dp_shard 2 x ep 2)
#   bash experiments/grid_30b/run.sh seq8192   two_gpu at seq 8192
# Overrides after the part narrow the sweep (one point to check a change's speed):
#   bash experiments/grid_30b/run.sh one_gpu dispatcher=fused ac=selective offload=none
# Records: records/<machine>_1gpu|2gpu|2gpu_seq8192/<UTC start>/, one directory per point (see ../common.sh).
source "$(dirname "$0")/../common.sh"
case "${1:-}" in
one_gpu) dir=$(record 1gpu) && timeout -k 30 490 python3 -m moe_lab.train -m +experiment=grid_30b hydra.sweep.dir="$dir" "${@:2}" ;;
two_gpu) dir=$(record 2gpu) && timeout -k 30 400 python3 -m moe_lab.train -m +experiment=grid_30b/two_gpu hydra.sweep.dir="$dir" "${@:2}" ;;
seq8192) dir=$(record 2gpu_seq8192) && timeout -k 30 320 python3 -m moe_lab.train -m +experiment=grid_30b/seq8192 hydra.sweep.dir="$dir" "${@:2}" ;;
*) echo "usage: $0 one_gpu|two_gpu|seq8192" >&2; exit 2 ;;
esac
pack "$dir"
