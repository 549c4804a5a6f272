#!/usr/bin/env bash
# One sitting of the studies behind docs/performance.md on a two-GPU H200 machine, in phases that each fit a
# 10-minute device call. Each phase runs studies' experiments/<study>/run.sh: their records land in the studies'
# records/ folders and, with OUT_DIR, also as OUT_DIR/<study>-<records folder>-<stamp>.tgz (unpack each with `tar -xzf` in the
# checkout's root, then regenerate the docs' tables with `python -m moe_lab.report`).
#   bash experiments/performance_suite.sh PHASE [OUT_DIR]
#   two_gpu          grid_30b two_gpu
#   torchtitan       torchtitan_baseline two_gpu (its four AC settings)
#   one_gpu          grid_30b one_gpu on GPU 0 while GPU 1 runs torchtitan_baseline one_gpu
#   gpu_tests        gpu_tests one_gpu, then gpu_tests two_gpu
#   depth            offload_depth search
#   seq8192          grid_30b seq8192, moe_layer ep2
#   torchtitan_8192  torchtitan_baseline seq8192
#   grid_235b        grid_235b two_gpu
#   torchtitan_235b  torchtitan_baseline two_gpu_235b
#   one_gpu_235b     grid_235b one_gpu on GPU 0 while GPU 1 runs torchtitan_baseline one_gpu_235b
#   routing_skew     routing_skew
# Two one-GPU parts side by side share the host's CPUs and memory bandwidth (docs/performance.md says where).
set -uo pipefail
phase=${1:-}
OUT=${2:+$(realpath -m "$2")}
export OUT
study() { bash "$(dirname "$0")/../experiments/$1/run.sh" "${@:2}"; }
side_by_side() {  # side_by_side "STUDY PART" "STUDY PART": the first on GPU 0, the second on GPU 1
  (export CUDA_VISIBLE_DEVICES=1; study $2) &
  CUDA_VISIBLE_DEVICES=0 study $1
  wait
}

case "$phase" in
two_gpu) study grid_30b two_gpu ;;
torchtitan) study torchtitan_baseline two_gpu ;;
one_gpu) side_by_side "grid_30b one_gpu" "torchtitan_baseline one_gpu" ;;
gpu_tests) study gpu_tests one_gpu; study gpu_tests two_gpu ;;
depth) study offload_depth search ;;
seq8192) study grid_30b seq8192; study moe_layer ep2 ;;
torchtitan_8192) study torchtitan_baseline seq8192 ;;
grid_235b) study grid_235b two_gpu ;;
torchtitan_235b) study torchtitan_baseline two_gpu_235b ;;
one_gpu_235b) side_by_side "grid_235b one_gpu" "torchtitan_baseline one_gpu_235b" ;;
routing_skew) study routing_skew ;;
*)
  echo "unknown phase '$phase' (two_gpu, torchtitan, one_gpu, gpu_tests, depth, seq8192, torchtitan_8192, grid_235b," \
    "torchtitan_235b, one_gpu_235b, routing_skew)" >&2
  exit 2
  ;;
esac
