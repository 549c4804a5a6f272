#!/usr/bin/env bash
# torchtitan 0.2.2 on grid_30b's proxy (benchmarks/torchtitan_baseline.py), AC full and selective, one part per call:
#   bash experiments/torchtitan_baseline/run.sh one_gpu|two_gpu|seq8192   (1 GPU, 2 GPUs, 2 GPUs at seq 8192)
# torchtitan and its wheels must be importable (bash benchmarks/fetch_wheels.sh, docs/performance.md "Reproduce").
# Records: records/<machine>_1gpu|2gpu|2gpu_seq8192/<UTC start>.json (see ../common.sh).
source "$(dirname "$0")/../common.sh"
case "${1:-}" in
one_gpu) out=$(record 1gpu).json && timeout 250 python3 benchmarks/torchtitan_baseline.py --seq-lens 16384 \
           --points 1:full,1:selective --timeout 120 --out "$out" ;;
two_gpu) out=$(record 2gpu).json && timeout 170 python3 benchmarks/torchtitan_baseline.py --seq-lens 16384 \
           --points 2:full,2:selective --timeout 80 --out "$out" ;;
seq8192) out=$(record 2gpu_seq8192).json && timeout 150 python3 benchmarks/torchtitan_baseline.py --seq-lens 8192 \
           --points 2:full,2:selective --timeout 70 --out "$out" ;;
*) echo "usage: $0 one_gpu|two_gpu|seq8192" >&2; exit 2 ;;
esac
pack "$out"
