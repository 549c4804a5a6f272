#!/usr/bin/env bash
# torchtitan 0.2.2 on grid_30b's and grid_235b's proxies (experiments/torchtitan_baseline/torchtitan_baseline.py) in each of its AC
# settings (none, full, op-selective, layer-selective every 2nd block), one part per 10-minute device call:
#   bash experiments/torchtitan_baseline/run.sh one_gpu|two_gpu|seq8192   30B, 4 layers: 1 GPU, 2 GPUs, 2 GPUs at seq 8192
#   bash experiments/torchtitan_baseline/run.sh one_gpu_235b|two_gpu_235b 235B, 2 layers: 1 GPU, 2 GPUs
#   bash experiments/torchtitan_baseline/run.sh four_gpu|four_gpu_235b   4 GPUs (nvidia-h200-x4): 30B and 235B, 4 layers
#   bash experiments/torchtitan_baseline/run.sh full_depth|full_depth_seq32768   1 GPU: 48 layers, 16 experts (one GPU's
#                                               share of Qwen3-30B-A3B at EP 8, experiments/full_depth's shape), seq 16384 | 32768
# torchtitan and its wheels must be importable (bash scripts/fetch_wheels.sh, docs/performance.md "Reproduce").
# Each job gets its own timeout (a job past it is recorded as `timeout` and the next one starts); the part's own
# timeout, above the jobs' sum, only guards the asset building. Records: records/<machine>_<part's label>/<UTC
# start>.json (see ../common.sh).
source "$(dirname "$0")/../common.sh"
settings() { local gpus=$1 ac points=(); for ac in none full op-selective layer-selective; do points+=("$gpus:$ac"); done; (IFS=,; echo "${points[*]}"); }
baseline() {  # baseline LABEL SEQ GPUS JOB_TIMEOUT [ARGS...]
  out=$(record "$1").json
  timeout $((4 * $4 + 40)) python3 experiments/torchtitan_baseline/torchtitan_baseline.py --seq-lens "$2" --points "$(settings "$3")" \
    --timeout "$4" --out "$out" "${@:5}"
}
case "${1:-}" in
one_gpu) baseline 1gpu 16384 1 115 ;;
two_gpu) baseline 2gpu 16384 2 90 ;;
seq8192) baseline 2gpu_seq8192 8192 2 80 ;;
one_gpu_235b) baseline 1gpu_235b 16384 1 115 --flavour 235B-A22B --layers 2 ;;
two_gpu_235b) baseline 2gpu_235b 16384 2 110 --flavour 235B-A22B --layers 2 ;;
four_gpu) baseline 4gpu 16384 4 110 ;;
four_gpu_235b) baseline 4gpu_235b 16384 4 115 --flavour 235B-A22B --layers 4 ;;
full_depth) baseline 1gpu_48l16e 16384 1 130 --layers 48 --experts 16 --steps 8 --timing-from 4 ;;
full_depth_seq32768) baseline 1gpu_48l16e_seq32768 32768 1 130 --layers 48 --experts 16 --steps 7 --timing-from 4 ;;
*) echo "usage: $0 one_gpu|two_gpu|seq8192|one_gpu_235b|two_gpu_235b|four_gpu|four_gpu_235b|full_depth|full_depth_seq32768" >&2; exit 2 ;;
esac
pack "$out"
