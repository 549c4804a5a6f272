#!/usr/bin/env bash
# One sitting of the studies behind docs/performance.md on a two-GPU H200 machine, in phases that each fit a
# 10-minute device call. Each phase runs studies' experiments/<study>/run.sh: their records land in the studies'
# records/ folders and, with OUT_DIR, also as OUT_DIR/<study>-<stamp>.tgz (unpack each with `tar -xzf` in the
# checkout's root, then regenerate the docs' tables with `python experiments/doc_tables.py`).
#   bash benchmarks/performance_suite.sh PHASE [OUT_DIR]
#   two_gpu       grid_30b two_gpu, torchtitan_baseline two_gpu, moe_layer ep2
#   one_gpu       grid_30b one_gpu on GPU 0 while GPU 1 runs torchtitan_baseline one_gpu, then gpu_tests one_gpu
#   depth         gpu_tests two_gpu, then offload_depth search
#   seq8192       grid_30b seq8192, torchtitan_baseline seq8192
#   routing_skew  routing_skew
set -uo pipefail
phase=${1:-}
OUT=${2:+$(realpath -m "$2")}
export OUT
study() { bash "$(dirname "$0")/../experiments/$1/run.sh" "${@:2}"; }

case "$phase" in
two_gpu) study grid_30b two_gpu; study torchtitan_baseline two_gpu; study moe_layer ep2 ;;
one_gpu)
  (export CUDA_VISIBLE_DEVICES=1; study torchtitan_baseline one_gpu; study gpu_tests one_gpu) &
  CUDA_VISIBLE_DEVICES=0 study grid_30b one_gpu
  wait
  ;;
depth) study gpu_tests two_gpu; study offload_depth search ;;
seq8192) study grid_30b seq8192; study torchtitan_baseline seq8192 ;;
routing_skew) study routing_skew ;;
*)
  echo "unknown phase '$phase' (two_gpu, one_gpu, depth, seq8192, routing_skew)" >&2
  exit 2
  ;;
esac
